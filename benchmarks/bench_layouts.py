"""Benchmark — the seed's three layouts, serial vs concurrent phases: step time and idle share.

What is measured: whole PPO steps of each layout file of chapter 5
(`chapters/ch05_ppo/configs/layout_*.yaml`: DeepSpeed-Chat, every role on the policy's
bundles; OpenRLHF, actor, reference, critic and reward each on bundles of their own;
NeMo-Aligner, actor + reference on some, critic + rule reward on others), each with
``train.concurrent_phases`` off and on, run by run in turn (round by round, layout by layout,
mode by mode) so that the machine's drift hits all alike. Per step, from the trainer's own
records: ``time/step``, and from the step's timeline each worker rank's idle share (the part
of the step in which it computed nothing). The first ``--warmup`` steps of every run are left
out; each figure is the median over the measured steps of all rounds.

Also printed per layout: the step graph's longest chain (`bench_concurrent_phases.py`'s
`longest_chain`: its heaviest path by the serial phase times, plus the time outside the
phases) and the concurrent step's ratio to it (issue 43's target: <= 1.1).

The six runs compute the same thing — the layouts differ in placement only, and the
concurrent phases give the serial run's numbers — so every run's algorithmic metrics are
compared, bit for bit, with the first's; a difference fails the benchmark.

Run: ``python benchmarks/bench_layouts.py [--rounds 1] [--steps 4] [--warmup 1]
[--set section.field=value ...]`` (``--set`` applies to every run, e.g. a bigger model).
Exits 0 whether or not the target is met, non-zero if a run fails or two runs disagree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench_concurrent_phases import MACHINE, MODES, TARGET, longest_chain, med

from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.config_file import read_config
from avrid.ppo.setup.overrides import with_overrides

CONFIGS = Path(__file__).resolve().parents[1] / "chapters" / "ch05_ppo" / "configs"
LAYOUTS = {"deepspeed_chat": "DeepSpeed-Chat", "openrlhf": "OpenRLHF",
           "nemo_aligner": "NeMo-Aligner"}


def config(layout: str, mode: str, steps: int, extra: list[str]) -> PPOConfig:
    """The layout's file, `steps` steps, phases serial or concurrent, `extra` applied."""
    return with_overrides(read_config(CONFIGS / f"layout_{layout}.yaml"), [
        f"train.steps={steps}", "train.progress=false", f"train.out_dir=runs/bench_{layout}",
        MODES[mode], *extra])


def measure(cfg: PPOConfig, warmup: int) -> list[dict]:
    """The metrics of steps `warmup`.. of one run, each with every worker rank's idle share
    (``idle/<role>[<rank>]``; the driver's lanes are not ranks)."""
    rows = []
    with Trainer(cfg) as trainer:
        trainer.start()
        for step in range(cfg.train.steps):
            metrics, _ = trainer.train_step(step)
            for label, u in trainer.timeline.utilization().items():
                if not label.startswith("driver"):
                    metrics[f"idle/{label}"] = 1.0 - u.share
            if step >= warmup:
                rows.append(metrics)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()
    rows = {(layout, mode): [] for layout in LAYOUTS for mode in MODES}
    reference: list[dict] | None = None  # the first run's algorithmic metrics
    for r in range(args.rounds):
        for layout in LAYOUTS:
            for mode in MODES:
                run = measure(config(layout, mode, args.steps, args.overrides), args.warmup)
                rows[layout, mode] += run
                print(f"round {r + 1}/{args.rounds} {LAYOUTS[layout]:<15}{mode:<11} step "
                      f"{med(run, 'time/step'):.3f} s", flush=True)
                algorithmic = [{k: v for k, v in row.items() if not k.startswith(MACHINE)}
                               for row in run]
                reference = reference if reference is not None else algorithmic
                if algorithmic != reference:
                    print(f"{LAYOUTS[layout]} {mode} computed other metrics than the first "
                          f"run", file=sys.stderr)
                    return 1
    n = len(rows[next(iter(rows))])
    print(f"\nthe three layouts of chapter 5 (PPO, a KL term), serial vs concurrent phases; "
          f"medians of {n} steps per layout and mode")
    for layout, title in LAYOUTS.items():
        serial, concurrent = rows[layout, "serial"], rows[layout, "concurrent"]
        print(f"\n{title}")
        print(f"  {'':<22}{'serial':>10}{'concurrent':>12}")
        print(f"  {'step (s)':<22}{med(serial, 'time/step'):>10.3f}"
              f"{med(concurrent, 'time/step'):>12.3f}")
        ranks = sorted({k for row in serial for k in row if k.startswith("idle/")})
        for key in ranks:
            print(f"  {key.removeprefix('idle/') + ' idle':<22}{med(serial, key):>10.1%}"
                  f"{med(concurrent, key):>12.1%}")
        mean = [statistics.mean(row[k] for k in ranks) for row in serial], [
            statistics.mean(row[k] for k in ranks) for row in concurrent]
        print(f"  {'mean rank idle':<22}{statistics.median(mean[0]):>10.1%}"
              f"{statistics.median(mean[1]):>12.1%}")
        cfg = config(layout, "serial", args.steps, args.overrides)
        chain, path = longest_chain(cfg, serial)
        ratio = med(concurrent, "time/step") / chain
        print(f"  longest chain {chain:.3f} s ({' -> '.join(path)}); concurrent / chain = "
              f"{ratio:.2f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
