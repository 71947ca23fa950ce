"""Chapter 4 — running a transfer plan over torch.distributed (gloo on CPU, NCCL on GPU).

Every process of one process group calls `execute(plan, me, shards, group)` at the same time.
A process may hold a source rank (a training shard), a target rank (a rollout slice), or both
(colocated): `ProcessMap` says which process plays which rank. Then, bucket by bucket:

    local copies   a target slice its own process already holds: a plain tensor copy
    each bucket    the sender slices its shard and sends; the receiver writes into its slice,
                   all the bucket's sends and receives posted together (batch_isend_irecv)

so at most one bucket's worth of temporary buffers exists at a time: peak extra memory is the
bucket size plus the largest single region. A process that only sends (a trainer feeding
engines in other processes, chapter 6) may instead `post_sends` every bucket at once and go
on with its work, waiting for the sends later. `naive_allgather` is the baseline: every rank
all-gathers every full tensor and slices what it needs (verl's old sync path).

Both return the target rank's tensors; `layout_checksums` turns either side into partial
fingerprints that add up across ranks (see `fingerprint.py`). This file does not plan
(`planner.py`) or load into an engine (`engines.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from avrid.reshard.fingerprint import region_checksum
from avrid.reshard.layout import ModelLayout, ParamLayout, Region
from avrid.reshard.planner import Bucket, TransferPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessMap:
    """Which process-group rank plays each source and each target rank.

    Colocated (the hybrid engine): target t lives with source `same_process[t]`. Disaggregated:
    the target ranks come after the S source ranks, in their own processes.
    """

    source: tuple[int, ...]
    """Process rank of source rank s."""
    target: tuple[int, ...]
    """Process rank of target rank t."""

    @classmethod
    def for_plan(cls, plan: TransferPlan) -> ProcessMap:
        """Source rank s is process s; a colocated target joins its source's process, the
        others get new processes after the sources."""
        shared = dict(plan.same_process)
        target, extra = [], plan.source_world
        for t in range(plan.target_world):
            if t in shared:
                target.append(shared[t])
            else:
                target.append(extra)
                extra += 1
        return cls(source=tuple(range(plan.source_world)), target=tuple(target))

    @property
    def world_size(self) -> int:
        """Processes in the group."""
        return max((*self.source, *self.target)) + 1

    def roles_of(self, process: int) -> tuple[int | None, int | None]:
        """(source rank, target rank) that `process` plays; None where it plays none."""
        src = self.source.index(process) if process in self.source else None
        dst = self.target.index(process) if process in self.target else None
        return src, dst


def execute(plan: TransferPlan, process: int, shards: Mapping[str, torch.Tensor],
            group: dist.ProcessGroup | None = None,
            device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Run `plan` from this process's side; return its target rank's tensors (empty if it
    plays no target rank). `shards` holds this process's source shard of every parameter (the
    tensor of its source region; ignored if it plays no source rank)."""
    pmap = ProcessMap.for_plan(plan)
    _, dst = pmap.roles_of(process)
    out = _allocate(plan.target, dst, device)
    for t in plan.local:  # same process holds source and target: no network
        if t.dst_rank == dst:
            _slot(out, plan.target, t).copy_(_piece(shards, plan.source, t))
    for bucket in plan.buckets:
        # One function call per bucket: its send and receive buffers die when it returns,
        # before the next bucket allocates, so at most one bucket's worth is alive.
        _run_bucket(bucket, plan, pmap, process, shards, out, group, device)
    return out


def _run_bucket(bucket: Bucket, plan: TransferPlan, pmap: ProcessMap, process: int,
                shards: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor],
                group: dist.ProcessGroup | None, device: torch.device | str) -> None:
    src, dst = pmap.roles_of(process)
    ops, landing = [], []
    for t in bucket.transfers:
        to, frm = pmap.target[t.dst_rank], pmap.source[t.src_rank]
        if t.src_rank == src and frm == process and to != process:
            # A contiguous copy: send buffers must be dense.
            ops.append(("send", _piece(shards, plan.source, t).contiguous(), to))
        if t.dst_rank == dst and to == process:
            if frm == process:  # sender and receiver in one process, not planned local
                _slot(out, plan.target, t).copy_(_piece(shards, plan.source, t))
                continue
            buf = torch.empty(t.region.shape, dtype=out[t.param].dtype, device=device)
            ops.append(("recv", buf, frm))
            landing.append((t, buf))
    _post(ops, group)
    for t, buf in landing:
        _slot(out, plan.target, t).copy_(buf)


def _post(ops: list[tuple[str, torch.Tensor, int]], group: dist.ProcessGroup | None) -> None:
    """Post one bucket's sends and receives ("send"/"recv", tensor, peer) together; wait."""
    for work in _start(ops, group):
        work.wait()


def _start(ops: list[tuple[str, torch.Tensor, int]],
           group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Post the sends and receives ("send"/"recv", tensor, peer); return them unfinished."""
    if not ops:
        return []
    if group is None or _registered(group):
        return dist.batch_isend_irecv([
            dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group)
            for kind, t, peer in ops])
    # A group built straight from a TCPStore (an in-process rank's, or chapter 6's group
    # joining the trainer and rollout pools) is not in torch.distributed's registry, so
    # P2POp cannot translate its ranks: post on the group object itself. Every process
    # walks the buckets' transfers in the same order, so no receive waits on a send that
    # its peer posts later.
    return [group.send([t], peer, 0) if kind == "send" else group.recv([t], peer, 0)
            for kind, t, peer in ops]


def post_sends(plan: TransferPlan, process: int, shards: Mapping[str, torch.Tensor],
               group: dist.ProcessGroup) -> list[dist.Work]:
    """A process that plays only a source rank (a trainer sending to engines in other
    processes): post every send of the plan at once and return without waiting.

    The receivers take them bucket by bucket, in plan order, as `execute` does. The caller
    must keep `shards` unchanged and alive until every returned work is waited on: pass a
    snapshot, not the live parameters. Memory: the snapshot (this rank's shard), not a
    bucket — the price of not waiting for the receivers."""
    pmap = ProcessMap.for_plan(plan)
    src, dst = pmap.roles_of(process)
    if src is None or dst is not None or any(t.src_rank == src for t in plan.local):
        raise ValueError(f"post_sends: process {process} must play a source rank and no "
                         f"target rank (source {src}, target {dst}); use execute()")
    ops = [("send", _piece(shards, plan.source, t).contiguous(), pmap.target[t.dst_rank])
           for bucket in plan.buckets for t in bucket.transfers if t.src_rank == src]
    return _start(ops, group)


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether torch.distributed knows `group` (the default group or one from new_group)."""
    try:
        dist.get_process_group_ranks(group)
    except KeyError:
        return False
    return True


def naive_allgather(source: ModelLayout, target: ModelLayout, process: int,
                    shards: Mapping[str, torch.Tensor], pmap: ProcessMap,
                    group: dist.ProcessGroup | None = None,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The baseline: all-gather every full tensor on every process, then slice the target
    region. Assumes the source layout is FSDP (dim-0 shards in rank order)."""
    src, dst = pmap.roles_of(process)
    world = pmap.world_size
    out: dict[str, torch.Tensor] = {}
    for name, layout in source.params:
        rows = -(-layout.shape[0] // source.world_size) if layout.shape else 1
        padded = torch.zeros((rows, *layout.shape[1:]), dtype=_dtype(layout.dtype), device=device)
        if src is not None and layout.regions[src] is not None:
            mine = shards[name]
            padded[:len(mine)].copy_(mine)
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
        parts = [gathered[pmap.source[s]][:_rows(layout.regions[s])]
                 for s in range(source.world_size)]
        full = torch.cat(parts)
        region = target[name].regions[dst] if dst is not None else None
        if region is not None:
            out[name] = full[region.to_slices()].clone()
    return out


def layout_checksums(layout: ModelLayout, rank: int | None,
                     tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Partial fingerprints of rank `rank`'s tensors under `layout`, counting each element
    once across ranks (a region another, lower rank also holds is skipped), so that adding
    every rank's partials (`fingerprint.combine`) gives the whole tensors' checksums.

    A replica held by a higher rank is not covered by these whole-tensor sums (a stale copy of
    a replicated norm on TP rank 1 would pass): use `slice_checksums` against
    `expected_slice_checksums` to check every target rank's own slice, replicas included."""
    out: dict[str, int] = {}
    for name, p, region in _held(layout, rank):
        if p.allow_overlap and any(r is not None and r.intersect(region) is not None
                                   for r in p.regions[:rank]):
            continue  # replicated: the lowest holder speaks for it
        out[name] = region_checksum(tensors[name], p.shape, region.bounds)
    return out


def slice_checksums(target: ModelLayout, rank: int | None,
                    tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Checksum of each slice target rank `rank` holds, keyed ``"name@t<rank>"``: one entry
    per (parameter, target rank), so a stale replica is caught and located."""
    return {f"{name}@t{rank}": region_checksum(tensors[name], p.shape, region.bounds)
            for name, p, region in _held(target, rank)}


def expected_slice_checksums(source: ModelLayout, target: ModelLayout, rank: int | None,
                             shards: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """What source rank `rank` contributes to every target slice's checksum: the checksum of
    (its shard, minus what lower source ranks also hold) within each target region. Adding
    every source rank's dict (`fingerprint.combine`) gives `slice_checksums` of a correct
    sync, computed without gathering anything."""
    out: dict[str, int] = {}
    for name, p, held in _held(source, rank):
        pieces = [held]
        for lower in p.regions[:rank] if p.allow_overlap else ():
            if lower is not None:  # elements a lower rank also holds are counted there
                pieces = [box for piece in pieces for box in piece.subtract(lower)]
        for t, region in enumerate(target[name].regions):
            for piece in pieces:
                part = None if region is None else piece.intersect(region)
                if part is not None and not part.is_empty:
                    key = f"{name}@t{t}"
                    value = region_checksum(shards[name][part.relative_to(held).to_slices()],
                                            p.shape, part.bounds)
                    out[key] = (out.get(key, 0) + value) % (1 << 64)
    return out


def _held(layout: ModelLayout, rank: int | None) -> Iterator[tuple[str, ParamLayout, Region]]:
    """(name, parameter layout, region) for each parameter rank `rank` holds a region of;
    nothing for a process that is not a rank of `layout` (rank None)."""
    if rank is None:
        return
    for name, p in layout.params:
        if p.regions[rank] is not None:
            yield name, p, p.regions[rank]


def _allocate(layout: ModelLayout, rank: int | None,
              device: torch.device | str) -> dict[str, torch.Tensor]:
    if rank is None:
        return {}
    return {name: torch.empty(p.regions[rank].shape, dtype=_dtype(p.dtype), device=device)
            for name, p in layout.params if p.regions[rank] is not None}


def _piece(shards: Mapping[str, torch.Tensor], source: ModelLayout, t) -> torch.Tensor:  # noqa: ANN001
    held = source[t.param].regions[t.src_rank]
    return shards[t.param][t.region.relative_to(held).to_slices()]


def _slot(out: dict[str, torch.Tensor], target: ModelLayout, t) -> torch.Tensor:  # noqa: ANN001
    held = target[t.param].regions[t.dst_rank]
    return out[t.param][t.region.relative_to(held).to_slices()]


def _rows(region: Region | None) -> int:
    return 0 if region is None else region.shape[0]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
