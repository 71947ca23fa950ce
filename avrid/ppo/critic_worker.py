"""Chapter 5 — `CriticWorker`: the value model of PPO, one data-parallel rank per worker.

The critic is the policy's trunk with a one-output head per token
(`Qwen2ForTokenClassification`, num_labels=1): V(s_t), the expected score from the state
before response token t. It is FSDP2-sharded over its own group like the actor and trained with
the clipped value loss (`losses.value_loss`) on the GAE returns. Like the actor it keeps fp32
parameters and AdamW state; `model.dtype=bfloat16` only sets the compute dtype (`fsdp.py`).

It runs only for PPO (GRPO has no critic). By default its workers share the actor's bundles
(colocated; on a GPU they would take turns); `placement.colocate_critic=False` gives it a pool
of its own. Methods take a `Shard` and return a chapter 3 `WorkerResult`.
"""

from __future__ import annotations

import torch

from avrid.dispatch import Shard
from avrid.ppo import fsdp
from avrid.ppo.actor import Totals, response_values, train_shard
from avrid.ppo.batching import ModelInputs, model_inputs, padded
from avrid.ppo.config import PPOConfig
from avrid.ppo.losses import value_loss
from avrid.ppo.models import build_tiny_critic, load_critic
from avrid.ppo.policy_worker import tiny_spec
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import Worker, WorkerIdentity


class CriticWorker(Worker):
    """One data-parallel rank of the critic."""

    def __init__(self, identity: WorkerIdentity, *, config: PPOConfig, vocab_size: int,
                 pad_id: int) -> None:
        super().__init__(identity)
        self.config, self.vocab_size, self.pad_id = config, vocab_size, pad_id
        self.device = config.placement.device
        torch.set_num_threads(max(1, int(config.placement.cpus_per_worker)))

    def setup(self, weights: dict[str, torch.Tensor] | None = None,
              optimizer_state: dict | None = None) -> int:
        """Build (or restore) the critic and shard it; all ranks at once. Returns #params."""
        cfg, ident = self.config, self.identity
        # `model.dtype` is the compute dtype; the trained weights are fp32 masters.
        dtype = getattr(torch, cfg.model.dtype)
        group = None
        # Mixed precision is FSDP2's, so a bf16 run needs a process group even for one rank.
        if ident.world_size > 1 or fsdp.mixed_precision(dtype):
            group = self.init_distributed("nccl" if self.device == "cuda" else "gloo")
        path = cfg.model.critic_path or cfg.model.path
        if path is None:
            # A different seed from the policy's: the two models should not start identical.
            model = build_tiny_critic(tiny_spec(cfg, self.vocab_size), seed=cfg.train.seed + 1,
                                      dtype=torch.float32)
        else:
            model = load_critic(path, dtype=torch.float32)
        if weights is not None:
            model.load_state_dict(weights)
        count = sum(p.numel() for p in model.parameters())
        # eval(): dropout off. transformers' token classifier adds a 0.1 dropout before its
        # head; RL fine-tuning turns dropout off so a forward pass is a function of the weights.
        self.critic = fsdp.shard_model(model.to(self.device).eval(), group, ident.world_size,
                                       self.device, compute_dtype=dtype)
        self.optimizer = torch.optim.AdamW(self.critic.parameters(), lr=cfg.train.critic_lr,
                                           weight_decay=cfg.train.weight_decay,
                                           betas=(0.9, 0.99))
        if optimizer_state is not None:
            fsdp.load_optimizer_state(self.optimizer, optimizer_state)
        return count

    def compute_values(self, shard: Shard) -> WorkerResult:
        """V(s_t) for every response token: packed "values"."""
        builder = ResultBuilder.for_shard(self.identity, shard)
        with torch.no_grad():
            for mb in shard.micro_batches():
                with builder.span("values"):
                    x = model_inputs(mb, self.pad_id)
                    values = response_values(self.critic, x)
                builder.add_padded(mb.sample_ids, mb.response_lens, padded={"values": values})
                builder.metric("critic/values", values[x.response_mask.bool()], "mean_tokens")
        return builder.build()

    def update(self, shard: Shard, *, totals: Totals) -> WorkerResult:
        """One optimizer step of the clipped value loss on this rank's mini-batch shard."""
        a = self.config.algo
        builder = ResultBuilder.for_shard(self.identity, shard)

        def loss_fn(x: ModelInputs, mb, w: torch.Tensor, b: ResultBuilder) -> torch.Tensor:
            values = response_values(self.critic, x)
            returns = padded(mb, "returns")
            # norm_len: seq-mean-token-sum-norm needs it (the weights `w` carry the same
            # aggregation over the whole mini-batch; value_loss checks its arguments alike).
            out = value_loss(values, padded(mb, "values"), returns, x.response_mask,
                             clip=a.value_clip, agg=a.loss_agg, norm_len=totals.norm_len)
            valid = x.response_mask.bool()
            b.metric("critic/vf_clipfrac", out.clipped[valid].float(), "mean_tokens")
            b.metric("critic/vf_error", (values.detach() - returns)[valid] ** 2, "mean_tokens")
            return (out.per_token * w).sum()

        train_shard(self.critic, self.optimizer, shard, builder, loss_fn, pad_id=self.pad_id,
                    agg=a.loss_agg, totals=totals, world_size=self.identity.world_size,
                    grad_clip=self.config.train.grad_clip, prefix="critic")
        return builder.build()

    def state(self) -> dict:
        """Full critic weights (rank 0 only, others None) and this rank's optimizer state."""
        full = fsdp.full_state_dict(self.critic)
        return {"weights": full if self.identity.rank == 0 else None,
                "optimizer": fsdp.optimizer_state(self.optimizer)}

    def close(self) -> None:
        """Leave the process group (all ranks at once)."""
        self.destroy_distributed()
