"""Chapter 5 — the memory a trained role's GPU holds while it is being built (`setup`).

`TrainedWorker.setup` builds the model, lets `_before_shard` make the reference and the
rollout engine, then shards the model with FSDP2. What the GPU holds at its peak depends on
the path it takes (`roles/trained.py`, `roles/meta_init.py`):

    whole      the fp32 model is moved to the device whole, the engine is built beside it
               (vLLM takes its share of the GPU then), and FSDP2 shards it in place: the whole
               fp32 model, plus the shard being cut of one unit, plus the engine
    meta       a sharded role starting from a checkpoint (dp > 1 on Ray, no offload): a meta
               skeleton is sharded, then filled from rank 0's copy one tensor at a time: this
               rank's fp32 shards plus one broadcast tensor
    offload    `memory.cpu_offload`: the model stays on the CPU and `fully_shard` moves one
               unit (a decoder layer, or the root: embedding, head) to the device, cuts its
               shard and puts the shard in host memory: one unit whole plus its shard

`setup_parts` returns those bytes by component, for `memory_estimate.estimate`'s "setup"
phase. AdamW's state does not exist yet (it is made at the first step).

Not here: the phases of a step (`memory_estimate.py`), the sizes of the model (`memory_shapes`).
"""

from __future__ import annotations

import math

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.memory_shapes import ModelShape


def setup_path(config: PPOConfig, *, dp: int, from_checkpoint: bool) -> str:
    """Which of the three paths above a role of `dp` ranks takes ("whole", "meta" or
    "offload"), as `meta_init.applies` decides it without a process group: meta init needs a
    checkpoint, more than one rank, a process per rank (the Ray backend) and no offload.
    (A run resuming from whole weights, an older checkpoint, takes the whole path even so.)"""
    if config.memory.cpu_offload:
        return "offload"
    if from_checkpoint and dp > 1 and config.placement.backend == "ray":
        return "meta"
    return "whole"


def setup_params(shape: ModelShape, params: int, *, dp: int, path: str, sharded: bool) -> int:
    """Peak bytes of a trained model's fp32 parameters on its GPU while `setup` builds and
    shards it: `params` is what it holds (its adapters included), `sharded` whether FSDP2
    wraps it at all (`fsdp.shard_model`)."""
    unit = max(shape.layer_params, shape.root_params)  # the largest FSDP unit
    if path == "offload":  # one unit on the device at a time, whole, beside its shard
        return 4 * (unit + math.ceil(unit / dp))
    if path == "meta":  # this rank's shards, plus the one tensor being broadcast
        return 4 * (math.ceil(params / dp) + max(shape.embedding_params,
                                                 shape.hidden * shape.intermediate))
    # The whole fp32 model on the device; each unit's shard is cut beside it.
    return 4 * (params + (math.ceil(unit / dp) if sharded else 0))


def setup_parts(config: PPOConfig, policy: ModelShape, *, params: int, dp: int,
                sharded: bool, cd: int, reference: bool, engine: int) -> dict[str, int]:
    """The policy's GPU while its rank builds the actor: the actor's fp32 parameters
    (`setup_params`), the reference (kept in `cd` bytes, 1/dp of it when sharded; its own
    units pass through the device before the actor's with offload, the shards then live in
    host memory) and the rollout engine `_before_shard` made (`engine` bytes: vLLM's share,
    or the torch engine's weights; 0 where the rollout pool generates)."""
    path = setup_path(config, dp=dp, from_checkpoint=config.model.path is not None)
    ref = 0
    if reference and path != "offload":
        ref = cd * (math.ceil(policy.params / dp) if sharded else policy.params)
    return {"params": setup_params(policy, params, dp=dp, path=path, sharded=sharded),
            "ref": ref, "engine": engine}
