"""Chapter 5 — `CriticWorker`: the value model of PPO, one data-parallel rank per worker.

The critic is the policy's trunk with a one-output head per token
(`Qwen2ForTokenClassification`, num_labels=1): V(s_t), the expected score from the state
before response token t. It is FSDP2-sharded over its own group like the actor and trained with
the clipped value loss (`losses.value_loss`) on the GAE returns. Like the actor it keeps fp32
parameters and AdamW state; `model.dtype=bfloat16` only sets the compute dtype (`fsdp.py`).
That scaffolding (process group, build or load, FSDP2, AdamW, checkpoint state) is
`TrainedWorker`'s; this file adds the critic's model, its values and its loss.

It runs only for PPO (GRPO has no critic). By default its workers share the actor's bundles
(colocated; on a GPU they would take turns); `placement.colocate_critic=False` gives it a pool
of its own. Methods take a `Shard` and return a chapter 3 `WorkerResult`.
"""

from __future__ import annotations

import torch

from avrid.dispatch import Shard
from avrid.ppo.algo.losses import value_loss
from avrid.ppo.data.columns import ModelInputs, Totals, model_inputs, padded
from avrid.ppo.engines.models import build_tiny_critic, load_seeded_critic, tiny_spec
from avrid.ppo.roles import handoff, meta_init
from avrid.ppo.roles.forward import model_device, response_values, train_shard
from avrid.ppo.roles.trained import TrainedWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import WorkerIdentity

VALUES_READS = ("tokens",)
"""The batch columns `CriticWorker.compute_values` reads (the driver sends only these, plus
"action_mask" when the batch has it: `columns.reads`)."""
VALUES_WRITES = ("values",)
"""The column `CriticWorker.compute_values` adds: V(s_t) per response token."""
CRITIC_UPDATE_READS = ("tokens", "loss_mask", "values", "returns")
"""The batch columns `CriticWorker.update` reads: the clipped value loss against the old
values and the returns, over the samples whose loss_mask is 1 (and their action tokens:
"action_mask", sent when the batch has it, `columns.reads`)."""


class CriticWorker(TrainedWorker):
    """One data-parallel rank of the critic (`self.model`)."""

    def __init__(self, identity: WorkerIdentity, *, config: PPOConfig, vocab_size: int,
                 pad_id: int) -> None:
        super().__init__(identity, config=config, vocab_size=vocab_size, pad_id=pad_id,
                         lr=config.train.critic_lr)

    model_kind = meta_init.CRITIC

    def _build_model(self) -> torch.nn.Module:
        """The fp32 critic as at step 0: the tiny random one, or `model.critic_path` (else
        `model.path`) with a new value head drawn from the run's seed."""
        cfg = self.config
        path = cfg.model.critic_path or cfg.model.path
        if path is None:
            # A different seed from the policy's: the two models should not start identical.
            return build_tiny_critic(tiny_spec(cfg, self.vocab_size), seed=cfg.train.seed + 1,
                                     dtype=torch.float32)
        # The same seed as the tiny critic's: the new value head is a function of the seed.
        return load_seeded_critic(path, seed=cfg.train.seed + 1, dtype=torch.float32)

    def compute_values(self, shard: Shard) -> WorkerResult:
        """V(s_t) for every response token: packed "values"."""
        builder = ResultBuilder.for_shard(self.identity, shard)
        device = model_device(self.model)  # the builder keeps CPU copies of what it is given
        with torch.no_grad():
            for mb in shard.micro_batches():
                with builder.span("values"):
                    x = model_inputs(mb.to(device), self.pad_id,
                                     packed=self.config.memory.pack_sequences)
                    values = response_values(self.model, x)
                builder.add_padded(mb.sample_ids, mb.response_lens, padded={"values": values})
                builder.metric("critic/values", values[x.action_mask.bool()], "mean_tokens")
        return builder.build()

    def update(self, shard: Shard, *, totals: Totals, step: int) -> WorkerResult:
        """One optimizer step of the clipped value loss on this rank's mini-batch shard, at
        training step `step`'s learning rate (`trained.lr_at`)."""
        a = self.config.algo
        builder = ResultBuilder.for_shard(self.identity, shard)
        self._set_lr(step, builder, "critic")  # warm-up / schedule: a function of the step

        def loss_fn(x: ModelInputs, mb, w: torch.Tensor, b: ResultBuilder) -> torch.Tensor:
            values = response_values(self.model, x)
            returns = padded(mb, "returns")
            # norm_len: seq-mean-token-sum-norm needs it (the weights `w` carry the same
            # aggregation over the whole mini-batch; value_loss checks its arguments alike).
            # Observation tokens (chapter 7) are no state of the policy's: not in the loss.
            out = value_loss(values, padded(mb, "values"), returns, x.action_mask,
                             clip=a.value_clip)
            valid = x.action_mask.bool()
            b.metric("critic/vf_clipfrac", out.clipped[valid].float(), "mean_tokens")
            b.metric("critic/vf_error", (values.detach() - returns)[valid] ** 2, "mean_tokens")
            return (out.per_token * w).sum()

        train_shard(self.model, self.optimizer, shard, builder, loss_fn, pad_id=self.pad_id,
                    packed=self.config.memory.pack_sequences,
                    agg=a.loss_agg, totals=totals, world_size=self.identity.world_size,
                    grad_clip=self.config.train.grad_clip, prefix="critic")
        # A colocated critic shares its GPU with the policy's rollout engine, which maps its
        # memory outside PyTorch's cache: give back what this update's activations left.
        handoff.empty_cache(self.device)
        return builder.build()
