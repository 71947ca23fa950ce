"""Chapter 3 — `ResultBuilder`: the worker-side assembler of the canonical result.

A worker walks its shard however suits it — one micro-batch or twenty, packed sequences or a
padded (batch, max_len) tensor — and hands each micro-batch's outputs to the builder. The
builder turns them into one `WorkerResult` in the shard's own sample order, so the local
strategy cannot leak into what the driver sees:

    builder = ResultBuilder.for_shard(self.identity, shard)
    for mb in shard.micro_batches():
        with builder.span("forward"):
            logits = model(...)
        builder.add(mb.sample_ids, packed={"logprobs": rows}, scalars={"value": v})
        builder.metric("loss", per_token_loss, "mean_tokens")
    return builder.build()

On a non-collect rank (a tensor-parallel replica with tp != 0) `build` drops the outputs and
keeps spans and metrics: its collect peer returns the same rows. Besides the spans the worker
times, `build` adds two of its own: ``unpack`` (from the builder's creation, when the method
has its shard, to the first span) and ``pack`` (from the last span to the result built), the
worker's side of the call's orchestration cost (`result.HANDLING_SPANS`).

A result leaves its worker as CPU tensors only: the builder keeps a CPU copy of every tensor
it is given (`add`, `add_padded`, `metric`; a tensor already on the CPU is kept as it is, at
no cost), and its other tensors (ids, lengths) come from the shard it was sent, which crossed
as CPU tensors. So a worker may compute on a GPU and hand its outputs over as they are; a CUDA
tensor sent to the driver would otherwise be unpickled onto the driver's own GPU
(tests/test_device_discipline.py checks it). This file runs inside workers; it does not merge
(`merge.py`) or draw (`timeline.py`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager

import torch

from avrid.dispatch import Batch, Packed, Shard
from avrid.results.result import (
    PACK,
    RESULT_VERSION,
    UNPACK,
    Metric,
    Reduction,
    Span,
    WorkerResult,
    timed,
)
from avrid.workers import WorkerIdentity


def is_collect_rank(identity: WorkerIdentity, data_axis: str | None = None) -> bool:
    """True when every mesh coordinate but the data axis is 0 (e.g. tp = 0 of a dp x tp mesh).
    The data axis defaults to the first axis of the identity's mesh coordinates."""
    names = list(identity.coords)
    axis = names[0] if data_axis is None and names else data_axis
    return all(v == 0 for k, v in identity.coords.items() if k != axis)


class ResultBuilder:
    """Collects one shard's micro-batch outputs, metrics and spans into a `WorkerResult`."""

    def __init__(self, identity: WorkerIdentity, batch: Batch, *,
                 data_axis: str | None = None) -> None:
        self.identity = identity
        self.collect = is_collect_rank(identity, data_axis)
        self._batch = batch  # the samples as sent: their ids, lengths and order
        self._parts: list[Batch] = []
        self._metrics: dict[str, Metric] = {}
        self._spans: list[Span] = []
        # The method has its arguments (unpickled before it was called): from here
        # to the first compute span is the worker's own unpacking of the call.
        self._created = time.time()

    @classmethod
    def for_shard(cls, identity: WorkerIdentity, shard: Shard, *,
                  data_axis: str | None = None) -> ResultBuilder:
        """A builder for the shard a worker was sent."""
        return cls(identity, shard.batch, data_axis=data_axis)

    @classmethod
    def for_call(cls, identity: WorkerIdentity) -> ResultBuilder:
        """A builder for a call that is sent no samples (a weight sync): its result carries
        only spans and metrics, so it joins the step's timing and timeline like any other."""
        return cls(identity, Batch.from_rows(sample_ids=[], prompt_lens=[], response_lens=[]))

    def span(self, name: str) -> AbstractContextManager[None]:
        """Time the enclosed work as a span called `name` (kept even if it raises)."""
        return timed(self._spans, name)

    def add(self, sample_ids: Sequence[int] | torch.Tensor, *,
            packed: Mapping[str, Sequence[torch.Tensor] | Packed] | None = None,
            scalars: Mapping[str, torch.Tensor] | None = None) -> None:
        """Outputs of some samples: per-token columns as rows (or `Packed`), per-sample
        columns as (n, ...) tensors, all in the order of `sample_ids`; on any device (the
        result keeps CPU copies)."""
        ids = torch.as_tensor(sample_ids, dtype=torch.int64).cpu().reshape(-1)
        pos = self._batch.positions_of(ids)  # unknown ids fail here, naming them
        columns = {k: _on_cpu(v if isinstance(v, Packed) else Packed.from_rows(list(v)))
                   for k, v in (packed or {}).items()}
        self._parts.append(Batch(sample_ids=ids, prompt_lens=self._batch.prompt_lens[pos],
                                 response_lens=self._batch.response_lens[pos],
                                 packed=columns,
                                 scalars={k: v.cpu() for k, v in (scalars or {}).items()}))

    def add_padded(self, sample_ids: Sequence[int] | torch.Tensor, lengths: torch.Tensor, *,
                   padded: Mapping[str, torch.Tensor],
                   scalars: Mapping[str, torch.Tensor] | None = None) -> None:
        """Like `add`, for right-padded (n, max_len, ...) tensors: row i keeps its first
        `lengths[i]` entries, the padding is dropped, so the result is the packed one."""
        if not padded:
            raise ValueError("add_padded needs at least one padded column (name -> tensor)")
        lengths, padded = lengths.cpu(), {k: v.cpu() for k, v in padded.items()}
        keep = torch.arange(next(iter(padded.values())).shape[1]) < lengths[:, None]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        torch.cumsum(lengths.to(torch.int64), 0, out=offsets[1:])
        self.add(sample_ids, scalars=scalars,
                 packed={k: Packed(values=v[keep], offsets=offsets) for k, v in padded.items()})

    def metric(self, name: str, values: torch.Tensor | float, reduction: Reduction, *,
               per_rank: bool = False) -> None:
        """Accumulate a metric: for "mean_tokens" pass per-token values, for "mean_samples"
        per-sample values; "sum", "min" and "max" reduce whatever is passed. Repeated calls
        (one per micro-batch) reduce together exactly. Pass per-token or per-sample values,
        never a micro-batch's own aggregate, so the result cannot depend on how the shard was
        cut. Tensors may be on any device (the reduction runs on a CPU copy)."""
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu()
        v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
        if reduction in ("min", "max"):
            total = float(v.min() if reduction == "min" else v.max()) if len(v) else 0.0
        else:
            total = float(v.sum())
        m = Metric(name=name, reduction=reduction, total=total, weight=float(len(v)),
                   per_rank=per_rank)
        self._metrics[name] = self._metrics[name].merge(m) if name in self._metrics else m

    def build(self) -> WorkerResult:
        """The canonical result. Collect ranks must have added every sample exactly once."""
        outputs = None
        if self.collect:
            added = [p.sample_ids for p in self._parts]
            got = torch.cat(added) if added else self._batch.sample_ids[:0]
            # The usual case, the ids as sent in the order sent, is exactly once by itself
            # (sent ids are unique); anything else gets the full check, which names the ids.
            if not torch.equal(got, self._batch.sample_ids):
                _check_exactly_once(self.identity, self._batch.sample_ids, got)
            if not self._parts:
                outputs = self._batch.take([])  # a shard with no samples
            else:
                outputs = (self._parts[0] if len(self._parts) == 1
                           else Batch.concat(self._parts))
                if not torch.equal(outputs.sample_ids, self._batch.sample_ids):
                    outputs = outputs.select(self._batch.sample_ids)  # the order sent
        # Around the compute spans, the call's handling on this side: `unpack` before the
        # first, `pack` after the last (all of it is `unpack` in a call that timed nothing).
        done = time.time()
        first = min((s.start for s in self._spans), default=done)
        last = max((s.end for s in self._spans), default=done)
        handling = (Span(name=UNPACK, start=self._created, end=max(first, self._created)),
                    Span(name=PACK, start=last, end=max(done, last)))
        return WorkerResult(version=RESULT_VERSION, identity=self.identity,
                            sample_ids=self._batch.sample_ids, outputs=outputs,
                            metrics=tuple(self._metrics.values()),
                            spans=(*self._spans, *handling))


def _on_cpu(col: Packed) -> Packed:
    """`col` with its tensors on the CPU (`col` itself when they are there already)."""
    if col.values.device.type == "cpu" and col.offsets.device.type == "cpu":
        return col
    return Packed(values=col.values.cpu(), offsets=col.offsets.cpu())


def _check_exactly_once(identity: WorkerIdentity, sent: torch.Tensor,
                        added: torch.Tensor) -> None:
    ids, counts = torch.unique(added, return_counts=True)
    twice = ids[counts > 1].tolist()
    missing = sorted(set(sent.tolist()) - set(ids.tolist()))
    if twice or missing:
        raise ValueError(f"{identity.name}: outputs must cover each sample it was sent "
                         f"exactly once; added twice: {twice}, never added: {missing}")
