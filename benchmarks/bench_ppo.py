"""Benchmark — where a PPO step's time goes: model compute in workers vs orchestration overhead.

What is measured: whole training steps of the chapter 5 `Trainer` (Ray backend, the policy and
the critic each FSDP2 over dp = 2 CPU workers, colocated, plus one reward worker) on the
``small-cpu`` preset (PPO, a 256-wide, 4-layer model on 6-digit reversal), where model compute
should dominate the step, with 16 responses per prompt and mini-batches of 256 instead of the
preset's 8 and 128 (``SMALL_OVERRIDES``: the same calls carry twice the work; printed with the
results). The trainer is driven directly — ``start()``, ``train_step(step)`` a few times,
``close()`` — with no validation, checkpoint or logging around it. The first step is a warm-up
(first-call costs: gloo connections, allocator growth, lazy imports) and is not reported;
every number is the median over the measured steps (``--steps``, 5 by default), shares being
the median of each step's own share.

Per step, from the trainer's own records (`Trainer.train_step`'s metrics and `trainer.timeline`,
the chapter 3 timeline of that step):

    wall       the phase's driver span (``time/<phase>``): from the driver entering the phase
               to it leaving, as the trainer times it
    compute    for every `run_shards` call of the phase, the busiest rank's summed worker spans
               (the `ResultBuilder.span`s around model work: generate, old_logp, values,
               forward_backward, optimizer, reward), added over the phase's calls. The busiest
               rank is the critical path of a call; ranks wait for each other inside FSDP
               collectives, and that wait sits inside their spans, so it counts as compute.
               Calls are matched to the worker spans that lie inside their send..wait window.
    overhead   wall - compute: everything in the phase that is not model compute in a worker

The step's overhead share is 1 - compute / step, the trainer's ``time/overhead``
(``time/step`` runs from the start of `train_step` to when its metrics are taken), and the
target is <= 10 % on ``small-cpu``. The rows add up: "between phases" is the driver's time
outside any named phase (picking prompts, building the prompt batch, computing the
metrics).

What overhead counts, and where the script shows it going (``run_shards``'s driver spans):

    plan       making the chapter 2 dispatch plan
    split      cutting the batch into one shard per rank
    submit     calling every rank (each shard is pickled into its call here, `call_wire`; a
               shard that several TP ranks read would be ``ray.put`` once: none here)
    wait - compute   the rest of each call's wait beyond its busiest rank's compute: Ray's
               transport (dispatching the call, unpickling the shard, pickling the
               `WorkerResult` and sending it back) and the worker's own handling of the call
               outside compute spans (its ``unpack`` and ``pack`` spans, and its Python
               between compute spans)
    receive    fetching and unpickling every rank's `WorkerResult` on the driver
    merge      checking and merging the canonical results on the driver
    driver     driver work inside phases but outside `run_shards`: attaching columns to the
               batch, GAE / group advantages (the whole ``advantages`` phase)
    weight sync   the ``weight_sync`` phase beyond its ranks' own ``weight_sync`` spans
               (transfer of the FSDP shards, engine load, fingerprint check: worker work,
               counted as compute like every other phase's): the call's transport
    between phases   as above

What is not counted as overhead: anything inside a worker span, including FSDP's all-gathers
and reduce-scatters and any rank waiting for another in them, and the rollout engine's
wake/sleep (inside the ``generate`` span). What is not measured at all: cluster start-up (it
is printed, not judged), validation, checkpoints, metric logging.

Then one call, stage by stage (medians over every call of the measured steps): the driver's
plan, split and submit; for the rank that answered last (its reply ends the driver's wait),
transport in (the end of ``submit`` to the start of its ``unpack``: Ray's dispatch and the
shard's unpickling), ``unpack``, its work between compute spans, ``pack``, transport out
(the end of ``pack`` to the end of ``wait``: the result's pickling and return); the
driver's receive and merge. The same spans are in the run's timeline (`trainer.timeline`), so
a user sees them there. The call's fixed overhead (its six driver spans minus its busiest
rank's compute) is printed against a bare Ray fan-out (``ray.get`` of a no-op on as many
plain actors, one per bundle, as `bench_workers.py` measures it) timed in the same run: in a
block of 50 after every measured step, with the trainer's workers alive beside the actors (the
same machine load the calls see; judged, target <= 2x), and alone on the cluster after the
runs (printed too: on 2 cores the trainer's idle processes alone slow every round trip).

Beside it, Ray's own floor for such a call, on the same plain actors after every measured
step: each is sent the step's log-prob shard (as the byte string avrid sends, Ray's cheapest
argument), holds it (asleep) as long as the step's median call computes, and sends it back;
wall time minus the hold is what Ray alone costs for a call that carries this data and lasts
this long, with no plan, check or merge. On this 2-core VM that floor is itself well over
twice the no-op fan-out (a process that waited ~15 ms is slower to wake than one that never
slept, and a no-op carries nothing), so the call is printed against both.

For contrast the same is printed for ``tiny-ppo`` (a 2-layer, 64-wide model): there the
models are so small that orchestration dominates the step. That is expected and is why the
target is judged on ``small-cpu`` only.

Run: ``python benchmarks/bench_ppo.py [--steps 5] [--contrast-steps 3] [--no-contrast]
[--set section.field=value ...]`` (``--set`` changes the small-cpu preset like ``avrid ppo
--set``). It exits 0 whether or not the target is met (a benchmark, not a test), and non-zero
when the measurement could not be made (a step failed, or no step was measured); the ratio is
printed either way, from the steps that did complete.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import call_stages as stages
import ray
from bench_workers import BareFanOut, bare_fan_out_ms

from avrid.ppo.data.prompts import step_indices
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.outputs.plots import PHASES
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.results import Timeline
from avrid.results.timeline import DRIVER
from avrid.workers import call_wire

TARGET_OVERHEAD = 0.10  # on small-cpu: orchestration <= 10 % of a step
BETWEEN = "(between phases)"
# Where the overhead goes, in the order printed; their sum is step - compute.
SOURCES = ("plan", "split", "submit", "wait - compute", "receive", "merge", "driver",
           "weight sync", BETWEEN)
BENCH_OVERRIDES = ("train.progress=false",)
# small-cpu as the preset has it, with twice the responses per prompt and a mini-batch twice as
# large: the same 8 calls per step carry twice the tokens, so the fixed cost of a call (and of
# the weight sync, which scales with the model, not the batch) is measured against enough work
# for the step to stay ~5-8 s here. Prompts per step stay 32: the driver's prompt sampling
# costs per prompt, not per response.
SMALL_OVERRIDES = ("algo.responses_per_prompt=16", "train.mini_batch_size=256")


@dataclass
class StepBreakdown:
    """One measured step: per-phase wall and compute seconds, and the overhead by source."""

    step: float
    compute: float
    """The trainer's ``time/compute``."""
    wall: dict[str, float] = field(default_factory=dict)
    phase_compute: dict[str, float] = field(default_factory=dict)
    sources: dict[str, float] = field(default_factory=dict)
    calls: int = 0
    call_overheads: list[float] = field(default_factory=list)
    """Per run_shards call: its six driver spans minus its busiest rank's compute."""
    call_computes: list[float] = field(default_factory=list)
    """Per run_shards call: its busiest rank's compute (how long Ray's floor call holds)."""
    call_stages: list[dict[str, float]] = field(default_factory=list)
    """Per run_shards call: seconds of each of `call_stages.STAGES`."""
    pick_prompts: float = 0.0
    """`data.step_indices` for this step, timed again on its own (part of "between phases")."""
    tokens: int = 0
    """Prompt + response tokens of the step's batch."""

    @property
    def overhead(self) -> float:
        return max(0.0, 1.0 - self.compute / self.step)


def breakdown(metrics: dict[str, float], timeline: Timeline) -> StepBreakdown:
    """Split one step's time by phase and the overhead by source (see the module docstring)."""
    out = StepBreakdown(step=metrics["time/step"], compute=metrics["time/compute"])
    driver = next(lane for lane in timeline.lanes if lane.label == DRIVER)
    workers = [lane for lane in timeline.lanes if lane.label != DRIVER]
    phases = [s for s in driver.spans if s.name in PHASES]
    call_spans = sorted((s for s in driver.spans if s.name in stages.CALL_SPANS),
                        key=lambda s: s.start)
    n = len(stages.CALL_SPANS)
    calls = [call_spans[i:i + n] for i in range(0, len(call_spans), n)]
    if any(tuple(s.name for s in c) != stages.CALL_SPANS for c in calls):
        raise RuntimeError(f"driver spans are not {'/'.join(stages.CALL_SPANS)} sequences: "
                           f"{[s.name for s in call_spans]}")
    src = dict.fromkeys(SOURCES, 0.0)
    for phase in phases:
        out.wall[phase.name] = phase.duration
        mine = [c for c in calls if phase.start <= c[0].start <= phase.end]
        compute = sum(stages.busiest(workers, c[2].start, c[3].end) for c in mine)
        if not mine:  # a call with no batch (the weight sync): its ranks' spans in the phase
            compute = stages.busiest(workers, phase.start, phase.end)
        out.phase_compute[phase.name] = compute
        out.calls += len(mine)
        in_calls = 0.0
        for call in mine:
            spent = sum(s.duration for s in call)
            busy = stages.busiest(workers, call[2].start, call[3].end)
            out.call_overheads.append(spent - busy)
            out.call_computes.append(busy)
            out.call_stages.append(stages.call_stages(call, workers))
            for s in call:
                if s.name != "wait":
                    src[s.name] += s.duration
            in_calls += spent
        src["wait - compute"] += sum(c[3].duration for c in mine) - compute
        rest = phase.duration - in_calls  # the driver's own work in the phase
        if phase.name == "weight_sync":  # its call's cost beyond the ranks' own spans
            src["weight sync"] += phase.duration - compute
        else:
            src["driver"] += rest
    src[BETWEEN] = out.step - sum(out.wall.values())
    out.sources = src
    matched = sum(out.phase_compute.values())
    if abs(matched - out.compute) > 0.01 * out.compute + 1e-3:
        print(f"  warning: worker spans matched to calls add up to {matched:.3f} s, the "
              f"trainer's time/compute is {out.compute:.3f} s (clock skew between processes?)")
    return out


@dataclass
class Measurement:
    """What one preset's run gave: start-up seconds, every step's breakdown, or the error."""

    name: str
    config: PPOConfig
    init_s: float = float("nan")
    """`Trainer(config)`: the task loaded, every prompt tokenized, on the driver."""
    start_s: float = float("nan")
    """`Trainer.start()`: Ray, the workers, their models and process groups."""
    train_prompts: int = 0
    warmup: list[StepBreakdown] = field(default_factory=list)
    steps: list[StepBreakdown] = field(default_factory=list)
    serial: list[dict[str, float]] = field(default_factory=list)
    """Per measured step, Ray's (de)serialisation of its log-prob call's shards, timed apart
    (`call_stages.serialisation_ms`)."""
    bare_ms: list[float] = field(default_factory=list)
    """A bare Ray fan-out to as many plain actors as the actor has ranks, timed after each
    measured step while the trainer's workers are alive (median of a block each)."""
    floor_ms: list[float] = field(default_factory=list)
    """Ray's own cost of a phase call, timed after each measured step on the same plain
    actors: the step's log-prob shards sent (pickled, as avrid sends them), held for its median
    call's compute, sent back (`BareFanOut.held_ms`: wall minus the hold)."""
    error: str | None = None


def measure(name: str, overrides: Sequence[str], steps: int, warmup: int) -> Measurement:
    """Start a trainer for preset `name`, run warm-up + measured steps, close it. After each
    measured step, a block of bare Ray fan-outs to plain actors started beside the trainer."""
    config = with_overrides(preset(name), [*BENCH_OVERRIDES, *overrides])
    m = Measurement(name=name, config=config)
    try:
        t0 = time.perf_counter()
        trainer = Trainer(config)
        bare = None
        try:
            m.init_s = time.perf_counter() - t0
            m.train_prompts = len(trainer.train_set)
            trainer.start()
            m.start_s = time.perf_counter() - t0 - m.init_s
            bare = BareFanOut(config.placement.actor_dp)
            for step in range(warmup + steps):
                metrics, batch = trainer.train_step(step)
                b = breakdown(metrics, trainer.timeline)
                b.tokens = int(batch.total_lens.sum())
                t = config.train
                t1 = time.perf_counter()
                step_indices(step, t.prompts_per_step, len(trainer.train_set), t.seed)
                b.pick_prompts = time.perf_counter() - t1
                (m.warmup if step < warmup else m.steps).append(b)
                if step >= warmup:
                    m.bare_ms.append(bare.median_ms(50))
                    ranks, dispatch = trainer.policy.world_size, trainer.dispatch
                    m.serial.append(stages.serialisation_ms(batch, ranks, dispatch))
                    hold = _median(b.call_computes)
                    # The shards as avrid sends them, pickled: Ray's cheapest way to carry them.
                    sent = [call_wire.pack(((s,), {}))[0]
                            for s in stages.logprob_shards(batch, ranks, dispatch)]
                    m.floor_ms.append(bare.held_ms(hold, sent,
                                                   calls=max(5, min(30, int(1.5 / hold)))))
                print(f"  {name} step {step}{' (warm-up)' if step < warmup else ''}: "
                      f"{b.step:.2f} s, compute {b.compute:.2f} s, overhead "
                      f"{b.overhead:.1%}", flush=True)
        finally:
            if bare is not None:
                bare.close()
            trainer.close()
    except Exception:  # report what was measured, and why the rest was not
        m.error = traceback.format_exc()
        print(m.error, file=sys.stderr)
    return m


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def describe_config(c: PPOConfig) -> str:
    m, t, a, p = c.model, c.train, c.algo, c.placement
    return (f"{a.name}, model hidden {m.hidden_size} x {m.num_layers} layers "
            f"({m.num_heads} heads, {m.dtype}), task {c.task.name} {dict(c.task.options)}, "
            f"{t.prompts_per_step} prompts x {a.responses_per_prompt} responses, mini-batch "
            f"{t.mini_batch_size}, micro-batch {t.micro_batch_tokens} tokens, "
            f"{p.backend} actor_dp={p.actor_dp} critic_dp={p.critic_dp} "
            f"({p.cpus_per_worker:g} CPU per bundle)")


def report(m: Measurement, *, judged: bool) -> float:
    """Print the per-phase table and the overhead sources; return the median overhead share."""
    steps = m.steps
    print(f"\n== {m.name}: {describe_config(m.config)}")
    print(f"not judged: Trainer(config) {m.init_s:.1f} s (tokenizing {m.train_prompts} "
          f"training prompts), start() {m.start_s:.1f} s (workers, models, process groups)")
    print(f"{len(steps)} measured step(s) after {len(m.warmup)} warm-up")
    if not steps:
        print("no step was measured")
        return float("nan")
    print(f"medians over steps ({_median([b.tokens for b in steps]):.0f} tokens and "
          f"{_median([b.calls for b in steps]):.0f} run_shards calls per step); compute = the "
          f"busiest rank's worker spans per call, added; share = overhead / step")
    print(f"{'phase':<18}{'wall s':>9}{'compute s':>11}{'overhead s':>12}{'share':>8}")

    def row(name: str, wall: list[float], comp: list[float]) -> None:
        over = [w - c for w, c in zip(wall, comp, strict=True)]
        share = _median([o / b.step for o, b in zip(over, steps, strict=True)])
        print(f"{name:<18}{_median(wall):>9.3f}{_median(comp):>11.3f}{_median(over):>12.3f}"
              f"{share:>8.1%}")

    for p in (p for p in PHASES if any(p in b.wall for b in steps)):
        row(p, [b.wall.get(p, 0.0) for b in steps], [b.phase_compute.get(p, 0.0) for b in steps])
    row(BETWEEN, [b.sources[BETWEEN] for b in steps], [0.0] * len(steps))
    row("step", [b.step for b in steps], [b.compute for b in steps])

    print("where the overhead goes (seconds per step, median; share of the step):")
    for s in SOURCES:
        v = _median([b.sources[s] for b in steps])
        share = _median([b.sources[s] / b.step for b in steps])
        print(f"  {s:<16}{v:>8.3f}{share:>8.1%}")
    v = _median([b.pick_prompts for b in steps])
    print(f"    of which picking the step's prompts (data.step_indices, over "
          f"{m.config.train.prompts_per_step} prompts of {m.train_prompts}, timed again "
          f"apart): {v:.3f} s")
    shares = [b.overhead for b in steps]
    share = _median(shares)
    verdict = ("PASS" if share <= TARGET_OVERHEAD else "FAIL") if judged else "not judged"
    print(f"overhead share of step time = {share:.1%} [per step {min(shares):.1%}-"
          f"{max(shares):.1%}] (target <= {TARGET_OVERHEAD:.0%} on small-cpu): {verdict}")
    return share


def report_calls(m: Measurement, alone_ms: float) -> None:
    """One phase call stage by stage, and its fixed cost against a bare Ray fan-out: timed
    between the steps, beside the trainer's workers (judged), and alone after the run."""
    per_call = [o for b in m.steps for o in b.call_overheads]
    if not per_call:
        return
    stages.print_stages([c for b in m.steps for c in b.call_stages], m.serial)
    mine, beside = _median(per_call) * 1000, _median(m.bare_ms)
    n = m.config.placement.actor_dp
    print(f"fixed overhead per phase call ({m.name}, median over {len(per_call)} calls: "
          f"plan + split + submit + wait + receive + merge - busiest compute) {mine:.2f} ms")
    print(f"  vs a bare Ray fan-out to {n} plain actors timed between the steps, beside the "
          f"trainer's workers: {beside:.2f} ms: {mine / beside:.1f}x (target <= 2x)")
    print(f"  vs the same fan-out alone on the cluster after the run: {alone_ms:.2f} ms: "
          f"{mine / alone_ms:.1f}x")
    floor = _median(m.floor_ms)
    hold = _median([c for b in m.steps for c in b.call_computes]) * 1000
    print(f"  Ray's own floor for such a call, timed between the steps on the same plain "
          f"actors: each sent its log-prob shard, holding it {hold:.1f} ms (the median call's "
          f"compute) and sending it back: {floor:.2f} ms beyond the hold = "
          f"{floor / beside:.1f}x the bare fan-out (no layer that calls Ray actors does such "
          f"a call for less here); avrid's call is {mine / floor:.1f}x that floor")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="measured small-cpu steps (5)")
    parser.add_argument("--warmup", type=int, default=1, help="unreported first steps (1)")
    parser.add_argument("--contrast-steps", type=int, default=3,
                        help="measured tiny-ppo steps (3)")
    parser.add_argument("--no-contrast", action="store_true", help="skip the tiny-ppo run")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE", help="change the small-cpu preset")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(f"{os.cpu_count()} CPU cores; {args.warmup} warm-up + {args.steps} measured steps "
          f"(small-cpu), {args.contrast_steps} (tiny-ppo)")
    ok = True
    try:
        small = measure("small-cpu", [*SMALL_OVERRIDES, *args.overrides], args.steps,
                        args.warmup)
        if not args.no_contrast:
            tiny = measure("tiny-ppo", [], args.contrast_steps, args.warmup)
        bare = {n: bare_fan_out_ms(n) for n in {small.config.placement.actor_dp,
                                                 *([] if args.no_contrast
                                                   else [tiny.config.placement.actor_dp])}}
    finally:
        ray.shutdown()
    share = report(small, judged=True)
    report_calls(small, bare[small.config.placement.actor_dp])
    ok = small.error is None and bool(small.steps)
    if not args.no_contrast:
        tiny_share = report(tiny, judged=False)
        report_calls(tiny, bare[tiny.config.placement.actor_dp])
        ok = ok and tiny.error is None and bool(tiny.steps)
        print(f"\ntiny-ppo overhead {tiny_share:.1%} vs small-cpu {share:.1%}: with a tiny "
              f"model the fixed cost per call dominates the step")
    if not ok:
        print("the measurement could not be completed (see the error above)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
