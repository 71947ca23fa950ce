"""Chapter 5 — meta-device init: a sharded role loads its checkpoint once, not once per GPU.

Without it every rank of a trained role loads the WHOLE fp32 model from `model.path` on the
CPU, moves it to its device and only then lets FSDP2 shard it in place: at 7B that is 28 GB on
every GPU before sharding, and 8 x 28 GB of host memory on an 8-GPU node. With it
(`applies`), a rank of a sharded role (dp > 1, each rank a process of its own: the Ray
backend) instead

1. builds the model's skeleton on the ``meta`` device from the checkpoint's config alone
   (`skeleton`: no memory, no weights read, no draw from the RNG);
2. lets FSDP2 shard the skeleton (`fsdp.shard_model`, as before), then `fill`s it:
   ``to_empty`` gives each rank storage for its own shards only, on its device; rank 0 alone
   has loaded the checkpoint the old way (the very model the old path built, on the CPU, at
   the same moment of `setup`), and ``set_model_state_dict(..., full_state_dict=True,
   broadcast_from_rank0=True)`` broadcasts it one tensor at a time, every rank keeping its
   shard of each.

Why rank 0 reads and broadcasts, rather than each rank reading its slices from the safetensors
(``safe_open(...).get_slice``): rank 0's model is built by the same transformers call as
before, so the weights are the old path's bit for bit by construction — the dtype conversion of
a bf16 checkpoint, a tied LM head stored once, a checkpoint split over several files, renamed
keys, and the critic's new value head all come from transformers itself, with nothing to
re-implement. (That head is drawn from the process's global RNG, not from `train.seed`, so it
depends on what the process drew before: rank 0 loads at the very point of `setup` where the
old path did, so it draws the same numbers; under FSDP2 rank 0's one-row head was the one
kept before too.) The cost is one full fp32 copy in rank 0's HOST memory while it loads (the old
path had one on every rank's host and on every GPU); every other rank holds its shards and one
broadcast tensor at a time.

Buffers are not in a state dict when they are non-persistent (the rotary embedding's
``inv_freq``): ``to_empty`` leaves them uninitialised, so `fill` copies rank 0's (computed by
transformers as before) and broadcasts them too.

Not here: the old path (`TrainedWorker.setup` keeps it for the tiny random models, one rank,
the in-process backend, and resuming from whole weights), resuming from shards (`fsdp.
load_shards`, after the fill), the rollout engine's weights (`policy.py`: the first weight sync
fills an engine built from the skeleton), the reference model.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed import ProcessGroup

from avrid.ppo.setup.config import PPOConfig

POLICY, CRITIC = "policy", "critic"
"""The two kinds of trained model a checkpoint can start: a causal LM, or the critic (the
same trunk with a new one-output value head)."""


def checkpoint_path(config: PPOConfig, kind: str) -> str | None:
    """The local checkpoint a `kind` model starts from, or None for the tiny random one:
    `model.path` for the policy, `model.critic_path` (else `model.path`) for the critic."""
    if kind == POLICY:
        return config.model.path
    if kind == CRITIC:
        return config.model.critic_path or config.model.path
    raise ValueError(f"model kind must be {POLICY!r} or {CRITIC!r}, got {kind!r}")


def applies(config: PPOConfig, kind: str | None, group: ProcessGroup | None, world_size: int,
            weights: object) -> bool:
    """Whether a rank builds its model on the meta device (`skeleton` + `fill`): it starts
    from a checkpoint, the role is sharded over a process group of more than one rank that
    is this process's default one (each rank its own process; `set_model_state_dict`
    broadcasts over the default group, which the in-process backend's threads do not share),
    and it is not resuming from whole weights (an older checkpoint: the old path loads them).
    FSDP2's CPU offload (`memory.cpu_offload`) keeps the old path too: its shards live in
    host memory, which this fill (storage on the run's device) does not arrange.
    """
    import torch.distributed as dist

    return (kind is not None and checkpoint_path(config, kind) is not None
            and group is not None and not config.memory.cpu_offload
            and world_size > 1 and not isinstance(weights, dict)
            and dist.is_initialized() and group is dist.group.WORLD)


def skeleton(config: PPOConfig, kind: str) -> torch.nn.Module:
    """The `kind` model of the run's checkpoint on the ``meta`` device: every parameter and
    buffer has its shape, dtype (fp32) and name, none has storage. Built from the config file
    only (`AutoConfig`), as `models.load_policy` / `models.load_critic` build theirs."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForTokenClassification,
    )

    from avrid.ppo.engines.models import ATTN_IMPLEMENTATION, ValueHead

    path = checkpoint_path(config, kind)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    if kind == CRITIC:
        hf_config.num_labels = 1
    cls = AutoModelForCausalLM if kind == POLICY else AutoModelForTokenClassification
    with torch.device("meta"):
        model = cls.from_config(hf_config, dtype=torch.float32,
                                attn_implementation=ATTN_IMPLEMENTATION)
        if kind == CRITIC:  # the loaded critic's head is a `ValueHead` (models.load_critic)
            old = model.score
            model.score = ValueHead(old.in_features, old.out_features,
                                    bias=old.bias is not None)
    return model.eval()


def fill(model: torch.nn.Module, full: torch.nn.Module | None, *, group: ProcessGroup,
         device: str) -> None:
    """Give the sharded skeleton `model` storage on `device` and the checkpoint's weights,
    all ranks at once: `full` is rank 0's whole fp32 model on the CPU (the one the old path
    built, loaded where the old path loaded it), None on the others; rank 0 broadcasts its
    state dict and its buffers, every rank keeps its shards of each."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    model.to_empty(device=device)
    state = full.state_dict() if full is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    del state
    # Every buffer, non-persistent ones (rotary inv_freq) included: to_empty left them
    # uninitialised and no state dict carries them. The same names and order on every rank.
    source = dict(full.named_buffers()) if full is not None else {}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if full is not None:
                buf.copy_(source[name])
            dist.broadcast(buf, group=group, group_src=0)


def engine_skeleton(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the (unsharded, meta) skeleton `model` for the torch rollout engine, as
    `generation.build_engine` makes its copy of a whole model: parameters in `dtype`, buffers
    as they are (`fsdp.cast_parameters`), the attention kernel models are built with (the
    engine decodes left-padded batches through a KV cache, not the trainer's packed rows).
    Still on meta: `materialize_engine` gives it storage once the actor's buffers are filled."""
    from avrid.ppo.engines.models import ATTN_IMPLEMENTATION
    from avrid.ppo.roles.fsdp import cast_parameters

    engine_model = cast_parameters(copy.deepcopy(model), dtype).eval()
    engine_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return engine_model


def materialize_engine(engine_model: torch.nn.Module, actor: torch.nn.Module,
                       device: str) -> None:
    """Storage on `device` for the engine's `engine_skeleton`, its buffers copied from the
    filled `actor`'s (the rotary `inv_freq`, fp32 in both) and its tied weights re-tied
    (``to_empty`` makes a new tensor per module). Its parameters stay uninitialised: the
    policy's first weight sync, fingerprint-checked, writes every one before any use."""
    engine_model.to_empty(device=device)
    engine_model.tie_weights()
    buffers = dict(actor.named_buffers())
    with torch.no_grad():
        for name, buf in engine_model.named_buffers():
            buf.copy_(buffers[name])
