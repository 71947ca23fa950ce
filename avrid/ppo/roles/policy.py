"""Chapter 5 — `PolicyWorker`: actor, reference and rollout in one process (the hybrid engine).

verl's "ActorRolloutRefWorker" idea, written out: the three policy roles share a process per
data-parallel rank, so their weights never cross a process boundary except inside the FSDP
group, and the GPU (on CUDA) is shared by taking turns — the engine sleeps while the actor
trains. Per rank:

- the actor (`self.model`): the trained policy, FSDP2-sharded over the group (`fsdp.py`),
  with AdamW; its parameters and optimizer state are always fp32 (with
  `model.dtype=bfloat16` it computes in bf16 through FSDP2's mixed precision, over a 1-rank
  group when dp = 1);
- the reference: a frozen copy of the initial policy, built only when a KL term is used, held
  in `model.dtype` (it is never updated, so it needs no fp32 master copy); sharded over the
  actor's group like the actor whenever the actor is (`fsdp.shard_frozen`), no optimizer
  (with `placement.reference="pool"` none here: `ReferenceWorker` ranks hold it);
- the rollout engine: a full, unsharded copy in `model.dtype` that generates
  (`torch_engine.TorchEngine` or `vllm_engine.VllmEngine`), refreshed from the actor by
  `sync_weights` (chapter 4), which casts the fp32 shards to the engine's dtype.

The actor's scaffolding (process group, build or load, FSDP2, AdamW, checkpoint state) is
`TrainedWorker`'s, shared with the critic; this file adds what is the policy's own: the
reference and the engine, generation, log-probs, the policy loss and the weight sync.
Every data method takes a `Shard` and returns a chapter 3 `WorkerResult`, so the driver
dispatches with `run_shards` and merges without caring how the rank walked its shard.
The driver (`trainer.py`) decides the order of calls; nothing here keeps hidden state
beyond the models and the optimizer.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from avrid.dispatch import Shard
from avrid.ppo.algo.losses import kl_estimate
from avrid.ppo.algo.off_policy import importance_weights
from avrid.ppo.algo.registry import (
    PolicyLossInputs,
    compute_policy_loss,
    resolve_policy_loss,
)
from avrid.ppo.data.columns import ModelInputs, Totals, padded
from avrid.ppo.engines.models import initial_policy
from avrid.ppo.engines.torch_engine import OnFinish, TorchEngine
from avrid.ppo.roles import fsdp, handoff, lora, meta_init
from avrid.ppo.roles.adapter_sync import AdapterSync, serves_adapters
from avrid.ppo.roles.forward import response_logprobs, shard_logprobs, train_shard
from avrid.ppo.roles.generation import build_engine, close_engine, generate_shard
from avrid.ppo.roles.trained import TrainedWorker
from avrid.ppo.roles.weight_sync import SyncReport, WeightSync
from avrid.ppo.setup.config import PPOConfig
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import WorkerIdentity

LOGPROBS_READS = ("tokens",)
"""The batch columns `PolicyWorker.compute_logprobs` reads (the driver sends only these, plus
"action_mask" when the batch has it: `columns.reads`; the entropy metric covers actions)."""
LOGPROBS_WRITES = ("old_logp",)
"""The column `compute_logprobs` adds under the actor; `REF_LOGPROBS_WRITES` under the
reference (`reference=True`: the frozen copy, or with LoRA the actor with its adapters off)."""
REF_LOGPROBS_WRITES = ("ref_logp",)
"""The column `compute_logprobs(reference=True)` adds."""


def actor_update_reads(config: PPOConfig) -> tuple[str, ...]:
    """The batch columns `PolicyWorker.update` reads under `config` (the driver sends only
    these): the PPO loss's, the rollout's log-probs when an off-policy correction applies
    (chapter 6), the reference's when the KL is in the loss. The driver adds "action_mask"
    when the batch has it (`columns.reads`): the loss then covers the action tokens only."""
    a = config.algo
    reads = ("tokens", "loss_mask", "old_logp", "advantages")
    if config.pipeline.applied_correction != "none":
        reads += ("rollout_logp",)
    if a.kl_coef > 0 and a.kl_in == "loss":
        reads += ("ref_logp",)
    return reads


class PolicyWorker(TrainedWorker):
    """One data-parallel rank of the policy: actor (`self.model`) + reference + rollout engine."""

    def __init__(self, identity: WorkerIdentity, *, config: PPOConfig, vocab_size: int,
                 eos_id: int, pad_id: int, stop_ids: tuple[int, ...] = (),
                 max_response_tokens: int) -> None:
        # strict_load=False: a checkpoint holds `named_parameters`, which list a tied LM head
        # (`tie_word_embeddings`, e.g. Qwen2.5-0.5B) once, under the embedding's name only.
        super().__init__(identity, config=config, vocab_size=vocab_size, pad_id=pad_id,
                         lr=config.train.actor_lr, strict_load=False)
        self.eos_id = eos_id
        # Every id that ends a response (a chat model's generation config may list several).
        self.stop_ids = tuple(dict.fromkeys((eos_id, *stop_ids)))
        # The one response budget: the engine's context (prompt cap + this) is sized from it.
        self.max_response = max_response_tokens
        self._engine_dir: str | None = None
        self._engine_skeleton: torch.nn.Module | None = None  # meta init's torch engine
        self._reference_unfilled = False  # meta init: the reference's skeleton awaits its fill
        self.adapter_sync: AdapterSync | None = None  # lora.sync=adapter into vLLM
        # What the engine releases after generating (`handoff.trainer_sleep_level`): set in
        # `setup` once it is known whether the engine is sent adapters.
        self.sleep_level = handoff.TRAINER_SLEEP_LEVEL
        self._version = 0  # the weight version the engine is sent next (names the adapter)

    def setup(self, weights: dict[str, torch.Tensor] | None = None,
              optimizer_state: dict | None = None) -> int:
        """`TrainedWorker.setup` (the actor; the reference and the engine are made on the way,
        by `_before_shard`), then the engine's first weight sync; all ranks at once. Returns
        the number of actor parameters."""
        count = super().setup(weights, optimizer_state)
        if self._reference_unfilled:  # meta init: from the one copy rank 0 loads, like the actor
            full = (fsdp.cast_parameters(self._fresh_model(), self.dtype)
                    if self.identity.rank == 0 else None)
            meta_init.fill(self.reference, full, group=self._process_group, device=self.device)
            self._reference_unfilled = False
        if self._engine_skeleton is not None:  # meta init: storage now, weights by the sync
            meta_init.materialize_engine(self._engine_skeleton, self.model, self.device)
            self.engine = TorchEngine(self._engine_skeleton, pad_token_id=self.pad_id)
            self._engine_skeleton = None
        if self.engine is None:  # no engine of its own: nothing to keep in sync here
            return count
        ident = self.identity
        self.sync = WeightSync(self.served_shards(), self.served_shapes(), rank=ident.rank,
                               world_size=ident.world_size, engine_dtype=self.dtype)
        if serves_adapters(self.config):  # the base never changes: sent once, here
            self.adapter_sync = AdapterSync(self.model, rank=ident.rank, engine_dtype=self.dtype)
            # Its base never changes: kept on the GPU between steps where the estimate says
            # the trainer leaves room for it, else offloaded to host memory and back.
            self.sleep_level = handoff.trainer_sleep_level(
                self.config, adapters=True, device=self.device, vocab_size=self.vocab_size)
            group = self.process_group if ident.world_size > 1 else None
            self.sync.run(self.served_shards(), self.engine.sink, group, self.device)
        # Before any generation the engine must hold exactly the actor's weights (a resumed
        # run's included; vLLM starts from random ones): one fingerprint-checked sync now.
        self.sync_weights()
        return count

    model_kind = meta_init.POLICY

    def _build_model(self) -> torch.nn.Module:
        """The fp32 policy as at step 0 (`models.initial_policy`): the tiny random one from the
        run's seed, or the local checkpoint `model.path`. Builds the actor and the reference."""
        return initial_policy(self.config, vocab_size=self.vocab_size, eos_id=self.eos_id,
                              pad_id=self.pad_id)

    def _before_shard(self, model: torch.nn.Module) -> None:
        """The reference and the rollout engine, made while the actor's model is whole. A
        meta skeleton (`meta_init`: a sharded rank starting from a checkpoint) has no weights
        to copy: the torch engine is then a skeleton of its own, given storage in `setup` and
        its weights by the first sync (vLLM reads only the model's config either way)."""
        # The reference is the policy as it was at step 0, built only when a KL term is used.
        meta = self.from_skeleton  # then the reference is a skeleton too, filled in `setup`
        # With LoRA the reference is the actor with its adapters off: no copy is made; with
        # placement.reference="pool" it lives on ranks of its own (`roles/reference.py`).
        wanted = (self.config.algo.kl_coef > 0 and not self.config.lora.enabled
                  and self.config.placement.reference == "policy")
        self.reference = self._initial_policy(meta) if wanted else None
        self._reference_unfilled = meta and self.reference is not None
        self.engine = self._make_engine(model)

    def _adapt(self, model: torch.nn.Module) -> torch.nn.Module:
        """LoRA adapters on the actor when `lora.rank` > 0 (`lora.attach`; the same A on
        every rank, from the run's seed)."""
        if not self.config.lora.enabled:
            return model
        return lora.attach(model, self.config.lora, seed=self.config.train.seed + 17)

    def served_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (whole shape, dtype name) of every tensor the engine holds, in order: the
        actor's parameters (a sharded one, a DTensor, reports its global shape); with LoRA,
        the base model's (the engine is sent the merged weights)."""
        return lora.served_shapes(self.model)

    def served_shards(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the weights the engine holds: the actor's parameters; with
        LoRA the merged W + (alpha / r) B A (`lora.merged_local_shards`; a collective then),
        or, where the engine is sent the adapters themselves, the base weights."""
        shards = fsdp.local_shards(self.model)
        if not self.config.lora.enabled:
            return shards
        if serves_adapters(self.config):
            return lora.base_local_shards(shards)
        return lora.merged_local_shards(self.model, shards)

    def _initial_policy(self, meta: bool = False) -> torch.nn.Module:
        # Built as the actor is (fp32), then cast like the engine: the same bf16 function.
        # `meta`: the actor is meta_init's skeleton, and so is the reference (`setup` fills it).
        skeleton = meta_init.skeleton(self.config, meta_init.POLICY) if meta else None
        model = fsdp.cast_parameters(self._fresh_model(skeleton), self.dtype).eval()
        model.requires_grad_(False)
        group = self._process_group  # the actor's, when it is sharded (dp > 1, bf16, offload)
        if group is None:
            return model.to(self.device)
        # Sharded like the actor, in its own dtype: each rank holds 1/dp of it. fully_shard
        # moves each layer to the device as it shards it, so it is never whole there.
        return fsdp.shard_frozen(model, group, self.device,
                                 offload=self.config.memory.cpu_offload)

    def _make_engine(self, model: torch.nn.Module):  # noqa: ANN202 (TorchEngine | VllmEngine)
        """This rank's rollout engine (`generation.build_engine`); a subclass whose ranks do
        not generate (chapter 6's trainer, with a rollout pool of its own) returns None."""
        if self.from_skeleton and self.config.rollout.engine == "torch":
            self._engine_skeleton = meta_init.engine_skeleton(model, self.dtype)
            return None  # `setup` makes the engine once the skeleton has storage
        engine, self._engine_dir = build_engine(self.config, model, rank=self.identity.rank,
                                                pad_id=self.pad_id,
                                                max_response=self.max_response)
        return engine

    # ---- rollout ---------------------------------------------------------------------------

    def generate(self, shard: Shard, *, max_new_tokens: int, greedy: bool,
                 seed: int) -> WorkerResult:
        """Sample one response per prompt of the shard (`generation.generate_shard`): packed
        "response" and "rollout_logp", scalar "truncated"."""
        return self._generate(shard, max_new_tokens=max_new_tokens, greedy=greedy, seed=seed)

    def _generate(self, shard: Shard, *, max_new_tokens: int, greedy: bool, seed: int,
                  on_finish: OnFinish | None = None) -> WorkerResult:
        """`generate`, telling `on_finish` of each row as it is final (`streaming.py`)."""
        if self.engine is None:
            raise RuntimeError(f"{self.identity.name} has no rollout engine: with pipeline."
                               f"mode={self.config.pipeline.mode!r} the rollout pool generates")
        if self.engine.asleep:  # no sync since the last generation (e.g. a critic warm-up
            self._load_engine()  # step, or validation): every rank reloads, as in a sync
        result = generate_shard(self.engine, shard, self.identity, self.config,
                                stop_ids=self.stop_ids, max_response=self.max_response,
                                max_new_tokens=max_new_tokens, greedy=greedy, seed=seed,
                                on_finish=on_finish)
        # The GPU is the trainer's until the next sync; an engine that serves adapters keeps
        # its base weights (offloaded to host memory) instead of dropping them.
        handoff.to_trainer(self.engine, level=self.sleep_level)
        return result

    # ---- log-probs -------------------------------------------------------------------------

    def compute_logprobs(self, shard: Shard, *, reference: bool = False) -> WorkerResult:
        """Log-probs of every response token under the actor ("old_logp", with the entropy
        metric) or the reference ("ref_logp")."""
        base = reference and self.config.lora.enabled  # the reference: adapters off
        model = self.model if base or not reference else self.reference
        if model is None:
            raise RuntimeError("no reference model here: the policy builds one only when "
                               "algo.kl_coef > 0 and placement.reference='policy'")
        name = "ref_logp" if reference else "old_logp"
        builder = ResultBuilder.for_shard(self.identity, shard)
        m = self.config.memory
        # The actor's entropy feeds the `actor/entropy` metric; the reference pass skips it.
        with lora.adapters_off(model) if base else nullcontext():
            shard_logprobs(model, shard, builder, column=name, pad_id=self.pad_id,
                           temperature=self.config.rollout.temperature,
                           packed=m.pack_sequences, chunk=m.logprob_chunk,
                           with_entropy=not reference)
        if reference and not base:  # no backward reshards its root (embedding, head): free them
            fsdp.reshard(model)
        return builder.build()

    # ---- training --------------------------------------------------------------------------

    def update(self, shard: Shard, *, totals: Totals, step: int) -> WorkerResult:
        """One PPO optimizer step of the actor on its shard of a mini-batch, at training step
        `step`'s learning rate (`trained.lr_at`)."""
        a, q = self.config.algo, self.config.pipeline
        builder = ResultBuilder.for_shard(self.identity, shard)
        self._set_lr(step, builder, "actor")  # warm-up / schedule: a function of the step
        kl_loss = a.kl_coef > 0 and a.kl_in == "loss"
        loss_of = resolve_policy_loss(a.policy_loss)  # `algo/registry.py`: ppo, gspo, cispo
        need_entropy = a.entropy_coef > 0

        def loss_fn(x: ModelInputs, mb, w: torch.Tensor, b: ResultBuilder) -> torch.Tensor:
            logp, ent = response_logprobs(self.model, x, self.config.rollout.temperature,
                                          with_entropy=need_entropy,
                                          chunk=self.config.memory.logprob_chunk)
            # The policy's own tokens: an observation token (chapter 7) is treated as padding
            # by the loss, the off-policy weights and every metric (its rollout_logp is 0).
            mask = x.action_mask
            out = compute_policy_loss(loss_of, a.policy_loss, PolicyLossInputs(
                logp=logp, old_logp=padded(mb, "old_logp"), advantages=padded(mb, "advantages"),
                mask=mask, algo=a))
            per_token = out.per_token
            valid = mask.bool()
            correction = q.applied_correction
            if correction != "none":  # chapter 6: reweight for the policy that sampled
                iw = importance_weights(padded(mb, "old_logp"), padded(mb, "rollout_logp"),
                                        mask, correction=correction, cap=q.is_cap)
                per_token = per_token * iw.weights
                b.metric("actor/is_capped_frac", iw.capped[valid].float(), "mean_tokens")
            loss = (per_token * w).sum()
            # The policy loss alone, before the KL and entropy terms: summed like actor/loss
            # (`train_shard`), each rank's share of the mini-batch's (w holds world_size).
            pg_loss = float(loss.detach()) / self.identity.world_size
            if math.isfinite(pg_loss):  # a non-finite step is skipped and counted there
                b.metric("actor/pg_loss", pg_loss, "sum")
            b.metric("actor/pg_clipfrac", out.clipped[valid].float(), "mean_tokens")
            b.metric("actor/ppo_kl", (padded(mb, "old_logp") - logp.detach())[valid],
                     "mean_tokens")
            if kl_loss:
                kl = kl_estimate(logp, padded(mb, "ref_logp"), a.kl_kind)
                loss = loss + a.kl_coef * (kl * w).sum()
                b.metric("actor/kl_loss", kl.detach()[valid], "mean_tokens")
            if ent is not None:
                loss = loss - a.entropy_coef * (ent * w).sum()
            return loss

        train_shard(self.model, self.optimizer, shard, builder, loss_fn, pad_id=self.pad_id,
                    packed=self.config.memory.pack_sequences,
                    agg=a.loss_agg, totals=totals, world_size=self.identity.world_size,
                    grad_clip=self.config.train.grad_clip, prefix="actor")
        return builder.build()

    # ---- weight sync, checks ---------------------------------------------------------------

    def sync_weights(self, version: int | None = None) -> WorkerResult:
        """Actor shards -> this rank's engine (chapter 4), fingerprint-checked; `version`
        (the driver's count of updates; default: one more than the last) names what was
        sent. The result carries no samples: the span "weight_sync" for the timeline, the
        bytes this rank received (``sync/bytes_per_rank``) and loaded into its engine
        (``sync/engine_bytes``: the model, or only the adapters)."""
        builder = ResultBuilder.for_call(self.identity)
        if version is not None:
            self._version = version
        with builder.span("weight_sync"):
            report = self._load_engine()
        builder.metric("sync/bytes_per_rank", report.bytes_moved, "max", per_rank=True)
        builder.metric("sync/engine_bytes", report.engine_bytes, "max", per_rank=True)
        return builder.build()

    def _load_engine(self) -> SyncReport:
        """The hand-over of `handoff.py`: the engine's weights woken (not its KV cache), the
        actor's weights (or adapters) streamed in and checked, then the KV cache woken for
        generation; the engine stays awake until the next generation ends."""
        handoff.wake_for_load(self.engine, self.device)
        if self.adapter_sync is not None:
            report = self.adapter_sync.run(self.model, self.engine, version=self._version,
                                           device=self.device)
        else:
            group = self.process_group if self.identity.world_size > 1 else None
            report = self.sync.run(self.served_shards(), self.engine.sink, group, self.device)
        self._version += 1
        handoff.wake_for_generate(self.engine, self.device)
        return report

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the torch rollout engine's parameters and buffers (for checks: what
        generation actually uses, in its own dtype)."""
        if self.config.rollout.engine != "torch":
            raise RuntimeError("engine_weights reads the torch engine; this run uses "
                               f"{self.config.rollout.engine!r}")
        if self.engine.asleep:  # level 2: nothing to read until the next sync reloads it
            raise RuntimeError("the rollout engine sleeps (it released its weights after the "
                               "last generation): read it after a weight sync")
        return {n: t.detach().to("cpu", copy=True)
                for n, t in self.engine.model.state_dict().items()}

    def close(self) -> None:
        """Stop the rollout engine and leave the process group (all ranks at once)."""
        try:
            close_engine(getattr(self, "engine", None), self._engine_dir)
        finally:
            super().close()
