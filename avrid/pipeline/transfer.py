"""Chapter 6 — the trainer's weights into a rollout pool of its own: one group, broadcasts.

In the hybrid engine (chapter 5) each policy rank fills its own engine; here the engines live
in other processes — other bundles, other GPUs — so the weights must cross between two pools:

    from   the actor's FSDP2 shards over T trainer ranks (cast to the engine's dtype first,
           as in chapter 5: half the bytes in bf16)
    to     R rollout ranks, each holding every tensor whole

What each engine must receive is chapter 4's plan across the two pools (`push_plan`:
`plan_transfer(..., same_process={})`, made once on the driver from the shapes): the whole
model, R x (model bytes) in all, which is also the lower bound. The metrics report it
(`sync/bytes_per_rank`), and every rollout rank does receive exactly that.

How the bytes travel is NOT the plan's per-pair transfers (on NCCL a send between each
trainer and rollout rank would build a 2-rank communicator per pair, T x R of them, lazily,
inside the first push). It is vLLM's and verl's pattern, bucket by bucket:

    gather     every trainer rank all-gathers each whole tensor over its FSDP group, as a
               forward does (`LearnerWorker.push_weights`: a collective the trainer already
               runs, on its own communicator, while the rollout ranks are not involved)
    broadcast  trainer rank 0 packs the bucket's pieces into one flat buffer and broadcasts
               it in the push group, trainer rank 0 + the R rollout ranks (`PushGroup`: one
               communicator, built once at join time), one broadcast per bucket

Why not every trainer rank broadcasting its own shard in a group of all T + R ranks? A
broadcast reaches every member: each trainer rank would also receive the others' shards
(T - 1 extra copies of the model on the trainer's links and in its memory). Why not p2p?
See above. With trainer rank 0 alone in the push group, the FSDP collectives and the push
share no member but rank 0 and wait on nothing of each other, so no ordering between two
communicators can deadlock.

The buckets (`push_buckets`) cut the model, taken as one flat run of elements in parameter
order, into pieces of at most `plan.bucket_bytes` (a tensor larger than that spans several
buckets; a bucket may hold many small tensors): a bucket is one flat buffer, so one
broadcast, however many tensors it holds.

Nobody waits for anybody more than memory requires. Trainer rank 0 keeps at most
`POSTED_BUCKETS` broadcasts posted and unfinished: before packing the next bucket it waits
(`PushGroup.wait`, against the push's deadline) for the oldest, then returns to training
with the last few still in flight, and checks those at its next push (or at close). A
rollout rank receives bucket after bucket, each awaited against the same deadline, and
streams them into its engine as they come (`received_tensors`: each tensor as soon as its
last piece arrived, one load per push, `WeightSink.load_stream`), never a whole copy.

Memory, at 7B in bf16 (14.2 GiB of weights): trainer rank 0 holds `POSTED_BUCKETS` buckets
(128 MiB), not the model; every trainer rank one gathered tensor at a time; a rollout rank,
beside its engine, the bucket being received and the tensors not yet loaded: a bucket or two,
more only where a single tensor is larger (it must arrive whole: an embedding, 1 GiB at 7B).
The check is the driver's: the trainer ranks' partial fingerprints of their own cast shards,
added up, must equal each rollout engine's whole-tensor fingerprints, so the gather, the
buckets, the broadcast and the load are all checked end to end.

Not here: when to push (the driver: never while a generation is in flight), and loading into
an engine (the engine's `sink`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from avrid.pipeline.push_group import PushGroup
from avrid.reshard import ModelLayout, ParamLayout, TransferPlan, plan_transfer

BUCKET_BYTES = 64 << 20
"""Size bound of one push bucket (as chapter 5's `weight_sync.BUCKET_BYTES`); read when the
driver makes the plan, which carries it to every worker."""

POSTED_BUCKETS = 2
"""The most broadcasts trainer rank 0 keeps posted and unfinished (with their buffers): one
on the wire while the next is packed. What rank 0 holds for a push is this many buckets."""

Shapes = dict[str, tuple[tuple[int, ...], str]]
"""Parameter name -> (whole shape, dtype name), in the actor's parameter order."""


def push_plan(shapes: Shapes, *, trainers: int, rollouts: int, engine_dtype: str) -> TransferPlan:
    """What `trainers` FSDP2 ranks must get to `rollouts` whole-model engines: chapter 4's
    plan (the bytes each engine receives, and the lower bound); its `bucket_bytes` is
    `BUCKET_BYTES`, which `push_buckets` cuts the broadcasts by.

    Example::

        >>> plan = push_plan({"w": ((4, 2), "float32")}, trainers=2, rollouts=3,
        ...                  engine_dtype="bfloat16")
        >>> plan.bytes_moved == plan.lower_bound == 3 * 4 * 2 * 2   # R x model bytes (bf16)
        True
    """
    dtype = getattr(torch, engine_dtype)
    cast = {name: (shape, dtype) for name, (shape, _) in shapes.items()}
    source = ModelLayout.fsdp(cast, trainers)
    target = ModelLayout(world_size=rollouts, params=tuple(
        (name, ParamLayout.replicated(shape, d, rollouts)) for name, (shape, d) in cast.items()))
    return plan_transfer(source, target, same_process={}, bucket_bytes=BUCKET_BYTES)


def engine_layout(plan: TransferPlan) -> ModelLayout:
    """What one rollout engine holds: every tensor whole (a one-rank layout), the layout its
    fingerprints are taken under."""
    return ModelLayout(world_size=1, params=tuple(
        (name, ParamLayout.replicated(p.shape, p.dtype, 1)) for name, p in plan.target.params))


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [start, stop) of tensor `name` (flattened), at `offset` in its bucket."""

    name: str
    start: int
    stop: int
    offset: int


@dataclass(frozen=True, slots=True)
class PushBucket:
    """One broadcast: a flat buffer of `numel` elements of `dtype`, made of `pieces`."""

    index: int
    numel: int
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def push_buckets(target: ModelLayout, bucket_bytes: int) -> tuple[PushBucket, ...]:
    """The model (`target`'s tensors, in order: `plan.target`, all in the engine's dtype) cut
    into flat buckets of at most `bucket_bytes` (`plan.bucket_bytes`). Pure: every member of
    the push group computes the same buckets from the same plan.

    Example (6 + 4 elements of 4 bytes, in buckets of 16 bytes)::

        >>> plan = push_plan({"a": ((2, 3), "float32"), "b": ((4,), "float32")},
        ...                  trainers=1, rollouts=1, engine_dtype="float32")
        >>> [[(p.name, p.start, p.stop) for p in b.pieces] for b in push_buckets(plan.target, 16)]
        [[('a', 0, 4)], [('a', 4, 6), ('b', 0, 2)], [('b', 2, 4)]]
    """
    dtypes = {p.dtype for _, p in target.params}
    if len(dtypes) > 1:
        raise ValueError(f"a push bucket is one flat buffer of one dtype; the tensors hold "
                         f"{sorted(dtypes)}: cast them to the engine's dtype (push_plan does)")
    dtype = getattr(torch, dtypes.pop()) if dtypes else torch.float32
    per_bucket = max(1, bucket_bytes // dtype.itemsize)  # elements in a full bucket
    buckets: list[PushBucket] = []
    pieces: list[Piece] = []
    filled = 0
    for name, p in target.params:
        numel, start = math.prod(p.shape), 0
        while start < numel:
            take = min(numel - start, per_bucket - filled)
            pieces.append(Piece(name, start, start + take, filled))
            start, filled = start + take, filled + take
            if filled == per_bucket:
                buckets.append(PushBucket(len(buckets), filled, dtype, tuple(pieces)))
                pieces, filled = [], 0
    if pieces:
        buckets.append(PushBucket(len(buckets), filled, dtype, tuple(pieces)))
    return tuple(buckets)


def post_buckets(buckets: tuple[PushBucket, ...], whole: Callable[[str], torch.Tensor],
                 group: PushGroup | None, device: str, *, deadline: float,
                 who: str) -> tuple[list[tuple[dist.Work, torch.Tensor]], Exception | None]:
    """Trainer side, every trainer rank at once. `whole(name)` gives tensor `name` whole, in
    the engine's dtype (on FSDP2 an all-gather: every trainer rank must ask for the same
    tensors in the same order, which walking the same buckets guarantees). The rank that is
    in the push group (`group`: trainer rank 0; None elsewhere) packs each bucket and posts
    its broadcast, with at most `POSTED_BUCKETS` unfinished at once: before packing another
    it waits for the oldest (against `deadline`, a `time.monotonic()` value; `who` names this
    rank in a `PushTimeout`).

    Returns the last posted (work, buffer) pairs, unfinished (keep each buffer alive until its
    work has finished: each is a view of one of the `POSTED_BUCKETS` buffers it packs into),
    and the error of a broadcast that failed or timed out (a receiver died or stopped; None
    if none did). After such an error rank 0 posts nothing more but still gathers to the
    end: the other trainer ranks are in the same all-gathers and must not be left waiting in
    them, and the caller raises the error later, once the driver has heard from the
    receivers, where the cause is."""
    posted: deque[tuple[dist.Work, torch.Tensor]] = deque()
    failed: Exception | None = None
    name, flat_whole = None, None
    # The buffers, POSTED_BUCKETS of them, reused in turn: the i-th bucket is packed into
    # buffer i % POSTED_BUCKETS once the last one in it (i - POSTED_BUCKETS) has finished.
    # Not one fresh buffer per bucket, freed when its broadcast is done: the backend drops
    # its own reference to a finished operation's tensors when its thread gets to it (gloo's
    # worker, NCCL's watchdog), after `wait` has returned, so "freed" would come some time
    # later and rank 0 would hold a third bucket, or more, in the meantime.
    ring: list[torch.Tensor] = []
    ring_bytes = max((b.nbytes for b in buckets), default=0)
    for i, bucket in enumerate(buckets):
        if group is not None and len(posted) == POSTED_BUCKETS:
            oldest = [posted.popleft()[0]]
            try:
                group.wait(oldest, deadline=deadline,
                           what=f"{who}: bucket {bucket.index + 1 - POSTED_BUCKETS} of "
                                f"{len(buckets)} of a weight push")
            except Exception as exc:  # PushTimeout, or the broadcast's own error
                failed, group = exc, None
                posted.clear()
        flat = None
        if group is not None:
            if len(ring) < POSTED_BUCKETS:  # bytes, so that any bucket's dtype fits
                ring.append(torch.empty(ring_bytes, dtype=torch.uint8, device=device))
            flat = ring[i % POSTED_BUCKETS][:bucket.nbytes].view(bucket.dtype)
        for piece in bucket.pieces:
            if piece.name != name:  # one gathered tensor at a time (it may span buckets)
                name, flat_whole = piece.name, whole(piece.name).reshape(-1)
            if flat is not None:
                flat[piece.offset:piece.offset + piece.stop - piece.start].copy_(
                    flat_whole[piece.start:piece.stop])
        if flat is not None:
            posted.append((group.broadcast(flat, root=0), flat))
    return list(posted), failed


def receive_bucket(bucket: PushBucket, group: PushGroup, *, deadline: float, who: str,
                   of: int) -> torch.Tensor:
    """Rollout side: take part in bucket `bucket`'s broadcast, wait for it against `deadline`
    (`PushGroup.wait`) and return its flat buffer."""
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=group.device)
    group.wait([group.broadcast(flat, root=0)], deadline=deadline,
               what=f"{who}: receiving bucket {bucket.index + 1} of {of} of a weight push")
    return flat


def received_tensors(plan: TransferPlan, buckets: tuple[PushBucket, ...],
                     receive: Callable[[PushBucket], torch.Tensor],
                     device: str) -> Iterator[dict[str, torch.Tensor]]:
    """Rollout side: the push's whole tensors, bucket by bucket, as they complete.
    `receive(bucket)` gives a bucket's flat buffer (`receive_bucket`); each dict yielded holds
    the tensors whose last piece was in that bucket, and the next bucket is received only
    when the next dict is asked for (a `WeightSink.load_stream` loads each before it asks).

    A tensor wholly inside one bucket is a view of its buffer (no copy); one that spans
    buckets is assembled in a tensor of its own (at most one at a time: the pieces come in
    order). So what is alive is the buffers of the tensors not yet loaded plus the tensor
    being assembled, never the whole model.

    Example (one process plays the broadcast: each bucket's buffer is given)::

        >>> plan = push_plan({"a": ((2, 3), "float32"), "b": ((4,), "float32")},
        ...                  trainers=1, rollouts=1, engine_dtype="float32")
        >>> buckets = push_buckets(plan.target, 16)
        >>> flats = iter([torch.arange(4.0), torch.arange(4.0, 8.0), torch.arange(8.0, 10.0)])
        >>> for got in received_tensors(plan, buckets, lambda b: next(flats), "cpu"):
        ...     print({n: t.tolist() for n, t in got.items()})
        {}
        {'a': [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]}
        {'b': [6.0, 7.0, 8.0, 9.0]}
    """
    shapes = {name: p.shape for name, p in plan.target.params}
    assembling: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        done = _unpack(bucket, receive(bucket), shapes, assembling, device)
        yield done
        del done  # loaded by now: the next bucket arrives without it
    # Empty tensors have no piece in any bucket: they are still loaded, as they are.
    empty = {name: torch.empty(p.shape, dtype=getattr(torch, p.dtype), device=device)
             for name, p in plan.target.params if math.prod(p.shape) == 0}
    if empty:
        yield empty


def _unpack(bucket: PushBucket, flat: torch.Tensor, shapes: dict[str, tuple[int, ...]],
            assembling: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The tensors whose last piece is in `bucket` (received into `flat`): views of `flat`
    where a tensor lies wholly inside it, else completed from `assembling` (the tensors
    spanning buckets, begun in an earlier one: this adds and removes them)."""
    done: dict[str, torch.Tensor] = {}
    for piece in bucket.pieces:
        shape = shapes[piece.name]
        part = flat[piece.offset:piece.offset + piece.stop - piece.start]
        numel = math.prod(shape)
        if piece.start == 0 and piece.stop == numel:  # all of it in this bucket
            done[piece.name] = part.view(shape)
            continue
        if piece.start == 0:
            assembling[piece.name] = torch.empty(shape, dtype=bucket.dtype, device=device)
        assembling[piece.name].view(-1)[piece.start:piece.stop].copy_(part)
        if piece.stop == numel:
            done[piece.name] = assembling.pop(piece.name)
    return done
