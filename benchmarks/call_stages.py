"""One `run_shards` call, stage by stage, read from a step's timeline (used by bench_ppo.py).

A call leaves six driver spans (plan, split, submit, wait, receive, merge) and, on each rank,
its compute spans between ``unpack`` and ``pack``. From them, for the rank that answered last
(its reply is what ends the driver's wait):

    plan, split, submit      the driver's spans (Ray serialises each shard inside submit)
    transport in             end of submit -> start of that rank's unpack: Ray's dispatch
                             of the call and the shard's deserialisation
    unpack, pack             the rank's own spans around its compute
    between spans            the rank's Python between its compute spans
    transport out            end of pack -> end of the driver's wait: the result's
                             serialisation and its way back
    receive, merge           the driver's spans

Serialising and deserialising the shards happen inside submit and transport in, where no span
can separate them; `serialisation_ms` times them apart, on the same shards, with Ray's own
serializer. A shard several TP ranks share would also be ``ray.put`` once inside split: the
benchmark's groups have no TP, so none is.
"""

from __future__ import annotations

import pickle
import statistics
import time
from collections.abc import Sequence

import ray
from ray import cloudpickle

from avrid.dispatch import Batch, DispatchConfig, make_plan
from avrid.ppo.roles.policy import LOGPROBS_READS
from avrid.results import Span, compute_seconds
from avrid.results.result import PACK, UNPACK
from avrid.results.timeline import Lane

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


def serialisation_ms(batch: Batch, shards: int, config: DispatchConfig) -> dict[str, float]:
    """Ray's serialisation of the log-prob call's shards of `batch` (all of them, one after
    the other, as the driver's submit does) and the deserialisation of one (as each rank
    does), in milliseconds, timed apart from any call."""
    context = ray._private.worker.global_worker.get_serialization_context()
    sent = batch.only(*LOGPROBS_READS)
    parts = make_plan(sent, shards, config).split(sent)
    t0 = time.perf_counter()
    for part in parts:
        context.serialize(part)
    t1 = time.perf_counter()
    data = [cloudpickle.dumps(part, protocol=5) for part in parts]
    t2 = time.perf_counter()
    for blob in data:
        pickle.loads(blob)
    t3 = time.perf_counter()
    return {"serialise": (t1 - t0) * 1000, "deserialise": (t3 - t2) * 1000 / len(parts)}


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
    print(f"  of which, timed apart on each step's log-prob shards: Ray serialising them "
          f"(inside submit) {ms([s['serialise'] for s in serial]):.2f}, deserialising one "
          f"(inside transport in) {ms([s['deserialise'] for s in serial]):.2f}; ray.put "
          f"0 (no shard is shared by TP ranks here)")
