"""Benchmark — what scoring each response as it finishes buys: rewards after vs during generation.

What is measured: whole GRPO steps (the `tiny-grpo` model, 8 prompts x 8 responses, a
96-token response budget, one policy rank and the reward worker each a Ray actor of its
own) whose reward function costs a known time per sample (`timed_reward.py`: a sleep of
``--reward-ms``), with ``rollout.stream_rewards`` off (chapter 5's order: the reward phase
starts once the last response is generated) and on (`avrid/ppo/driver/reward_stream.py`:
each response is sent to the reward worker as the engine finishes it), interleaved run by
run so that the machine's drift hits both alike. Per step, from the step's timeline:

    reward      the reward phase's wall time (time/reward): what the step spends scoring
                once generation has returned (streamed: only the last samples' scoring)
    tail        the reward phase's end minus the engine's last token (the policy ranks'
                last "generate" span): the above plus the generate call's own return
    one sample  the reward worker's compute over the step / the step's samples
    dispatch    one reward call's own cost: the serial reward phase minus its compute
                (planning, sending, Ray's transport both ways, merging)
    last step   samples the engine finished at its last decoding step (one rank: those as
                long as the longest): no stream can score them before generation ends
    step        time/step

The first ``--warmup`` steps of every run are left out; each figure is the median over the
measured steps of all rounds.

Target (issue 43, acceptance 4): the streamed reward phase <= one sample + dispatch. Both
modes compute the same thing: the metrics are compared bit for bit (scores, reward/length,
everything but the timings), and a difference fails the benchmark.

Run: ``python benchmarks/bench_stream_rewards.py [--rounds 2] [--steps 6] [--warmup 1]
[--reward-ms 2] [--set section.field=value ...]``. Exits 0 whether or not the target is met,
non-zero if a run fails or the two modes disagree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.results import Timeline

MODES = {"serial": "rollout.stream_rewards=false", "stream": "rollout.stream_rewards=true"}
MACHINE = ("time/", "perf/", "sync/", "bench/")
"""Keys that measure the machine: everything else must agree between the modes."""
REWARD = Path(__file__).resolve().parent / "timed_reward.py"


def config(mode: str, steps: int, extra: list[str]) -> PPOConfig:
    return with_overrides(preset("tiny-grpo"), [
        "placement.backend=ray", "placement.actor_dp=1", "placement.cpus_per_worker=0.5",
        "rollout.max_response_tokens=96", "train.micro_batch_tokens=1024",
        "train.prompts_per_step=8", "algo.responses_per_prompt=8", "train.mini_batch_size=64",
        f"task.reward={REWARD}:score", f"train.steps={steps}", "train.progress=false",
        MODES[mode], *extra])


def figures(timeline: Timeline, samples: int) -> dict[str, float]:
    """The step's tail, reward compute per sample, reward phase and last call's size."""
    spans = {lane.label: lane.spans for lane in timeline.lanes}
    generated = max(s.end for label, lane in spans.items() if label.startswith("policy[")
                    for s in lane if s.name == "generate")
    phase = next(s for s in spans["driver"] if s.name == "reward")
    scored = [s for label, lane in spans.items() if label.startswith("reward[")
              for s in lane if s.name == "reward"]
    compute = sum(s.duration for s in scored)
    return {"bench/tail": phase.end - generated, "bench/one_sample": compute / samples,
            "bench/dispatch": phase.duration - compute, "bench/calls": float(len(scored))}


def measure(cfg: PPOConfig, warmup: int) -> list[dict]:
    """The metrics of steps `warmup`.. of one run, each with its `figures`."""
    rows = []
    with Trainer(cfg) as trainer:
        trainer.start()
        for step in range(cfg.train.steps):
            metrics, batch = trainer.train_step(step)
            metrics.update(figures(trainer.timeline, len(batch)))
            # The samples the engine finished at its last step (one rank: the longest ones):
            # no stream can score them before generation ends.
            lens = batch.response_lens
            metrics["bench/last_step"] = float((lens == lens.max()).sum())
            if step >= warmup:
                rows.append(metrics)
    return rows


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows if key in r)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reward-ms", type=float, default=2.0)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()
    os.environ["AVRID_BENCH_REWARD_MS"] = str(args.reward_ms)  # the workers inherit it
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        runs = {}
        for mode in MODES:  # interleaved: drift hits both alike
            runs[mode] = measure(config(mode, args.steps, args.overrides), args.warmup)
            rows[mode] += runs[mode]
            print(f"round {r + 1}/{args.rounds} {mode:<7} step "
                  f"{med(runs[mode], 'time/step'):.3f} s, tail "
                  f"{med(runs[mode], 'bench/tail'):.4f} s", flush=True)
        algorithmic = {mode: [{k: v for k, v in row.items() if not k.startswith(MACHINE)}
                              for row in runs[mode]] for mode in MODES}
        if algorithmic["serial"] != algorithmic["stream"]:
            print("the serial and the streamed run computed different metrics", file=sys.stderr)
            return 1
    s, t = rows["serial"], rows["stream"]
    print(f"\ntiny-grpo on Ray, 64 samples per step, reward {args.reward_ms:g} ms per sample; "
          f"medians of {len(s)} steps per mode (same metrics bit for bit)")
    print(f"{'':<34}{'serial':>10}{'stream':>10}")
    for label, key, unit in [
            ("reward phase, time/reward (s)", "time/reward", 4),
            ("tail after the last token (s)", "bench/tail", 4),
            ("one sample's scoring (s)", "bench/one_sample", 4),
            ("reward calls per step", "bench/calls", 0),
            ("samples done at the last step", "bench/last_step", 0),
            ("time/generate (s)", "time/generate", 3), ("time/step (s)", "time/step", 3)]:
        print(f"{label:<34}{med(s, key):>10.{unit}f}{med(t, key):>10.{unit}f}")
    dispatch = med(s, "bench/dispatch")
    bar = med(t, "bench/one_sample") + dispatch
    phase = med(t, "time/reward")
    print(f"\ndispatch of one reward call (serial reward phase - its compute): {dispatch:.4f} s")
    print(f"streamed reward phase {phase:.4f} s vs one sample + dispatch {bar:.4f} s: "
          f"{'met' if phase <= bar else 'NOT met'}")
    print(f"step: serial {med(s, 'time/step'):.3f} s, stream {med(t, 'time/step'):.3f} s "
          f"({med(t, 'time/step') / med(s, 'time/step'):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
