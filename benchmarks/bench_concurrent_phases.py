"""Benchmark — what issuing a step's ready phases together buys: serial vs concurrent phases.

What is measured: whole PPO steps of the `small-cpu` preset with the critic on a CPU pool of
its own (``placement.colocate_critic=false``, one rank per role on Ray, one core each), with
``train.concurrent_phases`` off (chapter 5's order: reward, old_logp, values, advantages,
critic_update, actor_update one after another) and on (`avrid/ppo/driver/concurrent.py`:
values beside old_logp, critic_update beside actor_update), interleaved run by run so that
the machine's drift hits both alike. Per step, from the trainer's own records: ``time/step``
and each phase's time, and from the step's timeline the critic rank's idle share (the part
of the step in which it computed nothing). The first ``--warmup`` steps of every run are
left out; each figure is the median over the measured steps of all rounds.

The longest chain: the step graph's heaviest path (`step_graph.py`), each phase weighted by
its serial median, plus the serial step's time outside its phases (metrics, bookkeeping) —
what the step would take if every phase off that path hid entirely behind it.

Target: concurrent step <= 1.1 x the longest chain, and the critic's idle share lower than
serially. Both runs compute the same thing: the metrics are compared bit for bit, and a
difference fails the benchmark.

Run: ``python benchmarks/bench_concurrent_phases.py [--rounds 3] [--steps 6] [--warmup 2]
[--set section.field=value ...]``. Exits 0 whether or not the target is met, non-zero if a
run fails or the two disagree.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from avrid.ppo.driver.step_graph import step_graph
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

TARGET = 1.1
MODES = {"serial": "train.concurrent_phases=false", "concurrent": "train.concurrent_phases=true"}
MACHINE = ("time/", "perf/", "sync/", "idle/")
"""Keys that measure the machine: everything else must agree between the modes."""


def config(mode: str, steps: int, extra: list[str]) -> PPOConfig:
    return with_overrides(preset("small-cpu"), [
        "placement.colocate_critic=false", "placement.actor_dp=1", "placement.critic_dp=1",
        f"train.steps={steps}", MODES[mode], *extra])


def measure(cfg: PPOConfig, warmup: int) -> list[dict]:
    """The metrics of steps `warmup`.. of one run, each with its critic ranks' idle share."""
    rows = []
    with Trainer(cfg) as trainer:
        trainer.start()
        for step in range(cfg.train.steps):
            metrics, _ = trainer.train_step(step)
            util = trainer.timeline.utilization()
            critic = [u for label, u in util.items() if label.startswith("critic[")]
            metrics["idle/critic"] = statistics.mean(1.0 - u.share for u in critic)
            if step >= warmup:
                rows.append(metrics)
    return rows


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows if key in r)


def longest_chain(cfg: PPOConfig, rows: list[dict]) -> tuple[float, list[str]]:
    """The heaviest path through the step graph by `rows`' median phase times, plus the
    step's time outside its phases; and the path."""
    graph = step_graph(cfg)
    cost = {p.name: med(rows, f"time/{p.name}") if p.timed else 0.0 for p in graph.phases}
    best: dict[str, tuple[float, list[str]]] = {}
    for p in graph.phases:  # in order: every predecessor is already weighed
        before = max((best[b] for b in graph.waits_for(p.name)), default=(0.0, []))
        best[p.name] = (before[0] + cost[p.name], [*before[1], p.name])
    chain, path = max(best.values())
    outside = med(rows, "time/step") - sum(cost.values())
    return chain + outside, path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        runs = {}
        for mode in MODES:  # interleaved: drift hits both alike
            runs[mode] = measure(config(mode, args.steps, args.overrides), args.warmup)
            rows[mode] += runs[mode]
            print(f"round {r + 1}/{args.rounds} {mode:<10}  step "
                  f"{med(runs[mode], 'time/step'):.3f} s", flush=True)
        algorithmic = {mode: [{k: v for k, v in row.items() if not k.startswith(MACHINE)}
                              for row in runs[mode]] for mode in MODES}
        if algorithmic["serial"] != algorithmic["concurrent"]:
            print("the serial and the concurrent run computed different metrics", file=sys.stderr)
            return 1
    cfg = config("serial", args.steps, args.overrides)
    chain, path = longest_chain(cfg, rows["serial"])
    phases = [p.name for p in step_graph(cfg).phases if p.timed]
    print(f"\nsmall-cpu PPO, critic on its own pool; medians of {len(rows['serial'])} steps "
          f"per mode")
    print(f"{'':<22}{'serial':>10}{'concurrent':>12}")
    for key in ["time/step", *(f"time/{p}" for p in phases)]:
        print(f"{key:<22}{med(rows['serial'], key):>10.3f}{med(rows['concurrent'], key):>12.3f}")
    print(f"{'critic idle share':<22}{med(rows['serial'], 'idle/critic'):>10.1%}"
          f"{med(rows['concurrent'], 'idle/critic'):>12.1%}")
    ratio = med(rows["concurrent"], "time/step") / chain
    print(f"\nlongest chain {chain:.3f} s ({' -> '.join(path)}, plus the time outside phases)")
    print(f"concurrent step / longest chain = {ratio:.2f} (target <= {TARGET}): "
          f"{'met' if ratio <= TARGET else 'NOT met'}")
    print(f"serial step / longest chain = {med(rows['serial'], 'time/step') / chain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
