"""Chapter 3 — the canonical worker result: one format, whatever the worker did locally.

Every worker call that processes a shard returns a `WorkerResult`: who produced it (its
`WorkerIdentity`), which samples it covered, the per-sample outputs (a chapter 2 `Batch`:
packed per-token columns and per-sample scalars), metrics that carry their own reduction, and
timing spans. One micro-batch or twenty, packed or padded, tensor-parallel replica or not — the
result looks the same, so the driver's merge (`merge.py`) never needs to know.

Metrics are stored in a form that merges exactly: a mean keeps its weighted *sum* and its
*weight* (tokens or samples), so the mean over all shards is sum(sums) / sum(weights) — the
whole-batch mean — and never the mean of per-shard means.

This file only defines the values. Building them on a worker is `builder.py`; merging them on
the driver is `merge.py`; drawing their spans is `timeline.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from avrid.dispatch import Batch
from avrid.workers import WorkerIdentity

RESULT_VERSION = 1
"""Bumped whenever the fields of `WorkerResult` change meaning; `merge` refuses others."""

Reduction = Literal["mean_tokens", "mean_samples", "sum", "min", "max"]
REDUCTIONS: tuple[str, ...] = ("mean_tokens", "mean_samples", "sum", "min", "max")


@dataclass(frozen=True, slots=True, kw_only=True)
class Metric:
    """One named metric in mergeable form.

    For a mean, `total` is the weighted sum and `weight` the tokens or samples behind it; for
    "sum", `total` is the sum; for "min"/"max", `total` is the extreme. `weight` counts what was
    reduced in every case, so an empty metric (weight 0) is recognisable.

    Example (a loss of 2.0 over 10 tokens and 4.0 over 30 tokens):
        >>> a = Metric(name="loss", reduction="mean_tokens", total=20.0, weight=10)
        >>> b = Metric(name="loss", reduction="mean_tokens", total=120.0, weight=30)
        >>> a.merge(b).value        # (20 + 120) / 40, not (2 + 4) / 2
        3.5
    """

    name: str
    reduction: Reduction
    total: float
    weight: float
    per_rank: bool = False
    """True for a fact about the worker (peak memory, its own time), merged over every rank;
    False for a fact about samples, merged over collect ranks only (TP replicas of a shard
    would otherwise count the same samples twice)."""

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"metric {self.name!r}: unknown reduction {self.reduction!r}; "
                             f"allowed: {REDUCTIONS}")
        if not math.isfinite(self.total) or not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(f"metric {self.name!r}: total and weight must be finite and "
                             f"weight >= 0, got total={self.total}, weight={self.weight}")

    @property
    def value(self) -> float:
        """The reduced value (NaN for a mean over nothing)."""
        if self.reduction in ("mean_tokens", "mean_samples"):
            return self.total / self.weight if self.weight else math.nan
        return self.total

    def merge(self, other: Metric) -> Metric:
        """This metric and `other` reduced together (same name, reduction and scope)."""
        if (other.name, other.reduction, other.per_rank) != (self.name, self.reduction,
                                                               self.per_rank):
            raise ValueError(f"cannot merge metric {self.name!r} ({self.reduction}, "
                             f"per_rank={self.per_rank}) with {other.name!r} "
                             f"({other.reduction}, per_rank={other.per_rank})")
        if self.reduction in ("min", "max"):
            pick = min if self.reduction == "min" else max
            present = [m.total for m in (self, other) if m.weight > 0]
            total = pick(present) if present else self.total
        else:
            total = self.total + other.total
        return Metric(name=self.name, reduction=self.reduction, total=total,
                      weight=self.weight + other.weight, per_rank=self.per_rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """A named interval of work on one worker (or the driver), in wall-clock seconds."""

    name: str
    start: float
    """`time.time()` at the start: wall clock, comparable across processes on one machine."""
    end: float

    def __post_init__(self) -> None:
        if not self.end >= self.start:
            raise ValueError(f"span {self.name!r} ends ({self.end}) before it starts "
                             f"({self.start})")

    @property
    def duration(self) -> float:
        """Seconds between start and end."""
        return self.end - self.start


UNPACK = "unpack"
"""A worker span `ResultBuilder` adds: from the builder's creation (the method has its
shard, unpickled) to the first compute span."""
PACK = "pack"
"""A worker span `ResultBuilder` adds: from the last compute span's end to the result built
(its outputs checked and concatenated); Ray then serialises it and sends it back."""
HANDLING_SPANS = frozenset({UNPACK, PACK})
"""The worker's own handling of a call around its compute: orchestration, not compute."""


def compute_seconds(spans: Iterable[Span]) -> float:
    """Seconds of compute among a result's spans: every span but `HANDLING_SPANS`."""
    return sum(s.end - s.start for s in spans if s.name not in HANDLING_SPANS)


@contextmanager
def timed(spans: list[Span], name: str) -> Iterator[None]:
    """Time the enclosed work and append it to `spans` as a span called `name` (kept even if
    the work raises: a failed phase still shows on the timeline)."""
    start = time.time()
    try:
        yield
    finally:
        spans.append(Span(name=name, start=start, end=time.time()))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class WorkerResult:
    """What every worker returns for its shard. Build it with `ResultBuilder`.

    Example (the outputs of rank 2 of a dp=2 x tp=2 actor, a collect rank):
        WorkerResult(version=1, identity=actor[2] (dp=1, tp=0), sample_ids=[7, 3, 9],
                     outputs=Batch(ids [7, 3, 9], packed {"logprobs"}, scalars {"value"}),
                     metrics=(Metric(name="loss", ...),), spans=(Span("forward", ...),))
    """

    version: int
    """Format version; `RESULT_VERSION` when made by this avrid."""
    identity: WorkerIdentity
    """Who produced it: role, rank, mesh coordinates, node, devices."""
    sample_ids: torch.Tensor
    """(n,) int64 — the samples this worker processed, in the order it was sent them."""
    outputs: Batch | None
    """Per-sample outputs in `sample_ids` order; None on non-collect ranks, which return no
    data (their tensor-parallel peer with tp=0 returns the same rows)."""
    metrics: tuple[Metric, ...] = ()
    spans: tuple[Span, ...] = ()
    """The compute spans the worker timed (``builder.span``), then ``unpack`` and ``pack``
    (`HANDLING_SPANS`): its handling of the call before and after them."""

    def __post_init__(self) -> None:
        # A result leaves its worker for the driver: a CUDA tensor in it would be unpickled
        # onto the driver's own GPU. `ResultBuilder` keeps CPU copies; this catches a result
        # made any other way.
        tensors = {"sample_ids": self.sample_ids}
        if self.outputs is not None:
            o = self.outputs
            tensors.update(prompt_lens=o.prompt_lens, response_lens=o.response_lens,
                           **{f"outputs[{k!r}]": p.values for k, p in o.packed.items()},
                           **{f"outputs[{k!r}]": t for k, t in o.scalars.items()})
        off = [f"{name} on {t.device}" for name, t in tensors.items() if t.device.type != "cpu"]
        if off:
            raise ValueError(f"a WorkerResult must hold CPU tensors only (it travels to the "
                             f"driver); got {', '.join(off)}")

    @property
    def is_collect(self) -> bool:
        """Whether this result carries data (its worker is a collect rank)."""
        return self.outputs is not None


def merge_metrics(metrics: Iterable[Metric]) -> dict[str, Metric]:
    """Reduce metrics by name; metrics sharing a name must share reduction and scope."""
    out: dict[str, Metric] = {}
    for m in metrics:
        out[m.name] = out[m.name].merge(m) if m.name in out else m
    return out
