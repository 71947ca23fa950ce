"""Chapter 5 — the memory a config needs, per GPU and per phase, predicted before launch.

`avrid ppo --estimate-memory` calls `estimate(config)`: from the model's shape
(`memory_shapes.py`) and the config's sizes it adds up, for every phase of a step (and the
"setup" that builds the models, `memory_setup.py`), the bytes one rank holds at that phase's
peak, by component:

    params   fp32 master weights (1/dp each under FSDP2) + the gathered compute copies
             (two layers: FSDP2 prefetches the next, and the root unit — embedding, head —
             stays gathered while the model runs); GPU: one layer and the root with cpu_offload.
             With LoRA the frozen base is an fp32 master too, and the adapters are added
    grads    fp32 gradients (1/dp), during an update only (set_to_none after the step); with
             LoRA the adapters' only (the frozen base has none)
    optim    AdamW's two fp32 moments (1/dp), from the first step on; host with cpu_offload;
             with LoRA the adapters' only
    activ    saved activations (`memory_activations.py`)
    logits   `memory.logprob_chunk` positions x vocab, a few fp32 copies (`memory_activations`)
    ref      the frozen reference in model.dtype (kl_coef > 0), 1/actor_dp; none with LoRA
             (the actor with its adapters off) and in host memory with cpu_offload; with
             placement.reference=pool a whole copy on each "reference" GPU instead
    critic   a colocated critic's state (placement.colocate_critic, PPO) on the policy's GPU
    rm       a reward model's weights, on every phase of the GPU its placement names; its
             own phase "reward model" adds one forward (`memory_reward_model.py`)
    engine   rollout engine weights (model.dtype); vLLM: its gpu_memory_utilization share of
             the GPU (weights + KV cache) while it generates; an engine served LoRA adapters
             may keep its base resident while the trainer runs (`sleep_level`)
    kv       the torch engine's KV cache and sampling logits for one generate batch
    sync     weight-sync buffers: a load group of at most half a bucket (BUCKET_BYTES) whole,
             plus its receive buffers; the largest module alone if it is bigger. Pipeline
             modes: trainer rank 0's posted buckets, a rollout GPU's received one
             (`memory_pipeline.py`)
    runtime  the CUDA context and allocator slack of a GPU process (`CUDA_RUNTIME`; 0 on CPU)

The GPUs of the layout: "policy" (actor, reference, and in sync mode the engine), "critic"
(a critic on GPUs of its own), in the pipeline modes "rollout" (`memory_pipeline.py`),
"reward_model" (a reward model in a pool of its own), and "reference" (a reference pool).

Not here: the micro-batch and its activations (`memory_activations.py`), shapes
(`memory_shapes.py`), printing (`memory_report.py`), running anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.memory_activations import (
    PACKED_SDPA,
    Workload,
    attention_kernel,
    forward_bytes,
    logit_bytes,
    workload_of,
)
from avrid.ppo.setup.memory_pipeline import push_parts, receive_bytes, rollout_phases
from avrid.ppo.setup.memory_reward_model import reward_model_gpu, reward_model_memory
from avrid.ppo.setup.memory_setup import setup_parts
from avrid.ppo.setup.memory_shapes import ModelShape, adapter_params, shapes_of
from avrid.ppo.setup.rollout import gpu_memory_share

GiB = 1 << 30
BUCKET_BYTES = 64 << 20
"""`roles.weight_sync.BUCKET_BYTES` (a test keeps them equal; setup may not import roles)."""
CUDA_RUNTIME = 1 * GiB
"""A CUDA process's context, cuBLAS/NCCL workspaces and allocator slack (not measured here:
an allowance)."""
COMPONENTS = ("params", "grads", "optim", "activ", "logits", "ref", "critic", "rm", "engine",
              "kv", "sync", "runtime")
SLEEP_KV_ONLY, SLEEP_OFFLOAD, SLEEP_DROP = 0, 1, 2
"""What a hybrid engine releases when it hands the GPU to the trainer (`roles/handoff.py`):
0 the KV cache only (the weights stay resident), 1 the KV cache with the weights offloaded to
pinned host memory (copied out and back every step), 2 the KV cache and the weights (the
trainer holds the masters and the next sync reloads them)."""
RESIDENT_HEADROOM = 0.10
"""The share of the GPU the trainer's phases must still leave free, with a LoRA engine's base
kept resident, before `sleep_level` keeps it: an out-of-memory error mid-run costs far more
than the copy it saves (the estimate was checked within 20% on CPU, not on a GPU)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """One phase of a step on one GPU: its components' bytes at the phase's peak."""

    name: str
    gpu: str
    """Which GPU of the layout: "policy", "critic" or "rollout" (see the module docstring)."""
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """The phase's predicted peak: the sum of its components."""
        return sum(self.parts.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """Every phase of `config` per GPU, and what it was computed from."""

    phases: tuple[Phase, ...]
    policy: ModelShape
    critic: ModelShape | None
    workload: Workload
    attention: str
    notes: tuple[str, ...]
    host_bytes: int
    """Per rank host memory of the offloaded state (memory.cpu_offload) and of a LoRA engine's
    base offloaded at each sleep (level 1); 0 without either."""
    adapters: int = 0
    """LoRA adapter parameters of the actor (0 without LoRA)."""
    sleep_level: int = SLEEP_DROP
    """The level the hybrid engine sleeps at (`sleep_level`; `SLEEP_DROP` without one)."""
    sleep_transfer_bytes: int = 0
    """Host <-> GPU bytes that sleep moves per step (level 1: the base out and back)."""
    gpus: dict[str, int] = field(default_factory=dict)
    """GPUs of each kind the layout uses ("policy", "critic", "rollout", "reward_model",
    "reference")."""

    def peak(self, gpu: str | None = None) -> int:
        """The largest phase peak (of one GPU kind, or of all)."""
        return max(p.peak for p in self.phases if gpu is None or p.gpu == gpu)


def layout_gpus(config: PPOConfig) -> dict[str, int]:
    """GPUs of each kind `config` places: the actor's ranks, a critic's own ranks (PPO, not
    colocated), and in the pipeline modes the rollout ranks (`pipeline.rollout_dp`, else
    as many as the actor's) times vLLM's tensor-parallel size; a reward model's own pool."""
    p, q = config.placement, config.pipeline
    out = {"policy": p.actor_dp}
    if config.algo.uses_critic and not p.colocate_critic:
        out["critic"] = p.critic_dp
    if config.reward_model.enabled and reward_model_gpu(config) == "reward_model":
        out["reward_model"] = config.reward_model.dp
    if p.reference == "pool":
        out["reference"] = p.reference_dp
    if q.mode != "sync":
        tp = config.rollout.tensor_parallel_size if config.rollout.engine == "vllm" else 1
        out["rollout"] = (q.rollout_dp or p.actor_dp) * tp
    return out


def sleep_level(*, serves_adapters: bool, trainer_peak: int, base_bytes: int,
                gpu_bytes: int) -> int:
    """The level a hybrid engine sleeps at while the trainer runs (see `SLEEP_*`).

    An engine sent whole weights at every sync drops them (2): the sync reloads them anyway.
    An engine served LoRA adapters keeps its base model, which never changes: resident (0)
    where the trainer's largest phase plus the base (`base_bytes`) leaves `RESIDENT_HEADROOM`
    of the GPU free, else offloaded to pinned host memory and back every step (1: about
    2 x 15 GB over PCIe per step at 7B).

    Example (the base of 15 GiB beside a 40 GiB trainer on 80 GiB stays; on 48 GiB it moves):
        >>> sleep_level(serves_adapters=True, trainer_peak=40 * GiB, base_bytes=15 * GiB,
        ...             gpu_bytes=80 * GiB), sleep_level(serves_adapters=True,
        ...             trainer_peak=40 * GiB, base_bytes=15 * GiB, gpu_bytes=48 * GiB)
        (0, 1)
    """
    if not serves_adapters:
        return SLEEP_DROP
    if trainer_peak + base_bytes <= (1 - RESIDENT_HEADROOM) * gpu_bytes:
        return SLEEP_KV_ONLY
    return SLEEP_OFFLOAD


def serves_adapters(config: PPOConfig) -> bool:
    """Whether a hybrid engine is served the actor's LoRA adapters rather than weights (vLLM,
    `lora.sync=adapter`, sync mode): `roles.adapter_sync.serves_adapters`, in sync mode."""
    lo = config.lora
    return (lo.enabled and lo.sync == "adapter" and config.rollout.engine == "vllm"
            and config.pipeline.mode == "sync")


def _state_parts(shape: ModelShape, params: int, trained: int, dp: int, cd: int, *,
                 fsdp: bool, offload: bool) -> dict[str, int]:
    """A trained model's resident state on its GPU: masters (`params`, frozen ones
    included), gathered copies, AdamW over the `trained` ones."""
    gathered = cd * (2 * shape.layer_params + shape.root_params) if fsdp else 0
    masters = 0 if offload else 4 * math.ceil(params / dp)
    return {"params": masters + gathered,
            "optim": 0 if offload else 8 * math.ceil(trained / dp)}


def _engine_part(config: PPOConfig, policy: ModelShape, w: Workload, cd: int, gpu_bytes: int,
                 *, colocated: bool, notes: list[str]) -> dict[str, int]:
    """A rollout engine's bytes while it generates: vLLM's share of the GPU (at least its
    weights and one sequence's KV cache), or the torch engine's weights, KV cache and logits."""
    weights = cd * policy.params
    if config.rollout.engine == "vllm":
        share = gpu_memory_share(config.rollout, colocated=colocated)
        kv_need = cd * 2 * policy.layers * policy.kv_width * w.gen_len
        if share * gpu_bytes < weights + kv_need:
            notes.append(f"vLLM's share ({share:.2f} x GPU) is below its weights plus one "
                         f"sequence's KV cache: counted at that minimum")
        # vLLM takes its share, and cannot start below its weights + one sequence's KV cache.
        return {"engine": max(int(share * gpu_bytes), weights + kv_need)}
    kv = cd * 2 * policy.layers * policy.kv_width * w.gen_rows * w.gen_len
    logits = w.gen_rows * policy.vocab * 4 * 3  # the step's logits: float, scaled, probs
    prefill = policy.heads * w.gen_rows * config.rollout.max_prompt_tokens ** 2 * 4 * 2
    return {"engine": weights, "kv": kv + logits + prefill}


def estimate(config: PPOConfig, *, gpu_bytes: int = 80 * GiB, vocab: int | None = None,
             workload: Workload | None = None, runtime: int | None = None) -> Estimate:
    """Per-phase, per-GPU peak bytes of `config` (see the module docstring). `gpu_bytes`
    sizes vLLM's share; `vocab` a tiny model's vocabulary; `workload` replaces
    `workload_of`'s worst case; `runtime` the per-GPU allowance (default: `CUDA_RUNTIME`
    on cuda, 0 on cpu)."""
    policy, critic = shapes_of(config, vocab=vocab)
    w = workload or workload_of(config)
    m, a, p, mem = config.model, config.algo, config.placement, config.memory
    cd = 2 if m.dtype == "bfloat16" else 4
    kernel = attention_kernel(config)
    ckpt = config.checkpoints_activations
    offload = mem.cpu_offload
    pipeline = config.pipeline.mode != "sync"
    fsdp = p.actor_dp > 1 or cd != 4 or offload  # FSDP2 wraps the model (`fsdp.shard_model`)
    rt = (CUDA_RUNTIME if p.device == "cuda" else 0) if runtime is None else runtime
    notes: list[str] = []
    adapters = adapter_params(policy, config.lora)
    total = policy.params + adapters  # masters: the frozen base and the adapters
    trained = adapters if config.lora.enabled else total

    actor = _state_parts(policy, total, trained, p.actor_dp, cd, fsdp=fsdp, offload=offload)
    # Outside a forward every FSDP unit is resharded: the masters alone (sync reshards first).
    masters_only = {"params": 0 if offload else 4 * math.ceil(total / p.actor_dp)}
    # LoRA: the actor, adapters off; a reference pool: none on the policy's GPUs.
    has_ref = a.kl_coef > 0 and not config.lora.enabled and p.reference == "policy"
    ref = cd * math.ceil(policy.params / p.actor_dp) if has_ref and not offload else 0
    colocated_critic = critic is not None and p.colocate_critic
    critic_state = _state_parts(critic, critic.critic_params, critic.critic_params,
                                p.critic_dp, cd, fsdp=p.critic_dp > 1 or cd != 4 or offload,
                                offload=offload) if critic is not None else {}
    resident_critic = sum(critic_state.values()) if colocated_critic else 0
    base = {"runtime": rt, "ref": ref, "critic": resident_critic}

    phases: list[Phase] = []
    engine_weights = cd * policy.params
    engine_part = _engine_part(config, policy, w, cd, gpu_bytes, colocated=not pipeline,
                               notes=notes)
    # Setup: what `TrainedWorker.setup` holds while it builds and shards (`memory_setup.py`).
    setup_engine = 0 if pipeline else engine_part["engine"]
    phases.append(Phase(name="setup", gpu="policy", parts={
        "runtime": rt, "critic": resident_critic,
        **setup_parts(config, policy, params=total, dp=p.actor_dp, sharded=fsdp, cd=cd,
                      reference=has_ref, engine=setup_engine)}))
    if not pipeline:  # generation: the engine awake, the masters and AdamW resident beside it
        phases.append(Phase(name="generate", gpu="policy", parts={
            **base, **masters_only, "optim": actor["optim"], **engine_part}))
    trainer: list[Phase] = []  # the phases the trainer runs while the engine sleeps
    lp = logit_bytes(policy, w, mem.logprob_chunk, grad=False, entropy=True)
    fwd = forward_bytes(policy, w, config, cd, grad=False, checkpointing=ckpt, kernel=kernel,
                        logits=lp)
    trainer.append(Phase(name="old log-probs", gpu="policy", parts={
        **base, **actor, "activ": fwd, "logits": lp}))
    if a.kl_coef > 0:
        rlp = logit_bytes(policy, w, mem.logprob_chunk, grad=False, entropy=False)
        # A sharded (or offloaded) reference gathers its units as the actor does.
        gathered = cd * (2 * policy.layer_params + policy.root_params) if (
            has_ref and (p.actor_dp > 1 or offload)) else 0
        activ = forward_bytes(policy, w, config, cd, grad=False, checkpointing=ckpt,
                              kernel=kernel, logits=rlp)
        if p.reference == "pool":  # a whole copy per rank (`roles/reference.py`), alone
            trainer.append(Phase(name="ref log-probs", gpu="reference", parts={
                "runtime": rt, "ref": cd * policy.params, "activ": activ, "logits": rlp}))
        else:
            trainer.append(Phase(name="ref log-probs", gpu="policy", parts={
                **base, **actor, "ref": ref + gathered, "activ": activ, "logits": rlp}))
    ulp = logit_bytes(policy, w, mem.logprob_chunk, grad=True, entropy=a.entropy_coef > 0)
    bwd = forward_bytes(policy, w, config, cd, grad=True, checkpointing=ckpt, kernel=kernel,
                        logits=ulp)
    grads = 0 if offload else 4 * math.ceil(trained / p.actor_dp)
    if fsdp:  # an unsharded layer's gradient (LoRA: its adapters')
        grads += cd * (adapters // policy.layers if config.lora.enabled else policy.layer_params)
    trainer.append(Phase(name="actor update", gpu="policy", parts={
        **base, **actor, "grads": grads, "activ": bwd, "logits": ulp}))
    if critic is not None:
        trainer += _critic_phases(config, critic, critic_state, actor, base, w, cd, kernel,
                                  colocated=colocated_critic)
    # A LoRA engine keeps its base between steps: resident where the trainer leaves room.
    adapters_served = serves_adapters(config)
    level = sleep_level(serves_adapters=adapters_served, gpu_bytes=gpu_bytes,
                        trainer_peak=max(ph.peak for ph in trainer if ph.gpu == "policy"),
                        base_bytes=engine_weights)
    if level == SLEEP_KV_ONLY:
        trainer = [Phase(name=ph.name, gpu=ph.gpu, parts={**ph.parts, "engine": engine_weights})
                   if ph.gpu == "policy" else ph for ph in trainer]
    rm = reward_model_memory(config, w.gen_len)
    if rm is not None:  # its phase runs before the trainer's (its weights: below)
        beside = {"policy": {**base, **masters_only, "optim": actor["optim"]},
                  "critic": {"runtime": rt, **critic_state}}.get(rm.gpu, {"runtime": rt})
        phases.append(Phase(name="reward model", gpu=rm.gpu, parts={
            **beside, "rm": rm.weights, "activ": rm.activations}))
        notes.append(f"reward model ({config.reward_model.placement}): "
                     f"{rm.shape.critic_params / 1e6:.2f}M parameters, "
                     f"{rm.weights / (1 << 20):.1f} MiB on each {rm.gpu} rank; a forward "
                     f"of {config.reward_model.micro_batch_tokens} tokens")
    phases += trainer
    if pipeline:  # rank 0 posts the weights to the rollout pool; the rollout GPU receives
        phases.append(Phase(name="weight push (rank 0)", gpu="policy", parts={
            **base, **masters_only, "optim": actor["optim"], **push_parts(policy, cd=cd)}))
        phases += [Phase(name=name, gpu="rollout", parts=parts) for name, parts in
                   rollout_phases(engine_part, runtime=rt,
                                  vllm=config.rollout.engine == "vllm",
                                  received=receive_bytes(policy, cd=cd))]
    else:
        sync = max(BUCKET_BYTES, 2 * cd * policy.largest_module)
        phases.append(Phase(name="weight sync", gpu="policy", parts={
            **base, **masters_only, "optim": actor["optim"], "engine": engine_weights,
            "sync": sync}))
    host, transfer = 0, 0
    if offload:
        host = 4 * math.ceil(total / p.actor_dp) + 12 * math.ceil(trained / p.actor_dp)
        notes.append("memory.cpu_offload: fp32 masters, gradients and AdamW state in host "
                     f"memory ({host / GiB:.1f} GiB per rank); setup moves one FSDP unit at "
                     f"a time to the GPU")
    if adapters_served:
        how = ("kept resident (sleep level 0: only the KV cache is released)"
               if level == SLEEP_KV_ONLY else "offloaded to pinned host memory at each "
               "sleep (level 1)")
        if level == SLEEP_OFFLOAD:
            host += engine_weights
            transfer = 2 * engine_weights
            how += (f": {engine_weights / GiB:.1f} GiB of host memory, "
                    f"{transfer / GiB:.1f} GiB host <-> GPU per step")
        notes.append(f"LoRA (lora.sync=adapter): the engine's base model is {how}")
    if config.lora.enabled:
        notes.append(f"LoRA rank {config.lora.rank}: {adapters / 1e6:.1f}M adapter "
                     f"parameters train (gradients and AdamW for them only)")
    if kernel in ("sdpa", PACKED_SDPA) and p.device == "cuda":
        notes.append(f"attention: {kernel} assumed (flash-attn is not installed here; with "
                     f"it, memory.attention=auto runs flash_attention_2: less)")
    if rm is not None:  # resident on its GPU in every phase: nothing offloads it
        phases = [Phase(name=ph.name, gpu=ph.gpu, parts={**ph.parts, "rm": rm.weights})
                  if ph.gpu == rm.gpu else ph for ph in phases]
    return Estimate(phases=tuple(_ordered(ph) for ph in phases), policy=policy, critic=critic,
                    workload=w, attention=kernel, notes=tuple(notes), host_bytes=host,
                    adapters=adapters, sleep_level=level, sleep_transfer_bytes=transfer,
                    gpus=layout_gpus(config))


def _critic_phases(config: PPOConfig, critic: ModelShape, critic_state: dict[str, int],
                   actor: dict[str, int], base: dict[str, int], w: Workload, cd: int,
                   kernel: str, *, colocated: bool) -> list[Phase]:
    """The critic's values and update passes, on the policy's GPU (colocated: the actor's
    state stays beside it) or on its own."""
    p, ckpt = config.placement, config.checkpoints_activations
    # The values come from a one-output head: no log-prob head rows to gather.
    cw = Workload(rows=w.rows, tokens=w.tokens, longest=w.longest, response_tokens=0,
                  gen_rows=0, gen_len=w.gen_len)
    gpu = "policy" if colocated else "critic"
    cbase = {**base, "critic": 0}
    if colocated:  # the actor's state stays on the GPU the critic shares
        cbase = {**cbase, "params": actor["params"], "optim": actor["optim"]}
    cparams = critic_state["params"] + cbase.pop("params", 0)
    coptim = critic_state["optim"] + cbase.pop("optim", 0)
    cgrads = 0 if config.memory.cpu_offload else 4 * math.ceil(critic.critic_params
                                                               / p.critic_dp)
    return [
        Phase(name="critic values", gpu=gpu, parts={
            **cbase, "params": cparams, "optim": coptim,
            "activ": forward_bytes(critic, cw, config, cd, grad=False, checkpointing=ckpt,
                                   kernel=kernel, logits=0)}),
        Phase(name="critic update", gpu=gpu, parts={
            **cbase, "params": cparams, "optim": coptim, "grads": cgrads,
            "activ": forward_bytes(critic, cw, config, cd, grad=True, checkpointing=ckpt,
                                   kernel=kernel, logits=0)})]


def _ordered(phase: Phase) -> Phase:
    """The phase with every component present (0 where absent), in `COMPONENTS` order."""
    return Phase(name=phase.name, gpu=phase.gpu,
                 parts={c: int(phase.parts.get(c, 0)) for c in COMPONENTS})
