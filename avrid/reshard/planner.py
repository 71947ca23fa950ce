"""Chapter 4 — the transfer planner: who sends which region of which parameter to whom.

`plan_transfer(source, target, same_process=..., bucket_bytes=...)` reads two `ModelLayout`s
(e.g. the trainer's FSDP shards and the rollout engine's tensor-parallel shards) and returns a
frozen `TransferPlan`. Source ranks 0..S-1 and target ranks 0..T-1 are separate roles;
`same_process` says which target rank shares a process with which source rank (colocated, the
hybrid engine: ``{0: 0, 1: 1}``; disaggregated: empty). For every parameter and target rank:

1. what the target needs and its own process already holds is a local copy, not a transfer;
2. the rest (a box minus a box: up to 2 * ndim boxes) is cut into pieces, each sent once by
   one source rank that holds it — among several holders (replication) the one that has sent
   the fewest bytes so far, then the lowest rank, so the same input always gives the same plan;
3. transfers are packed in order (parameter, target rank, source rank) into buckets of at most
   `bucket_bytes`; a transfer larger than a bucket is cut along its first dim with extent > 1.

No element reaches a target twice, so the bytes moved equal the lower bound — the elements each
target needs and does not hold, summed — and the plan checks that it does. Every bad input
fails here, by name, before a byte moves. Pure: it does not execute the plan or touch tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral

from avrid.reshard.layout import ModelLayout, ParamLayout, Region


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One box of one parameter, from a source rank to a target rank (global coordinates).

    The sender slices ``shard[region.relative_to(source_region).to_slices()]``; the receiver
    writes at ``region.relative_to(target_region)``.
    """

    param: str
    src_rank: int
    dst_rank: int
    region: Region
    nbytes: int

    def __str__(self) -> str:
        return f"{self.param}{self.region} s{self.src_rank}->t{self.dst_rank} {self.nbytes} B"


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    """Transfers sent together; `nbytes` (their sum) is at most the plan's `bucket_bytes`."""

    index: int
    transfers: tuple[Transfer, ...]
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferPlan:
    """The frozen result of `plan_transfer`: buckets of transfers, local copies, and totals.

    Example:
        >>> from avrid.reshard.layout import ModelLayout
        >>> from avrid.reshard.tp_layout import decoder_tp_layout
        >>> shapes = {"model.layers.0.mlp.up_proj.weight": ((8, 4), "float32")}
        >>> plan = plan_transfer(ModelLayout.fsdp(shapes, 2), decoder_tp_layout(shapes, 2),
        ...                      same_process={0: 0, 1: 1}, bucket_bytes=1024)
        >>> plan.bytes_moved, plan.lower_bound, plan.bytes_local  # colocated: all local
        (0, 0, 128)
        >>> plan = plan_transfer(ModelLayout.fsdp(shapes, 2), decoder_tp_layout(shapes, 2),
        ...                      bucket_bytes=64)
        >>> plan.bytes_moved, len(plan.buckets), [str(t) for t in plan.transfers][:1]
        (128, 2, ['model.layers.0.mlp.up_proj.weight[0:4, 0:4] s0->t0 64 B'])
    """

    source: ModelLayout
    target: ModelLayout
    same_process: tuple[tuple[int, int], ...]
    """(target rank, source rank) pairs that share a process, sorted by target rank."""
    bucket_bytes: int
    buckets: tuple[Bucket, ...]
    local: tuple[Transfer, ...]
    """Copies inside one process (src_rank is the target's own source rank): no network."""
    lower_bound: int
    """Sum over parameters and target ranks of (needed - held locally) elements x itemsize."""

    def __post_init__(self) -> None:
        for b in self.buckets:
            if b.nbytes != sum(t.nbytes for t in b.transfers) or b.nbytes > self.bucket_bytes:
                raise ValueError(f"bucket {b.index} holds {b.nbytes} bytes; it must equal its "
                                 f"transfers' sum and be <= bucket_bytes={self.bucket_bytes}")

    @property
    def source_world(self) -> int:
        """S, the number of source ranks."""
        return self.source.world_size

    @property
    def target_world(self) -> int:
        """T, the number of target ranks."""
        return self.target.world_size

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every transfer, bucket after bucket."""
        return tuple(t for b in self.buckets for t in b.transfers)

    @property
    def bytes_moved(self) -> int:
        """Bytes sent between processes (equals `lower_bound` by construction)."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def bytes_local(self) -> int:
        """Bytes copied inside a process because the target's own source rank holds them."""
        return sum(t.nbytes for t in self.local)

    @property
    def bytes_naive(self) -> int:
        """What the naive path sends: every target rank holding any part of a parameter
        receives the full tensor (an all-gather, then slice), as verl's old sync did."""
        return sum(p.nbytes * sum(r is not None for r in p.regions)
                   for _, p in self.target.params)

    def bytes_between(self, src_rank: int, dst_rank: int) -> int:
        """Bytes source rank `src_rank` sends to target rank `dst_rank`."""
        return sum(t.nbytes for t in self.transfers
                   if t.src_rank == src_rank and t.dst_rank == dst_rank)

    def bytes_to(self, dst_rank: int) -> int:
        """Bytes target rank `dst_rank` receives from other processes."""
        return sum(t.nbytes for t in self.transfers if t.dst_rank == dst_rank)

    def describe(self, max_rows: int = 12) -> str:
        """Totals, a source x target byte matrix and the first `max_rows` transfers."""
        pairs = ", ".join(f"t{t}=s{s}" for t, s in self.same_process) or "none"
        ts = self.transfers
        naive = self.bytes_naive
        lines = [
            f"transfer plan: {self.source_world} source ranks -> {self.target_world} target "
            f"ranks, same process: {pairs}",
            f"  moved        {self.bytes_moved} bytes ({_mib(self.bytes_moved)})",
            f"  lower bound  {self.lower_bound} bytes ({_mib(self.lower_bound)})",
            f"  local copies {self.bytes_local} bytes ({_mib(self.bytes_local)})",
            f"  naive        {naive} bytes ({_mib(naive)}): every target rank gets full tensors",
            f"  {len(ts)} transfers in {len(self.buckets)} buckets of <= {self.bucket_bytes} "
            f"bytes",
            "bytes sent (source rank down, target rank across):",
            "      " + "".join(f"{'t' + str(t):>14}" for t in range(self.target_world))]
        by_pair: dict[tuple[int, int], int] = {}
        for t in ts:
            by_pair[t.src_rank, t.dst_rank] = by_pair.get((t.src_rank, t.dst_rank), 0) + t.nbytes
        for s in range(self.source_world):
            lines.append(f"{'s' + str(s):>6}" + "".join(
                f"{by_pair.get((s, t), 0):>14}" for t in range(self.target_world)))
        lines.append(f"{'bucket':>6} {'src':>4} {'dst':>4} {'bytes':>12}  param region")
        rows = [(b.index, tr) for b in self.buckets for tr in b.transfers]
        for index, tr in rows[:max_rows]:
            lines.append(f"{index:>6} {tr.src_rank:>4} {tr.dst_rank:>4} {tr.nbytes:>12}  "
                         f"{tr.param}{tr.region}")
        if len(rows) > max_rows:
            lines.append(f"  ... {len(rows) - max_rows} more transfers")
        return "\n".join(lines)


def plan_transfer(source: ModelLayout, target: ModelLayout, *,
                  same_process: Mapping[int, int] | None = None,
                  bucket_bytes: int) -> TransferPlan:
    """Plan the minimum-bytes move from `source` to `target`; see the module docstring.

    Raises:
        ValueError: parameter names differ (both lists named), a parameter's shape or dtype
            differs (both values named), `same_process` names a rank outside either world or
            one source rank twice, or `bucket_bytes` is below one element of some parameter.
            (Layouts that do not cover a parameter already failed when they were made.)
    """
    pairs = _check(source, target, same_process or {}, bucket_bytes)
    local_of = dict(pairs)
    src = dict(source.params)
    load = [0] * source.world_size  # bytes each source rank sends, to spread replicated load
    moves: list[Transfer] = []
    local: list[Transfer] = []
    lower = 0
    for name, dst_layout in target.params:
        src_layout = src[name]
        size = src_layout.itemsize
        for t, need in enumerate(dst_layout.regions):
            if need is None:
                continue
            todo = [need]
            here = local_of.get(t)
            held = src_layout.regions[here] if here is not None else None
            common = need.intersect(held) if held is not None else None
            if common is not None:
                local.append(Transfer(param=name, src_rank=here, dst_rank=t, region=common,
                                      nbytes=common.numel * size))
                todo = list(need.subtract(common))
            lower += (need.numel - (common.numel if common is not None else 0)) * size
            pieces = _assign(name, t, todo, src_layout, load)
            moves.extend(sorted(pieces, key=lambda x: (x.src_rank, x.region.bounds)))
    plan = TransferPlan(source=source, target=target, same_process=pairs,
                        bucket_bytes=bucket_bytes, buckets=_bucket(moves, src, bucket_bytes),
                        local=tuple(local), lower_bound=lower)
    if plan.bytes_moved != lower:  # an invariant of the algorithm, checked on every plan
        raise AssertionError(f"planner bug: moves {plan.bytes_moved} bytes, bound {lower}")
    return plan


def _assign(name: str, t: int, todo: list[Region], layout: ParamLayout,
            load: list[int]) -> list[Transfer]:
    """Cover the boxes in `todo` exactly once with pieces of source regions."""
    out = []
    size = layout.itemsize
    while todo:
        box = todo.pop()
        best: tuple[int, Region] | None = None
        for s, held in enumerate(layout.regions):
            if held is not None and (piece := box.intersect(held)) is not None and (
                    best is None or load[s] < load[best[0]]):
                best = (s, piece)
        if best is None:  # unreachable for layouts that passed check_covers
            raise AssertionError(f"planner bug: no source rank holds {name}{box}")
        s, piece = best
        load[s] += piece.numel * size
        out.append(Transfer(param=name, src_rank=s, dst_rank=t, region=piece,
                            nbytes=piece.numel * size))
        # What this holder lacks goes back on the list for another holder; since the piece
        # is cut out of the box, no element is sent twice even when holders overlap.
        todo.extend(box.subtract(piece))
    return out


def _bucket(moves: list[Transfer], src: dict[str, ParamLayout],
            limit: int) -> tuple[Bucket, ...]:
    """Greedy packing in order; a transfer over `limit` is cut into pieces that fit."""
    buckets: list[Bucket] = []
    current: list[Transfer] = []
    used = 0
    for move in moves:
        size = src[move.param].itemsize
        pieces = [move] if move.nbytes <= limit else [
            Transfer(param=move.param, src_rank=move.src_rank, dst_rank=move.dst_rank,
                     region=r, nbytes=r.numel * size) for r in _cut(move.region, size, limit)]
        for piece in pieces:
            if current and used + piece.nbytes > limit:
                buckets.append(Bucket(index=len(buckets), transfers=tuple(current), nbytes=used))
                current, used = [], 0
            current.append(piece)
            used += piece.nbytes
    if current:
        buckets.append(Bucket(index=len(buckets), transfers=tuple(current), nbytes=used))
    return tuple(buckets)


def _cut(region: Region, size: int, limit: int, start: int = 0) -> list[Region]:
    """Cut `region` into boxes of at most `limit` bytes along its first dim (from `start`)
    with extent > 1: as many whole slabs per box as fit; a single slab over the limit is cut
    again along the next dim. Needs limit >= size (checked up front)."""
    dims = [d for d in range(start, region.ndim) if region.shape[d] > 1]
    if not dims or region.numel * size <= limit:
        return [region]
    d = dims[0]
    lo, hi = region.bounds[d]
    slab = region.numel // (hi - lo) * size
    step = max(1, limit // slab)
    out = []
    for a in range(lo, hi, step):
        box = Region(bounds=(*region.bounds[:d], (a, min(a + step, hi)),
                             *region.bounds[d + 1:]))
        out.extend(_cut(box, size, limit, d + 1) if slab > limit else [box])
    return out


def _check(source: ModelLayout, target: ModelLayout, same_process: Mapping[int, int],
           bucket_bytes: int) -> tuple[tuple[int, int], ...]:
    """Every bad input, by name, before planning; returns the sorted same-process pairs."""
    if set(source.names) != set(target.names):
        only_s = [n for n in source.names if n not in set(target.names)]
        only_t = [n for n in target.names if n not in set(source.names)]
        raise ValueError(f"source and target layouts must have the same parameters; only in "
                         f"source: {only_s}, only in target: {only_t}")
    src = dict(source.params)
    for name, t in target.params:
        s = src[name]
        if s.shape != t.shape or s.dtype != t.dtype:
            what = "shape" if s.shape != t.shape else "dtype"
            raise ValueError(f"parameter {name!r}: source {what} {getattr(s, what)} but target "
                             f"{what} {getattr(t, what)}; resharding does not reshape or cast")
    if not isinstance(bucket_bytes, Integral) or isinstance(bucket_bytes, bool):
        raise ValueError(f"bucket_bytes must be an integer, got {bucket_bytes!r}")
    for name, t in target.params:
        if bucket_bytes < t.itemsize:
            raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than one element of "
                             f"{name!r} ({t.dtype}, {t.itemsize} bytes)")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    seen: dict[int, int] = {}
    for t, s in sorted(same_process.items()):
        if not 0 <= t < target.world_size or not 0 <= s < source.world_size:
            raise ValueError(f"same_process maps target rank {t} to source rank {s}; allowed: "
                             f"target 0..{target.world_size - 1}, source "
                             f"0..{source.world_size - 1}")
        if s in seen:
            raise ValueError(f"same_process puts target ranks {seen[s]} and {t} in the process "
                             f"of source rank {s}; a process holds one rank of each role")
        seen[s] = t
    return tuple(sorted(same_process.items()))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
