"""Chapter 6 — the trainer's weights into a rollout pool of its own, over torch.distributed.

In the hybrid engine (chapter 5) each policy rank fills its own engine; here the engines live
in other processes — other bundles, other GPUs — so the weights must cross between two pools.
It is chapter 4's problem once more, with the two layouts in different processes:

    source   the actor's FSDP2 shards over the T trainer ranks (cast to the engine's dtype
             first, as in chapter 5: half the bytes on the wire in bf16)
    target   each of the R rollout ranks holds every tensor whole
    plan     `plan_transfer(source, target, same_process={})`: disaggregated, so every byte
             crosses a process boundary, and the bytes moved equal the lower bound,
             R x (model bytes); made ONCE, on the driver, from the shapes alone

The T + R processes meet in a process group of their own (`join_group`: trainer rank i is
process i, rollout rank j is process T + j, as chapter 4's `ProcessMap` numbers them), over
gloo on CPU and NCCL on GPU, built from a TCP store that trainer rank 0 hosts: the trainer
ranks already have their FSDP group, and a process has only one default group.

Every trainer rank calls `post_shards` and every rollout rank `receive_full` at the same
time. The trainer only posts its sends (`post_sends`) and goes back to training, so a push
costs the trainer a snapshot of its shard, not the time the rollout ranks take to receive
and load; the rollout ranks run `execute`, bucket by bucket. The check is the driver's: the
trainer ranks' partial fingerprints, added up, must equal each rollout engine's whole-tensor
fingerprints.

Not here: when to push (the driver decides: never while a generation is in flight), and
loading into an engine (`generation.engine_sink`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from avrid.reshard import (
    ModelLayout,
    ParamLayout,
    TransferPlan,
    execute,
    layout_checksums,
    plan_transfer,
    post_sends,
)

BUCKET_BYTES = 64 << 20
"""Size bound of one transfer bucket (as chapter 5's `weight_sync.BUCKET_BYTES`)."""

Shapes = dict[str, tuple[tuple[int, ...], str]]
"""Parameter name -> (whole shape, dtype name), in the actor's parameter order."""


def push_plan(shapes: Shapes, *, trainers: int, rollouts: int, engine_dtype: str) -> TransferPlan:
    """The transfer plan from `trainers` FSDP2 ranks to `rollouts` whole-model engines.

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


def join_group(address: str, port: int, *, rank: int, world_size: int, device: str,
               timeout_s: float) -> dist.ProcessGroup:
    """This process's member of the trainer + rollout group; every member calls it at once.
    Rank 0 (trainer rank 0) hosts the TCP store at `address:port`."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    if device == "cuda":  # NCCL between GPUs (not run on the CPU machines of this course)
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def post_shards(plan: TransferPlan, rank: int, shards: dict[str, torch.Tensor],
                group: dist.ProcessGroup) -> tuple[list[dist.Work], dict[str, int]]:
    """Trainer rank `rank`: post the sends of its shards (already in the engine's dtype, and
    a snapshot: the optimizer may step before gloo or NCCL has read them) and return at once,
    with the unfinished sends and the shards' partial fingerprints for the driver's check.
    The trainer goes on training while the rollout ranks receive; it waits for the sends
    before its next push."""
    works = post_sends(plan, rank, shards, group)
    return works, layout_checksums(plan.source, rank, shards)


def receive_full(plan: TransferPlan, rollout_rank: int, group: dist.ProcessGroup,
                 device: str) -> dict[str, torch.Tensor]:
    """Rollout rank `rollout_rank`: receive every tensor whole (process T + rollout_rank)."""
    return execute(plan, plan.source_world + rollout_rank, {}, group=group, device=device)
