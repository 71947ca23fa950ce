"""Chapter 5 — `TrainedWorker`: what every rank of an FSDP-trained role does the same way.

The actor (`PolicyWorker`) and the critic (`CriticWorker`) are trained alike. Each rank joins
the role's process group when it needs one, builds (or loads) its model — every rank the
same weights; a sharded role starting from a checkpoint builds a meta-device skeleton and
fills it after sharding from the one copy rank 0 loads, `meta_init.py` —, takes a
checkpoint's weights when resuming, shards the model with FSDP2 (`fsdp.py`), makes AdamW
over its shards, restores a checkpoint's optimizer state, and later hands its state to a
checkpoint (`state`) and leaves the group (`close`). That scaffolding is written once, here,
in `setup`; a subclass adds only what is its own:

- `_build_model`: the role's fp32 model as it is at step 0 (the tiny random one from the
  run's seed, or a local checkpoint);
- `_before_shard`: what it needs from the whole model before FSDP2 shards it in place (the
  policy copies it into its rollout engine); nothing by default;
- its data methods and its loss.

Parameters and AdamW state are always fp32; `model.dtype` is the compute dtype (bf16 through
FSDP2's mixed precision, which needs a process group even for one rank; see `fsdp.py`).
`memory.cpu_offload` keeps them in host memory (FSDP2's CPU offload, a group even for one
rank as well), and the model is sharded from the CPU: only one FSDP unit at a time is ever
on the GPU (`setup`; `setup/memory_setup.py` estimates each path's peak).

A checkpoint is written by the ranks themselves: `save_shards` has every rank write its own
shards of the model and of AdamW into the directory the driver names (`fsdp.py`), and
`setup` given that directory (a `str`) reads them back after sharding, so no rank ever holds
the whole model for it and the driver receives no tensor. `state` still gathers the whole
weights as two frozen messages, `ModelState` (one rank's) and `TrainerState` (the driver's,
`Trainer.state`): for tests and small models, and for a checkpoint written before sharding
(whole weights and per-rank optimizer states), which `setup` still restores.

Not here: the losses, the micro-batch loop (`forward.train_shard`), the weight sync, writing
and reading checkpoints (`checkpoint.py`), and anything the driver decides (when to update,
when to save).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any

import torch

from avrid.ppo.engines.models import trainer_attention
from avrid.ppo.roles import fsdp, meta_init
from avrid.ppo.setup.config import PPOConfig, TrainConfig
from avrid.results import ResultBuilder
from avrid.workers import Worker, WorkerIdentity


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelState:
    """One rank's share of a trained model's state."""

    weights: dict[str, torch.Tensor] | None
    """Every parameter whole, fp32, on the CPU (`fsdp.full_state_dict`) — on rank 0 only;
    None on the others, which take part in the gather but need not ship a second copy."""
    optimizer: dict[str, Any]
    """This rank's AdamW state, its tensors this rank's local shards
    (`fsdp.optimizer_state`; `fsdp.load_optimizer_state` puts it back)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerState:
    """Every trained model's state, per model name ("actor", and "critic" for PPO)."""

    weights: dict[str, dict[str, torch.Tensor]]
    """Model name -> its full weights (rank 0's `ModelState.weights`)."""
    optimizers: dict[str, list[dict[str, Any]]]
    """Model name -> every rank's optimizer state, in rank order (a resumed run needs the
    same number of ranks)."""


class TrainedWorker(Worker, abc.ABC):
    """One data-parallel rank of a model trained with FSDP2 and AdamW.

    After `setup`, `self.model` is this rank's (sharded) model and `self.optimizer` its AdamW.
    """

    model_kind: str | None = None
    """`meta_init.POLICY` or `meta_init.CRITIC`: what a checkpoint builds, so that a sharded
    rank can build it on the meta device (`meta_init.applies`); None keeps the old path."""
    from_skeleton = False
    """Set by `setup`: whether this rank's model is `meta_init`'s skeleton (what
    `_before_shard` is then given: shapes and names, no weights)."""

    def __init__(self, identity: WorkerIdentity, *, config: PPOConfig, vocab_size: int,
                 pad_id: int, lr: float, strict_load: bool = True) -> None:
        """`lr`: the role's learning rate; `strict_load=False` lets a checkpoint's weights
        leave out parameters the model has (a tied LM head, saved once under the embedding's
        name: see `PolicyWorker`)."""
        super().__init__(identity)
        self.config, self.vocab_size, self.pad_id = config, vocab_size, pad_id
        self.lr, self.strict_load = lr, strict_load
        self.device = config.placement.device
        # `model.dtype` is the compute dtype; the trained weights are fp32 masters.
        self.dtype: torch.dtype = getattr(torch, config.model.dtype)
        torch.set_num_threads(max(1, int(config.placement.cpus_per_worker)))

    def setup(self, weights: str | dict[str, torch.Tensor] | None = None,
              optimizer_state: dict | None = None) -> int:
        """Build the model, shard it, make its AdamW; all ranks at once. Returns the number
        of parameters. Resuming, `weights` is the model's directory of a sharded checkpoint
        (a `str`: `save_shards` wrote it, every rank reads its own shards, model and AdamW)
        or, from a checkpoint written before sharding, the full weights with this rank's
        `optimizer_state`."""
        ident = self.identity
        group = None
        offload = self.config.memory.cpu_offload
        # Mixed precision and CPU offload are FSDP2's: either needs a process group even for
        # one rank (`fsdp.backend`: offloaded CUDA state also reduces over gloo).
        if ident.world_size > 1 or fsdp.mixed_precision(self.dtype) or offload:
            group = self.init_distributed(fsdp.backend(self.device, offload=offload),
                                          timeout_s=self.config.train.collective_timeout_s)
        # From a checkpoint, sharded: a meta skeleton, filled after sharding from the whole
        # model that rank 0 alone loads, here as before (meta_init.py).
        meta = meta_init.applies(self.config, self.model_kind, group, ident.world_size, weights)
        self.from_skeleton = meta
        full = self._fresh_model() if not meta or ident.rank == 0 else None
        model = (self._fresh_model(meta_init.skeleton(self.config, self.model_kind)) if meta
                 else full)
        if isinstance(weights, dict):  # resuming from whole weights (an older checkpoint)
            model.load_state_dict(weights, strict=self.strict_load)
        # Offloaded, the model stays on the CPU: `fully_shard` moves one unit at a time to
        # the device, cuts this rank's shard and puts it in host memory (`CPUOffloadPolicy`),
        # so the GPU never holds the whole fp32 model — nor does it while `_before_shard`
        # builds the engine beside it (vLLM takes its share of the GPU then).
        if not meta and not offload:
            model.to(self.device)
        count = sum(p.numel() for p in model.parameters())
        self._before_shard(model)
        # LoRA (the actor only, `lora.py`): adapters put in before sharding, on rank 0's whole
        # copy too under meta init, so that both have the same names and the same A.
        model = self._adapt(model)
        if meta and full is not None:
            full = self._adapt(full)
        # eval(): dropout off, so the old-logp or values pass and the update see the same
        # function (transformers' token classifier, the critic, has a 0.1 dropout before its
        # head; RL fine-tuning turns it off so a forward pass is a function of the weights).
        model.eval()
        if self.config.checkpoints_activations:  # before sharding: FSDP2 wraps the layers
            checkpoint_activations(model)
        self.model = fsdp.shard_model(model, group, ident.world_size, self.device,
                                      compute_dtype=self.dtype, offload=offload)
        if meta:
            meta_init.fill(self.model, full, group=group, device=self.device)
        del full
        # Only what trains: with LoRA the frozen base weights get no AdamW state at all.
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=self.lr,
                                           weight_decay=self.config.train.weight_decay,
                                           betas=(0.9, 0.99))
        if isinstance(weights, str):  # resuming from shards: into the sharded model
            fsdp.load_shards(self.model, self.optimizer, weights)
        elif optimizer_state is not None:
            fsdp.load_optimizer_state(self.optimizer, optimizer_state)
        return count

    def _fresh_model(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """`_build_model` (or `model`: `meta_init.skeleton`'s), set to run the attention kernel
        of `memory.attention` (`models.trainer_attention`): the trained models and the
        reference, not the engine."""
        model = self._build_model() if model is None else model
        memory = self.config.memory
        model.set_attn_implementation(
            trainer_attention(memory.attention, self.device, packed=memory.pack_sequences,
                              dtype=self.dtype))
        return model

    @abc.abstractmethod
    def _build_model(self) -> torch.nn.Module:
        """The role's fp32 model as it is at step 0, on the CPU; every rank must build the
        same weights (a seed from the config, or the same local checkpoint)."""

    def _before_shard(self, model: torch.nn.Module) -> None:
        """Called once with the whole model (on its device, weights restored; on the CPU
        with `memory.cpu_offload`, see `setup`) just before
        FSDP2 shards it in place: the moment to copy anything out of it. Under meta init
        (`from_skeleton`) it is the skeleton instead: shapes and names, no weights. Nothing
        here."""

    def _adapt(self, model: torch.nn.Module) -> torch.nn.Module:
        """Called with the whole model (or meta init's skeleton) after `_before_shard`: the
        moment to change what trains (the actor's LoRA adapters). Nothing here."""
        return model

    def _set_lr(self, step: int, builder: ResultBuilder, prefix: str) -> None:
        """Set the optimizer's learning rate for training step `step` (`lr_at`); it is
        logged as <prefix>/lr only when a warm-up or schedule makes it move."""
        t = self.config.train
        lr = lr_at(t, self.lr, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if t.lr_warmup_steps > 0 or t.lr_schedule != "constant":
            builder.metric(f"{prefix}/lr", lr, "max")  # the same on every rank

    def save_shards(self, directory: str) -> None:
        """Write this rank's shards of the model and of AdamW under `directory` (an absolute
        path every rank reaches); all ranks at once. What a checkpoint stores."""
        fsdp.save_shards(self.model, self.optimizer, directory)

    def state(self) -> ModelState:
        """Full weights (rank 0 only, others None) and this rank's optimizer state: one whole
        fp32 copy of the model per rank (tests, small models); checkpoints use `save_shards`."""
        full = fsdp.full_state_dict(self.model)  # a collective: every rank takes part
        return ModelState(weights=full if self.identity.rank == 0 else None,
                          optimizer=fsdp.optimizer_state(self.optimizer))

    def close(self) -> None:
        """Leave the process group (all ranks at once)."""
        self.destroy_distributed()


def lr_at(train: TrainConfig, lr: float, step: int) -> float:
    """The learning rate of training step `step` (0-based) for a role whose rate is `lr`:
    a linear warm-up over `train.lr_warmup_steps`, then `train.lr_schedule` down to
    ``train.min_lr_ratio * lr`` at the last step. A function of the step alone (no scheduler
    state), so a resumed run continues the same curve; the defaults give `lr` itself.

    Example:
        >>> t = TrainConfig(steps=5, lr_warmup_steps=2, lr_schedule="linear")
        >>> [round(lr_at(t, 1.0, k), 3) for k in range(5)]
        [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if step < train.lr_warmup_steps:
        return lr * (step + 1) / train.lr_warmup_steps
    if train.lr_schedule == "constant":
        return lr
    # 0 when the warm-up ends, 1 at the last step
    progress = min(1.0, (step - train.lr_warmup_steps)
                   / max(1, train.steps - 1 - train.lr_warmup_steps))
    if train.lr_schedule == "linear":
        scale = 1.0 - progress
    else:  # cosine
        scale = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (train.min_lr_ratio + (1.0 - train.min_lr_ratio) * scale)


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Turn on transformers' activation checkpointing of `model`'s decoder layers
    (non-reentrant `torch.utils.checkpoint`): with grad, each layer keeps only its input and
    recomputes its activations in the backward pass. The same operations run again on the
    same values, so gradients do not change.

    transformers checkpoints a layer only while it is in training mode, and the roles keep the
    model in eval mode (dropout off). So only the layers' own `training` flag is set, not their
    children's: every dropout inside stays off (the Qwen2/Llama layers read no flag of their
    own). A later `model.eval()` would turn checkpointing off again.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the new name (not in 5.19)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True
