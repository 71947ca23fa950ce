"""Benchmark — does each advantage estimator and policy loss learn the default task on CPU?

Issue 29's acceptance item 3: every new estimator (RLOO, REINFORCE++, REINFORCE++-baseline)
and policy loss (GSPO, CISPO) trains the default task, validation reward above its step-0
value after 100 steps, three seeds, in the synchronous loop and in one-step-off pipelining.

What is run: ``avrid ppo`` (a child process, as a user types it) once per variant x mode x
seed, each from the CLI's defaults for its ``--algo`` (the critic-free names start from
``tiny-grpo``: 2-digit reversal, 16 prompts x 16 responses a step, Ray, actor dp = 2, lr
2e-3), for ``--steps`` steps (100), validating every 25 steps (greedy, 30 held-out prompts):

    rloo                          --algo rloo
    reinforce_plus_plus           --algo reinforce_plus_plus
    reinforce_plus_plus_baseline  --algo reinforce_plus_plus_baseline
    gspo                          --algo grpo --set algo.policy_loss=gspo
    gspo_paper_clips              the same with GSPO's paper clips (clip_low 3e-4, clip_high
                                  4e-4; not run by default)
    cispo                         --algo grpo --set algo.policy_loss=cispo
    grpo                          --algo grpo (the reference line)
    ppo                           --algo ppo (tiny-ppo, with a critic; not run by default)

Modes: ``sync`` (chapter 5's loop) and ``one_step_off`` (chapter 6: rollout workers, as many
as actor ranks, generate step k+1 while the trainer trains step k; the config's default
correction, TIS). Printed per variant and mode: for each seed the validation reward at step
0 and at the last step, whether it rose, the curve in between and the run's wall time; then
how many runs learned. Target: every run's final validation reward > its step-0 value.

What it is not: a comparison of the estimators' speed or final quality (one preset, its
learning rate tuned for GRPO, 100 steps), and not a timed test.

Run: ``python benchmarks/estimators_learn.py [--steps 100] [--seeds 0 1 2] [--variants ...]
[--modes sync one_step_off] [--jobs 1] [--set section.field=value ...]``. 35-90 s a run on
2 cores (one_step_off the slower); the default 36 runs took 40 minutes on a shared machine.
Exits 0 whether or not the target is met (a benchmark, not a test), non-zero if a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS: dict[str, list[str]] = {
    "rloo": ["--algo", "rloo"],
    "reinforce_plus_plus": ["--algo", "reinforce_plus_plus"],
    "reinforce_plus_plus_baseline": ["--algo", "reinforce_plus_plus_baseline"],
    "gspo": ["--algo", "grpo", "--set", "algo.policy_loss=gspo"],
    "gspo_paper_clips": ["--algo", "grpo", "--set", "algo.policy_loss=gspo",
                         "--set", "algo.clip_low=3e-4", "--set", "algo.clip_high=4e-4"],
    "cispo": ["--algo", "grpo", "--set", "algo.policy_loss=cispo"],
    "grpo": ["--algo", "grpo"],
    "ppo": ["--algo", "ppo"],
}
"""Variant name -> the ``avrid ppo`` arguments that select it."""
DEFAULT_VARIANTS = ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo",
                    "cispo", "grpo"]
MODES = ("sync", "one_step_off")


@dataclass(frozen=True)
class Result:
    """One run: its validation curve [(step, reward)], wall seconds, and error (None = ok)."""

    variant: str
    mode: str
    seed: int
    curve: list[tuple[int, float]]
    seconds: float
    error: str | None = None

    @property
    def learned(self) -> bool:
        """Whether the last validation reward is above the step-0 one."""
        return len(self.curve) >= 2 and self.curve[0][0] == 0 and \
            self.curve[-1][1] > self.curve[0][1]


def run_one(variant: str, mode: str, seed: int, steps: int, extra: list[str],
            out: Path) -> Result:
    """Run ``avrid ppo`` for one variant, mode and seed into `out`; read its metrics.jsonl."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    val_every = 25 if steps % 25 == 0 else steps  # the last step is always validated
    cmd = [sys.executable, "-m", "avrid.cli", "ppo", *VARIANTS[variant], "--steps", str(steps),
           "--seed", str(seed), "--out", str(out), "--set", "train.progress=false",
           "--set", f"train.val_every={val_every}", "--set", f"pipeline.mode={mode}"]
    for o in extra:
        cmd += ["--set", o]
    start = time.perf_counter()
    log = out.with_suffix(".log")
    with log.open("w") as f:
        done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = " | ".join(log.read_text().strip().splitlines()[-3:])
        return Result(variant, mode, seed, [], seconds, f"exit {done.returncode}: {tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [(int(r["step"]), float(r["val/reward"])) for r in rows if "val/reward" in r]
    return Result(variant, mode, seed, curve, seconds)


def report(r: Result) -> str:
    """One line for a run: step-0 and last validation reward, whether it rose, curve, wall."""
    head = f"{r.variant:<29} {r.mode:<12} seed {r.seed}"
    if r.error:
        return f"{head}  FAILED ({r.seconds:.0f} s): {r.error}"
    (s0, v0), (sn, vn) = r.curve[0], r.curve[-1]
    mid = " ".join(f"{v:.3f}" for _, v in r.curve[1:-1])
    return (f"{head}  val step {s0} {v0:.3f} -> step {sn} {vn:.3f}  "
            f"{'learned' if r.learned else 'DID NOT LEARN'}  ({r.seconds:5.1f} s)  "
            f"between: {mid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=VARIANTS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (default 1: each run already uses 2 ranks)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE", help="added to every run")
    args = parser.parse_args()
    if args.steps < 1 or args.jobs < 1:
        parser.error(f"--steps and --jobs must be >= 1, got {args.steps} and {args.jobs}")
    plan = [(v, m, s) for v in args.variants for m in args.modes for s in args.seeds]
    print(f"{len(plan)} runs of {args.steps} steps, {args.jobs} at a time; extra: "
          f"{' '.join(args.overrides) or 'none'}", flush=True)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="avrid-estimators-learn-") as tmp, \
            ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, v, m, s, args.steps, args.overrides,
                               Path(tmp) / f"{v}-{m}-{s}") for v, m, s in plan]
        for future in futures:  # in plan order, so the log reads like the table
            results.append(future.result())
            print(report(results[-1]), flush=True)
    print()
    print_table(results, args.seeds)
    return 1 if any(r.error for r in results) else 0


def print_table(results: list[Result], seeds: list[int]) -> None:
    """The summary: per variant and mode, each seed's step-0 -> last val reward, walls."""
    cells = " | ".join(f"seed {s}" for s in seeds)
    print(f"| variant | mode | {cells} | learned | wall per run (s) |")
    print("|---|---|" + "---|" * len(seeds) + "---|---|")
    by_key = {(r.variant, r.mode, r.seed): r for r in results}
    learned = 0
    for variant in dict.fromkeys(r.variant for r in results):
        for mode in dict.fromkeys(r.mode for r in results):
            runs = [by_key[variant, mode, s] for s in seeds if (variant, mode, s) in by_key]
            if not runs:
                continue
            vals = " | ".join("failed" if r.error else
                              f"{r.curve[0][1]:.3f} -> {r.curve[-1][1]:.3f}" for r in runs)
            ok = sum(r.learned for r in runs)
            learned += ok
            walls = ", ".join(f"{r.seconds:.0f}" for r in runs)
            print(f"| {variant} | {mode} | {vals} | {ok}/{len(runs)} | {walls} |")
    print(f"\ntarget: every run's final val reward > its step-0 value: {learned}/"
          f"{len(results)} runs -> {'PASS' if learned == len(results) else 'FAIL'}")


if __name__ == "__main__":
    sys.exit(main())
