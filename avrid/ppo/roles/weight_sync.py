"""Chapter 5 — the last step of every iteration: trained weights into the rollout engine.

In the hybrid engine each actor rank holds 1/dp of the weights as FSDP2 shards and a rollout
engine that needs them whole. That is chapter 4's problem with source = `ModelLayout.fsdp`
over the dp ranks and target = every rank holding a full replica, so this file uses chapter
4: `plan_transfer` once (the plans depend only on shapes), `execute` every step over the
actor's process group, `WeightSink.load` into the engine, then the fingerprint check — the
checksums of every rank's shards are gathered and added up, which gives the whole tensors'
checksums, and compared with what each engine now holds, so a stale or half-loaded engine
stops the run.

The weights stream, one load group at a time: a group is a run of whole modules (vLLM loads
a fused q/k/v or gate/up module only once all its pieces arrived, so a module is never cut)
holding at most half a bucket; each group is assembled on the trainer's device (its own
shards copied, the other ranks' received), loaded, and freed before the next one. The groups
are produced lazily by a generator that the engine consumes in ONE load per sync
(`WeightSink.load_stream`): on vLLM one `reload_weights`, which costs a pass over every module
of the model whatever it carries, so one per group would cost (groups x modules). Nothing
goes through host memory on a GPU, and at most about one bucket of whole tensors and receive
buffers is alive at once, whatever the model's size (a single module larger than half a
bucket, e.g. a big embedding, is a group of its own).

The engine may hold a lower precision than the trainer: bf16 training keeps fp32 master
weights (`fsdp.py`) while the engine generates in bf16. Each rank casts its fp32 shards to the
engine's dtype BEFORE the transfer (half the bytes on the wire), one group at a time, and the
fingerprint is taken of the cast shards: the cast is per element, so the cast shards'
checksums still add up to the checksum of the cast whole tensor — exactly what a correctly
loaded engine holds.

This file runs inside a policy worker. It does not know about PPO, nor when the engine wakes
(`handoff.py` says, `policy.py` calls); the worker calls it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
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
from avrid.reshard.engines import WeightSink, vllm_param_name

BUCKET_BYTES = 64 << 20
"""Memory bound of a sync: whole tensors of one load group plus its receive buffers."""

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncReport:
    """What one sync did, for the metrics."""

    bytes_moved: int
    """Bytes this rank received from other ranks."""
    engine_bytes: int
    """Bytes loaded into this rank's engine (its dtype): the whole model, or the adapters."""
    seconds: float
    """Wall time of transfer + load + check on this rank."""


def load_groups(shapes: Shapes, group_bytes: int) -> list[tuple[str, ...]]:
    """Parameter names cut into load groups, in order: runs of whole modules of at most
    `group_bytes` (a module larger than that alone). A module is what vLLM loads as one: a
    parameter's parent, with q/k/v and gate/up counted as their fused module.

    Example:
        >>> f32 = torch.float32
        >>> shapes = {f"l.{m}.weight": ((4, 4), f32) for m in ("q_proj", "k_proj", "o_proj")}
        >>> load_groups(shapes, group_bytes=128)     # q and k form one fused module: 128 B
        [('l.q_proj.weight', 'l.k_proj.weight'), ('l.o_proj.weight',)]
    """
    modules: dict[str, list[str]] = {}
    for name in shapes:  # dicts keep order: modules in the model's parameter order
        modules.setdefault(vllm_param_name(name)[0].rpartition(".")[0], []).append(name)
    groups: list[tuple[str, ...]] = []
    current: list[str] = []
    used = 0
    for names in modules.values():
        size = sum(math.prod(shapes[n][0]) * shapes[n][1].itemsize for n in names)
        if current and used + size > group_bytes:
            groups.append(tuple(current))
            current, used = [], 0
        current += names
        used += size
    if current:
        groups.append(tuple(current))
    return groups


class WeightSync:
    """FSDP shards of the actor -> full weights in this rank's rollout engine, checked."""

    def __init__(self, shards: dict[str, torch.Tensor], shapes: dict[str, tuple[tuple[int, ...],
                 str]], *, rank: int, world_size: int, engine_dtype: torch.dtype,
                 bucket_bytes: int | None = None) -> None:
        """`shapes`: name -> (shape, trainer dtype) of every actor parameter; `engine_dtype`:
        what the engine holds, which the shards are cast to before they move; `bucket_bytes`:
        the memory bound (half for a group's whole tensors, half for receive buffers;
        default `BUCKET_BYTES`)."""
        self.rank = rank
        self.engine_dtype = engine_dtype
        # Both layouts are in the engine's dtype: the cast happens on the source rank.
        cast: Shapes = {n: (s, engine_dtype) for n, (s, _) in shapes.items()}
        self.source = ModelLayout.fsdp(cast, world_size)
        # What one engine holds: every tensor whole (its checksums are whole-tensor ones).
        self.engine_layout = _replicated(cast, 1)
        self.engine_bytes = sum(math.prod(s) * d.itemsize for s, d in cast.values())
        half = max(1, (BUCKET_BYTES if bucket_bytes is None else bucket_bytes) // 2)
        self.groups = load_groups(cast, half)
        # One plan per group, from the shapes alone. Rank r plays source rank r and target
        # rank r: its own shard never crosses a wire.
        self.plans: list[TransferPlan] = [
            plan_transfer(ModelLayout.fsdp({n: cast[n] for n in names}, world_size),
                          _replicated({n: cast[n] for n in names}, world_size),
                          same_process={r: r for r in range(world_size)}, bucket_bytes=half)
            for names in self.groups]
        _check_local_shapes(self.source, rank, shards)

    def run(self, shards: Mapping[str, torch.Tensor], sink: WeightSink,
            group: dist.ProcessGroup | None, device: str | torch.device = "cpu") -> SyncReport:
        """Move, load and verify, group by group, in one load of the engine
        (`WeightSink.load_stream`: one vLLM reload per sync); every rank of the group calls
        it at once."""
        start = time.perf_counter()
        mine: dict[str, int] = {}

        def groups() -> Iterator[dict[str, torch.Tensor]]:
            """Each group's whole tensors, made only when the engine asks for them (the
            transfer's collectives run inside the load, in the same order on every rank)."""
            for names, plan in zip(self.groups, self.plans, strict=True):
                # A no-op (the same tensors) when the dtypes already agree, e.g. fp32
                # training, and the shards are on `device` (not when offloaded: FSDP2's CPU
                # offload).
                part = {n: shards[n].to(device, self.engine_dtype) for n in names}
                # The fingerprint check: the checksums of the (cast) source shards, added
                # over all ranks, are the whole (cast) tensors' checksums.
                mine.update(layout_checksums(plan.source, self.rank, part))
                yield execute(plan, self.rank, part, group=group, device=device)
                del part  # this group's tensors die here, before the next group's are made

        sink.load_stream(groups())
        sink.finish()
        parts: list[dict[str, int]] = [mine]
        if group is not None and dist.get_world_size(group) > 1:
            parts = [{} for _ in range(dist.get_world_size(group))]
            dist.all_gather_object(parts, mine, group=group)
        check_same(combine(parts), sink.checksums(self.engine_layout, 0),
                   where=f"rollout engine of policy rank {self.rank}")
        return SyncReport(bytes_moved=sum(p.bytes_to(self.rank) for p in self.plans),
                          engine_bytes=self.engine_bytes,
                          seconds=time.perf_counter() - start)


def _replicated(shapes: Shapes, world_size: int) -> ModelLayout:
    """Every rank holds every tensor whole (each rank's engine)."""
    return ModelLayout(world_size=world_size, params=tuple(
        (n, ParamLayout.replicated(s, d, world_size)) for n, (s, d) in shapes.items()))


def _check_local_shapes(layout: ModelLayout, rank: int, shards: dict[str, torch.Tensor]) -> None:
    for name, p in layout.params:
        region = p.regions[rank]
        want = tuple(region.shape) if region is not None else None
        got = tuple(shards[name].shape)
        if want is not None and got != want:
            raise ValueError(f"{name!r}: rank {rank} holds a shard of shape {got} but FSDP2's "
                             f"dim-0 chunking predicts {want}")
