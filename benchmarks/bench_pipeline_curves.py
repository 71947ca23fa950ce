"""Benchmark — does one-step-off learn as well as the synchronous loop? Curves, three seeds.

What is run: the default run (``tiny-ppo``: PPO on 2-digit reversal, Ray, actor and critic
dp = 2) for its full ``train.steps`` (300), once per seed (0, 1, 2) in each of two modes:

    sync          chapter 5's loop (hybrid engine)
    one_step_off  chapter 6: two rollout workers generate step k+1 while the trainer trains
                  on step k; every batch after the first is one weight version old; with
                  the off-policy correction ``--correction`` (default ``tis``, truncated
                  importance sampling, which is what the config's ``auto`` applies here;
                  ``none`` shows what staleness costs uncorrected)

Each run is `avrid.pipeline.train` (what ``avrid ppo`` runs), with validation every
``train.val_every`` (25) steps on the held-out prompts (greedy). Printed per run: the
validation reward at every validation and the first step at which it reaches the target;
then, per mode, the mean final validation reward over the seeds. Target: every one-step-off
run reaches the synchronous run's final validation reward of its seed (at the end or
earlier), i.e. one step of staleness costs no learning on this task. A figure with the six
curves is written to ``--out`` (default ``runs/bench_pipeline_curves``).

Run: ``python benchmarks/bench_pipeline_curves.py [--preset tiny-ppo] [--seeds 0 1 2]
[--correction tis] [--steps N] [--set section.field=value ...] [--out DIR]``. It exits 0
whether or not the target is met (a benchmark, not a test), non-zero if a run fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from avrid.pipeline import train
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

MODES = ("sync", "one_step_off")


def run(name: str, mode: str, seed: int, steps: int | None, extra: list[str],
        out: Path) -> list[tuple[int, float]]:
    """(step, validation reward) of one run of preset `name` (`steps` None: the preset's)."""
    config = with_overrides(preset(name), [
        f"pipeline.mode={mode}", f"train.seed={seed}", "train.progress=false",
        f"train.out_dir={out}", *([f"train.steps={steps}"] if steps else []), *extra])
    rows = train(config).rows
    return [(int(r["step"]), float(r["val/reward"])) for r in rows if "val/reward" in r]


def first_reaching(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, reward in curve if reward >= target - 1e-9), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-ppo")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="both by default; the target needs sync")
    parser.add_argument("--correction", default="tis", choices=("none", "tis", "decoupled"),
                        help="pipeline.correction of the one-step-off runs (sync: none)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="default: the preset's (300)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--out", default="runs/bench_pipeline_curves",
                        help="where the figure goes")
    args = parser.parse_args()
    curves: dict[tuple[str, int], list[tuple[int, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode in args.modes:
                started = time.time()
                extra = [*args.overrides, *([f"pipeline.correction={args.correction}"]
                                            if mode == "one_step_off" else [])]
                curves[mode, seed] = run(args.preset, mode, seed, args.steps, extra,
                                         Path(tmp) / f"{mode}-{seed}")
                vals = " ".join(f"{s}:{v:.3f}" for s, v in curves[mode, seed])
                print(f"seed {seed} {mode:<13} {time.time() - started:6.1f} s  val {vals}",
                      flush=True)
    print()
    if set(args.modes) != set(MODES):
        return 0  # the comparison needs both modes
    ok = True
    for seed in args.seeds:
        target = curves["sync", seed][-1][1]
        reached = first_reaching(curves["one_step_off", seed], target)
        ok &= reached is not None
        print(f"seed {seed}: sync final val {target:.3f}; one_step_off final "
              f"{curves['one_step_off', seed][-1][1]:.3f}, reaches {target:.3f} at step "
              f"{reached if reached is not None else 'never'}")
    for mode in MODES:
        finals = [curves[mode, s][-1][1] for s in args.seeds]
        print(f"{mode:<13} mean final val reward {statistics.mean(finals):.3f} "
              f"(seeds: {', '.join(f'{v:.3f}' for v in finals)})")
    print(f"target: every one_step_off run reaches its seed's sync final val reward: "
          f"{'PASS' if ok else 'FAIL'}")
    title = " ".join([args.preset, *args.overrides, f"(one_step_off: {args.correction})"])
    _plot(curves, args.seeds, Path(args.out), title)
    return 0


def _plot(curves: dict, seeds: list[int], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from avrid.results import atomic_write

    fig, ax = plt.subplots(figsize=(7, 4))
    for (mode, seed), curve in sorted(curves.items()):
        steps, vals = zip(*curve, strict=True)
        ax.plot(steps, vals, marker="o", linestyle="-" if mode == "sync" else "--",
                color=f"C{seeds.index(seed)}", label=f"{mode}, seed {seed}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation reward (greedy)")
    ax.set_title(f"{title}: synchronous vs one-step-off", fontsize=9)
    ax.legend(fontsize=8)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "curves.png", lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    print(f"figure: {out / 'curves.png'}")


if __name__ == "__main__":
    sys.exit(main())
