"""Chapter 5 — `ReferenceWorker`: the frozen reference on ranks of its own (a reference pool).

By default the reference lives in the policy's processes (`roles/policy.py`: a frozen copy
beside the actor, or with LoRA the actor with its adapters off), so its pass and the actor's
take turns on the same ranks. With ``placement.reference="pool"`` it gets
``placement.reference_dp`` ranks of its own (OpenRLHF's layout): each rank holds the whole
initial policy — the tiny random one from the run's seed or `model.path`, built exactly as
the policy builds its copy (`frozen_policy`), in `model.dtype`, in eval mode, no gradient —
and computes "ref_logp" for the shard the driver's plan sent it, with the same forward as the
policy's (`forward.shard_logprobs`). Its pass can then run beside the actor's "old_logp"
(`train.concurrent_phases`).

With LoRA the reference is the base model, and the base never trains: the initial weights
are exactly what the actor computes with its adapters off, so a pool holds those.

The model is built when the worker starts (like the reward model's), so there is no setup
call, no process group, no optimizer and nothing to checkpoint: a resumed run rebuilds the
same weights from the config. Not here: sharding (each rank holds a whole copy: a model too
big for one device stays on the policy's ranks, where it is sharded like the actor), the
placement (`driver/placement.py`), when it is called (`driver/reference.py`).
"""

from __future__ import annotations

import torch

from avrid.dispatch import Shard
from avrid.ppo.engines.models import initial_policy, trainer_attention
from avrid.ppo.roles import fsdp
from avrid.ppo.roles.forward import shard_logprobs
from avrid.ppo.setup.config import PPOConfig
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import Worker, WorkerIdentity


def frozen_policy(config: PPOConfig, *, vocab_size: int, eos_id: int,
                  pad_id: int) -> torch.nn.Module:
    """The initial policy (`models.initial_policy`) as a frozen reference on the CPU: the
    trainer's attention kernel (`models.trainer_attention`), parameters cast to
    `model.dtype` (buffers kept, as under FSDP2's mixed precision), eval mode, no grad."""
    dtype = getattr(torch, config.model.dtype)
    model = initial_policy(config, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id)
    memory = config.memory
    model.set_attn_implementation(
        trainer_attention(memory.attention, config.placement.device,
                          packed=memory.pack_sequences, dtype=dtype))
    model = fsdp.cast_parameters(model, dtype).eval()
    model.requires_grad_(False)
    return model


class ReferenceWorker(Worker):
    """One data-parallel rank of a reference pool: a whole frozen copy of the initial policy."""

    def __init__(self, identity: WorkerIdentity, *, config: PPOConfig, vocab_size: int,
                 eos_id: int, pad_id: int) -> None:
        super().__init__(identity)
        self.config, self.pad_id = config, pad_id
        # As the trained roles do: the bundle's CPUs are this rank's torch threads.
        torch.set_num_threads(max(1, int(config.placement.cpus_per_worker)))
        self.model = frozen_policy(config, vocab_size=vocab_size, eos_id=eos_id,
                                   pad_id=pad_id).to(config.placement.device)

    def compute_logprobs(self, shard: Shard) -> WorkerResult:
        """Log-probs of every response token under the reference: packed "ref_logp" (what
        `PolicyWorker.compute_logprobs(reference=True)` returns; it reads
        `policy.LOGPROBS_READS`)."""
        builder = ResultBuilder.for_shard(self.identity, shard)
        m = self.config.memory
        shard_logprobs(self.model, shard, builder, column="ref_logp", pad_id=self.pad_id,
                       temperature=self.config.rollout.temperature, packed=m.pack_sequences,
                       chunk=m.logprob_chunk, with_entropy=False)
        return builder.build()
