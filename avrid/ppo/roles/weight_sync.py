"""Chapter 5 — the last step of every iteration: trained weights into the rollout engine.

In the hybrid engine each actor rank holds 1/dp of the weights as FSDP2 shards and a rollout
engine that needs them whole. That is chapter 4's problem with source = `ModelLayout.fsdp`
over the dp ranks and target = every rank holding a full replica, so this file just uses
chapter 4: `plan_transfer` once (the plan depends only on shapes), `execute` every step over
the actor's process group, `WeightSink.load` into the engine, then the fingerprint check —
the checksums of every rank's shards are gathered and added up, which gives the whole
tensors' checksums, and compared with what each engine now holds, so a stale or
half-loaded engine stops the run.

The engine may hold a lower precision than the trainer: bf16 training keeps fp32 master
weights (`fsdp.py`) while the engine generates in bf16. Each rank casts its fp32 shards to the
engine's dtype BEFORE the transfer (half the bytes on the wire), and the fingerprint is taken
of the cast shards: the cast is per element, so the cast shards' checksums still add up to the
checksum of the cast whole tensor — exactly what a correctly loaded engine holds.

This file runs inside a policy worker. It does not know about PPO; the worker calls it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from avrid.reshard import (
    ModelLayout,
    ParamLayout,
    TransferPlan,
    check_same,
    combine,
    execute,
    layout_checksums,
    plan_transfer,
)
from avrid.reshard.engines import WeightSink

BUCKET_BYTES = 64 << 20
"""Size bound of one transfer bucket: at most this much send/receive buffer is alive at once."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncReport:
    """What one sync did, for the metrics."""

    bytes_moved: int
    """Bytes this rank received from other ranks."""
    seconds: float
    """Wall time of transfer + load + check on this rank."""


class WeightSync:
    """FSDP shards of the actor -> full weights in this rank's rollout engine, checked."""

    def __init__(self, shards: dict[str, torch.Tensor], shapes: dict[str, tuple[tuple[int, ...],
                 str]], *, rank: int, world_size: int, engine_dtype: torch.dtype) -> None:
        """`shapes`: name -> (shape, trainer dtype) of every actor parameter; `engine_dtype`:
        what the engine holds, which the shards are cast to before they move."""
        self.rank = rank
        self.engine_dtype = engine_dtype
        # Both layouts are in the engine's dtype: the cast happens on the source rank.
        shapes = {n: (s, engine_dtype) for n, (s, _) in shapes.items()}
        self.source = ModelLayout.fsdp(shapes, world_size)
        self.target = ModelLayout(world_size=world_size, params=tuple(
            (n, ParamLayout.replicated(s, d, world_size)) for n, (s, d) in shapes.items()))
        # What one engine holds: every tensor whole (its checksums are whole-tensor ones).
        self.engine_layout = ModelLayout(world_size=1, params=tuple(
            (n, ParamLayout.replicated(s, d, 1)) for n, (s, d) in shapes.items()))
        # Rank r plays source rank r and target rank r: its own shard never crosses a wire.
        self.plan: TransferPlan = plan_transfer(
            self.source, self.target, same_process={r: r for r in range(world_size)},
            bucket_bytes=BUCKET_BYTES)
        _check_local_shapes(self.source, rank, shards)

    def run(self, shards: dict[str, torch.Tensor], sink: WeightSink,
            group: dist.ProcessGroup | None, device: str = "cpu") -> SyncReport:
        """Move, load and verify; every rank of the group must call it at once."""
        start = time.perf_counter()
        # A no-op (the same tensors) when the dtypes already agree, e.g. fp32 training.
        shards = {n: t.to(self.engine_dtype) for n, t in shards.items()}
        full = execute(self.plan, self.rank, shards, group=group, device=device)
        sink.load(full)
        sink.finish()
        # The fingerprint check: the checksums of the (cast) source shards, added over all
        # ranks, are the whole (cast) tensors' checksums; each engine must hold exactly those.
        parts: list[dict[str, int]] = [layout_checksums(self.source, self.rank, shards)]
        if group is not None and dist.get_world_size(group) > 1:
            mine = parts[0]
            parts = [{} for _ in range(dist.get_world_size(group))]
            dist.all_gather_object(parts, mine, group=group)
        check_same(combine(parts), sink.checksums(self.engine_layout, 0),
                   where=f"rollout engine of policy rank {self.rank}")
        return SyncReport(bytes_moved=self.plan.bytes_to(self.rank),
                          seconds=time.perf_counter() - start)


def _check_local_shapes(layout: ModelLayout, rank: int, shards: dict[str, torch.Tensor]) -> None:
    for name, p in layout.params:
        region = p.regions[rank]
        want = tuple(region.shape) if region is not None else None
        got = tuple(shards[name].shape)
        if want is not None and got != want:
            raise ValueError(f"{name!r}: rank {rank} holds a shard of shape {got} but FSDP2's "
                             f"dim-0 chunking predicts {want}")
