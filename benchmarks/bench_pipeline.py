"""Benchmark — what overlapping generation with training buys: sync vs one-step-off vs async.

What is measured: whole training steps of the `pipeline-cpu` preset (GRPO, one rank per role
on Ray: the trainer's policy rank on one CPU core, in the pipelined modes the rollout worker
on the other; a step whose generation and training take about the same time) in three
modes, interleaved round by round so that the machine's drift hits all three alike:

    sync          chapter 5's loop: generate, then reward ... actor_update, then weight sync
    one_step_off  chapter 6, K = 1: the rollout worker generates step k+1 while the trainer
                  trains step k; a weight push between the pools after each step
    async         chapter 6, K = 2: generation may run up to two versions ahead

Per step, from the trainer's own records: ``time/step``; in sync, ``time/generate`` and the
rest of the step (everything after generation: the "training" side, weight sync included);
in the pipelined modes ``pipeline/overlap`` (the share of the step in which the rollout
worker generated while a trainer worker computed, read from the step's timeline),
``time/wait_rollout`` (the trainer waiting for its batch: the bubble left), the push
(``time/weight_push``, and ``time/push_trainer``: the trainer's share of it) and the
staleness; and the wall clock of each ``train_step`` call as the benchmark sees it. The
first ``--warmup`` steps of every run are left out; each figure is the median over the
measured steps of all rounds.

Target: one-step-off step time <= 1.15 x max(generation, training) of the synchronous step
(perfect overlap would be 1.0 x; sync is the sum of the two).

Run: ``python benchmarks/bench_pipeline.py [--rounds 2] [--steps 8] [--warmup 2]
[--set section.field=value ...]``. Exits 0 whether or not the target is met, non-zero if a
run fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from avrid.pipeline import make_trainer
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

TARGET = 1.15
MODES = {"sync": ["pipeline.mode=sync"],
         "one_step_off": ["pipeline.mode=one_step_off"],
         "async K=2": ["pipeline.mode=async", "pipeline.max_staleness=2"]}


def measure(sets: list[str], steps: int, warmup: int, extra: list[str]) -> list[dict]:
    """The metrics of steps `warmup`..`steps - 1` of one run."""
    config = with_overrides(preset("pipeline-cpu"), [*sets, f"train.steps={steps}", *extra])
    rows = []
    with make_trainer(config) as trainer:
        trainer.start()
        for step in range(steps):
            started = time.perf_counter()
            metrics, _ = trainer.train_step(step)
            if step >= warmup:  # "wall": the whole call, the metrics and timeline included
                rows.append({**metrics, "wall": time.perf_counter() - started})
    return rows


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode, sets in MODES.items():
            started = time.time()
            got = measure(sets, args.steps, args.warmup, args.overrides)
            rows[mode] += got
            print(f"round {r} {mode:<13} {time.time() - started:5.1f} s  step median "
                  f"{med(got, 'time/step'):.3f} s", flush=True)
    sync = rows["sync"]
    gen = med(sync, "time/generate")
    train = statistics.median(x["time/step"] - x["time/generate"] for x in sync)
    bound = max(gen, train)
    print(f"\nsync: step {med(sync, 'time/step'):.3f} s = generation {gen:.3f} s + "
          f"training {train:.3f} s (everything after generation)")
    print(f"{'mode':<13} {'step s':>7} {'x sync':>7} {'x max(gen,train)':>17} "
          f"{'overlap':>8} {'wait s':>7} {'push s':>7} {'trainer s':>9} {'staleness':>10}")
    for mode, got in rows.items():
        step = med(got, "time/step")
        stale = max(x.get("pipeline/staleness_max", 0.0) for x in got)
        print(f"{mode:<13} {step:7.3f} {step / med(sync, 'time/step'):7.2f} "
              f"{step / bound:17.2f} {med(got, 'pipeline/overlap'):8.2f} "
              f"{med(got, 'time/wait_rollout'):7.3f} {med(got, 'time/weight_push'):7.3f} "
              f"{med(got, 'time/push_trainer'):9.3f} {stale:>10.0f}")
    print("(push s: a push from its posting to the last rank's end; trainer s: the part the "
          "trainer ranks spend on it; wall clock per train_step call, metrics included: "
          + ", ".join(f"{m} {med(got, 'wall'):.3f} s" for m, got in rows.items()) + ")")
    ratio = med(rows["one_step_off"], "time/step") / bound
    print(f"\ntarget: one-step-off step <= {TARGET} x max(generation, training) of sync: "
          f"{ratio:.2f} x -> {'PASS' if ratio <= TARGET else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
