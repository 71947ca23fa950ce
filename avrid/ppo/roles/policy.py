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
  in `model.dtype` (it is never updated, so it needs no fp32 master copy);
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

import copy
import shutil
import tempfile

import torch

from avrid.dispatch import Packed, Shard
from avrid.ppo.algo.losses import kl_estimate, policy_loss
from avrid.ppo.data.columns import ModelInputs, Totals, model_inputs, padded
from avrid.ppo.engines.models import build_tiny_policy, load_policy, tiny_spec
from avrid.ppo.engines.torch_engine import SamplingParams, TorchEngine
from avrid.ppo.roles import fsdp
from avrid.ppo.roles.forward import response_logprobs, train_shard
from avrid.ppo.roles.trained import TrainedWorker
from avrid.ppo.roles.weight_sync import SyncReport, WeightSync
from avrid.ppo.setup.config import PPOConfig
from avrid.reshard.engines import TorchEngineSink
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import WorkerIdentity


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

    def setup(self, weights: dict[str, torch.Tensor] | None = None,
              optimizer_state: dict | None = None) -> int:
        """`TrainedWorker.setup` (the actor; the reference and the engine are made on the way,
        by `_before_shard`), then the engine's first weight sync; all ranks at once. Returns
        the number of actor parameters."""
        count = super().setup(weights, optimizer_state)
        ident = self.identity
        # Whole-tensor shapes: a sharded parameter (DTensor) reports its global shape.
        shapes = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
                  for n, p in self.model.named_parameters()}
        self.sync = WeightSync(fsdp.local_shards(self.model), shapes, rank=ident.rank,
                               world_size=ident.world_size, engine_dtype=self.dtype)
        # Before any generation the engine must hold exactly the actor's weights (a resumed
        # run's included; vLLM starts from random ones): one fingerprint-checked sync now.
        self.sync_weights()
        return count

    def _build_model(self) -> torch.nn.Module:
        """The fp32 policy as at step 0: the tiny random one from the run's seed (the same on
        every rank), or the local checkpoint `model.path`. Builds the actor and the reference."""
        cfg = self.config
        if cfg.model.path is None:
            return build_tiny_policy(tiny_spec(cfg, self.vocab_size), seed=cfg.train.seed,
                                     eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                                     dtype=torch.float32)
        return load_policy(cfg.model.path, dtype=torch.float32)

    def _before_shard(self, model: torch.nn.Module) -> None:
        """The reference and the rollout engine, made while the actor's model is whole."""
        # The reference is the policy as it was at step 0, built only when a KL term is used.
        self.reference = self._initial_policy() if self.config.algo.kl_coef > 0 else None
        self.engine = self._make_engine(model)

    def _initial_policy(self) -> torch.nn.Module:
        # Built as the actor is (fp32), then cast like the engine: the same bf16 function.
        model = fsdp.cast_parameters(self._build_model(), self.dtype)
        return model.to(self.device).eval().requires_grad_(False)

    def _engine_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """The rollout engine's own copy of the (fp32) actor model, its parameters in the
        engine's dtype (`model.dtype`); fp32 leaves the copy as it is."""
        return fsdp.cast_parameters(copy.deepcopy(model), self.dtype)

    def _make_engine(self, model: torch.nn.Module):  # noqa: ANN202 (TorchEngine | VllmEngine)
        if self.config.rollout.engine == "vllm":
            return self._make_vllm_engine(model)
        # The engine gets its own, unsharded copy: FSDP will shard the actor's in place.
        return TorchEngine(self._engine_copy(model).eval(), pad_token_id=self.pad_id)

    def _make_vllm_engine(self, model: torch.nn.Module):  # noqa: ANN202 (VllmEngine)
        """vLLM built from the model's config alone (``load_format="dummy"``: random weights):
        `setup` loads the actor's weights into it before anything is generated, so a fresh
        run, a resumed run and a checkpoint path all start from the weights being trained."""
        from avrid.ppo.engines.vllm_engine import VllmEngine  # vllm is imported only where used

        cfg = self.config
        max_model_len = cfg.rollout.max_prompt_tokens + self.max_response
        hf_config = copy.deepcopy(model.config)
        # vLLM refuses a context longer than the declared maximum; this RoPE has no
        # length-dependent scaling, so raising the declared maximum changes no number.
        hf_config.max_position_embeddings = max(hf_config.max_position_embeddings,
                                                max_model_len)
        self._engine_dir = tempfile.mkdtemp(prefix=f"avrid-vllm-{self.identity.rank}-")
        hf_config.save_pretrained(self._engine_dir)
        mib = cfg.rollout.vllm_kv_cache_mib
        return VllmEngine(self._engine_dir, load_format="dummy", dtype=cfg.model.dtype,
                          seed=cfg.train.seed, max_model_len=max_model_len,
                          gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                          kv_cache_bytes=None if mib is None else mib << 20)

    # ---- rollout ---------------------------------------------------------------------------

    def generate(self, shard: Shard, *, max_new_tokens: int, greedy: bool,
                 seed: int) -> WorkerResult:
        """Sample one response per prompt of the shard (the rows' "tokens" are prompts).
        Outputs: packed "response" token ids and "rollout_logp" (sampled-token log-probs), and
        the per-sample scalar "truncated": 1 where the response hit `max_new_tokens` without
        a stop token (the engine's finish reason "length"), else 0."""
        if max_new_tokens > self.max_response:  # the engine's context was sized for that
            raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the run's response "
                             f"budget of {self.max_response} tokens")
        builder = ResultBuilder.for_shard(self.identity, shard)
        batch = shard.batch
        prompts = [batch.packed["tokens"].row(i).tolist() for i in range(len(batch))]
        r = self.config.rollout
        params = SamplingParams(max_new_tokens=max_new_tokens, greedy=greedy,
                                temperature=1.0 if greedy else r.temperature,
                                top_k=0 if greedy else r.top_k,
                                top_p=1.0 if greedy else r.top_p,
                                stop_token_ids=self.stop_ids,
                                seed=seed + self.identity.rank)  # one stream per rank
        with builder.span("generate"):
            self.engine.wake()
            done = self.engine.generate(prompts, params) if prompts else []
            self.engine.sleep()
        lengths = [len(c.token_ids) for c in done]
        truncated = torch.tensor([c.finish_reason == "length" for c in done], dtype=torch.int64)
        builder.add(batch.sample_ids, packed={
            "response": Packed.from_rows([torch.tensor(c.token_ids, dtype=torch.int64)
                                          for c in done]),
            "rollout_logp": Packed.from_rows([torch.tensor(c.logprobs, dtype=torch.float32)
                                              for c in done])},
            scalars={"truncated": truncated})
        builder.metric("rollout/response_len", torch.tensor(lengths, dtype=torch.float64),
                       "mean_samples")
        builder.metric("rollout/truncation_rate", truncated.to(torch.float64), "mean_samples")
        builder.metric("rollout/tokens", float(sum(lengths)), "sum")
        return builder.build()

    # ---- log-probs -------------------------------------------------------------------------

    def compute_logprobs(self, shard: Shard, *, reference: bool = False) -> WorkerResult:
        """Log-probs of every response token under the actor ("old_logp", with the entropy
        metric) or the reference ("ref_logp")."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: it is built only when algo.kl_coef > 0")
        name = "ref_logp" if reference else "old_logp"
        builder = ResultBuilder.for_shard(self.identity, shard)
        with torch.no_grad():
            for mb in shard.micro_batches():
                with builder.span(name):
                    x = model_inputs(mb, self.pad_id)
                    logp, ent = response_logprobs(model, x, self.config.rollout.temperature,
                                                  with_entropy=not reference)
                builder.add_padded(mb.sample_ids, mb.response_lens, padded={name: logp})
                if ent is not None:
                    builder.metric("actor/entropy", ent[x.response_mask.bool()], "mean_tokens")
        return builder.build()

    # ---- training --------------------------------------------------------------------------

    def update(self, shard: Shard, *, totals: Totals, step: int) -> WorkerResult:
        """One PPO optimizer step of the actor on its shard of a mini-batch, at training step
        `step`'s learning rate (`trained.lr_at`)."""
        a = self.config.algo
        builder = ResultBuilder.for_shard(self.identity, shard)
        self._set_lr(step, builder, "actor")  # warm-up / schedule: a function of the step
        kl_loss = a.kl_coef > 0 and a.kl_in == "loss"
        need_entropy = a.entropy_coef > 0

        def loss_fn(x: ModelInputs, mb, w: torch.Tensor, b: ResultBuilder) -> torch.Tensor:
            logp, ent = response_logprobs(self.model, x, self.config.rollout.temperature,
                                          with_entropy=need_entropy)
            mask = x.response_mask
            out = policy_loss(logp, padded(mb, "old_logp"), padded(mb, "advantages"), mask,
                              clip_low=a.clip_low, clip_high=a.clip_high,
                              dual_clip=a.dual_clip)
            loss = (out.per_token * w).sum()
            valid = mask.bool()
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
                    agg=a.loss_agg, totals=totals, world_size=self.identity.world_size,
                    grad_clip=self.config.train.grad_clip, prefix="actor")
        return builder.build()

    # ---- weight sync, checks ---------------------------------------------------------------

    def sync_weights(self) -> SyncReport:
        """Actor shards -> this rank's engine (chapter 4), fingerprint-checked."""
        self.engine.wake()
        sink = (self.engine.sink if self.config.rollout.engine == "vllm"
                else TorchEngineSink(self.engine.model))
        group = self.process_group if self.identity.world_size > 1 else None
        report = self.sync.run(fsdp.local_shards(self.model), sink, group, self.device)
        self.engine.sleep()
        return report

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the torch rollout engine's parameters and buffers (for checks: what
        generation actually uses, in its own dtype)."""
        if self.config.rollout.engine != "torch":
            raise RuntimeError("engine_weights reads the torch engine; this run uses "
                               f"{self.config.rollout.engine!r}")
        return {n: t.detach().to("cpu", copy=True)
                for n, t in self.engine.model.state_dict().items()}

    def close(self) -> None:
        """Stop the rollout engine and leave the process group (all ranks at once)."""
        try:
            close_engine = getattr(getattr(self, "engine", None), "close", None)
            if callable(close_engine):
                close_engine()
        finally:
            if self._engine_dir is not None:
                shutil.rmtree(self._engine_dir, ignore_errors=True)
            super().close()
