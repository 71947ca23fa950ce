"""One `run_shards` call, stage by stage, read from a step's timeline (used by bench_ppo.py).

A call leaves six driver spans (plan, split, submit, wait, receive, merge) and, on each rank,
its compute spans between ``unpack`` and ``pack``. From them, for the rank that answered last
(its reply is what ends the driver's wait):

    plan, split, submit      the driver's spans (each shard is pickled into its call inside
                             submit: `call_wire`)
    transport in             end of submit -> start of that rank's unpack: Ray's dispatch
                             of the call and the shard's unpickling
    unpack, pack             the rank's own spans around its compute
    between spans            the rank's Python between its compute spans
    transport out            end of pack -> end of the driver's wait: the result's
                             pickling and its way back
    receive, merge           the driver's spans

Pickling and unpickling the shards happen inside submit and transport in, where no span can
separate them; `serialisation_ms` times them apart, on the same shards, as `call_wire` does.
A shard several TP ranks share would also be ``ray.put`` once inside split: the benchmark's
groups have no TP, so none is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from avrid.dispatch import Batch, DispatchConfig, Shard, make_plan
from avrid.ppo.roles.policy import LOGPROBS_READS
from avrid.results import Span, compute_seconds
from avrid.results.result import PACK, UNPACK
from avrid.results.timeline import Lane
from avrid.workers import call_wire

CALL_SPANS = ("plan", "split", "submit", "wait", "receive", "merge")  # run_shards', in order
STAGES = ("plan", "split", "submit", "transport in", "unpack", "between spans", "pack",
          "transport out", "receive", "merge")
"""One call's stages in the order they happen."""


def call_stages(call: Sequence[Span], workers: Sequence[Lane]) -> dict[str, float]:
    """Seconds of each of `STAGES` in one call (its six driver spans, in order)."""
    plan, split, submit, wait, receive, merge = call
    ranks = [[s for s in lane.spans if s.start >= submit.start and s.end <= wait.end]
             for lane in workers]
    last = max((r for r in ranks if r), key=lambda r: max(s.end for s in r))
    unpack = next(s for s in last if s.name == UNPACK)
    pack = next(s for s in last if s.name == PACK)
    between = (pack.start - unpack.end) - compute_seconds(last)
    return {"plan": plan.duration, "split": split.duration, "submit": submit.duration,
            "transport in": unpack.start - submit.end, "unpack": unpack.duration,
            "between spans": between, "pack": pack.duration,
            "transport out": wait.end - pack.end, "receive": receive.duration,
            "merge": merge.duration}


def busiest(workers: Sequence[Lane], start: float, end: float) -> float:
    """The largest per-worker compute seconds inside [start, end] (one call's ranks)."""
    return max((compute_seconds(s for s in lane.spans if s.start >= start and s.end <= end)
                for lane in workers), default=0.0)


def logprob_shards(batch: Batch, shards: int, config: DispatchConfig) -> list[Shard]:
    """The shards the log-prob call of `batch`'s step sends, one per rank."""
    sent = batch.only(*LOGPROBS_READS)
    return make_plan(sent, shards, config).split(sent)


def serialisation_ms(batch: Batch, shards: int, config: DispatchConfig) -> dict[str, float]:
    """The pickling of the log-prob call's shards of `batch` into their calls (all of them,
    one after the other, as the driver's submit does: `call_wire.pack`) and the unpickling of
    one (as each rank does), in milliseconds, timed apart from any call."""
    parts = logprob_shards(batch, shards, config)
    t0 = time.perf_counter()
    packed = [call_wire.pack(((part,), {})) for part in parts]
    t1 = time.perf_counter()
    for blob, buffers in packed:
        call_wire.unpack(blob, buffers)
    t2 = time.perf_counter()
    return {"serialise": (t1 - t0) * 1000, "deserialise": (t2 - t1) * 1000 / len(parts)}


def print_stages(stages: Sequence[dict[str, float]],
                 serial: Sequence[dict[str, float]]) -> None:
    """The median of each stage over `stages` (one dict per call), and the serialisation."""
    def ms(values: Sequence[float]) -> float:
        return statistics.median(values) if values else float("nan")

    print(f"one run_shards call, stage by stage (median ms over {len(stages)} calls; the "
          f"worker's stages are the last rank to answer's):")
    for who, names in (("driver", STAGES[:3]), ("worker", STAGES[3:8]),
                       ("driver", STAGES[8:])):
        print(f"  {who:<7}" + "".join(f"{n} {ms([c[n] for c in stages]) * 1000:.2f}  "
                                      for n in names))
    print(f"  of which, timed apart on each step's log-prob shards: pickling them "
          f"(inside submit) {ms([s['serialise'] for s in serial]):.2f}, unpickling one "
          f"(inside transport in) {ms([s['deserialise'] for s in serial]):.2f}; ray.put "
          f"0 (no shard is shared by TP ranks here)")
