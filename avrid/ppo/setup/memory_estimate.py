"""Chapter 5 — the memory a config needs, per GPU and per phase, predicted before launch.

`avrid ppo --estimate-memory` calls `estimate(config)`: from the model's shape
(`memory_shapes.py`) and the config's sizes it adds up, for every phase of a step, the bytes
one rank holds at that phase's peak, by component:

    params   fp32 master weights (1/dp each under FSDP2) + the gathered compute copies
             (two layers: FSDP2 prefetches the next, and the root unit — embedding, head —
             stays gathered while the model runs); GPU: one layer and the root with cpu_offload
    grads    fp32 gradients (1/dp), during an update only (set_to_none after the step)
    optim    AdamW's two fp32 moments (1/dp), from the first step on; host with cpu_offload
    activ    saved activations: per decoder layer per token (`ACT_*`), or with
             train.gradient_checkpointing each layer's input plus one layer recomputed; no grad:
             the hidden states every layer returns (output_hidden_states) and one layer's work;
             plus the attention mask / scores of the attention kernel
    logits   `memory.logprob_chunk` positions x vocab, a few fp32 copies (`LOGIT_COPIES_*`:
             chunked_logprobs), never tokens x vocab
    ref      the frozen reference in model.dtype (kl_coef > 0), 1/actor_dp
    critic   a colocated critic's state (placement.colocate_critic, PPO) on the policy's GPU
    engine   rollout engine weights (model.dtype); vLLM: its gpu_memory_utilization share of
             the GPU (weights + KV cache) while it generates
    kv       the torch engine's KV cache and sampling logits for one generate batch
    sync     weight-sync buffers: a load group of at most half a bucket (BUCKET_BYTES) whole,
             plus its receive buffers; the largest module alone if it is bigger
    runtime  the CUDA context and allocator slack of a GPU process (`CUDA_RUNTIME`; 0 on CPU)

The micro-batch is the worst one the config allows (`workload_of`): packed, its
`train.micro_batch_tokens` real tokens; padded, n rows of the longest sequence (n: the budget
over half the longest). A benchmark that knows its batch passes its own `Workload`.

The per-token coefficients were counted from the Qwen2 layer's saved tensors and checked on
CPU (benchmarks/memory_estimate.py: three configs within 20% of the measured peak).

Not here: shapes (`memory_shapes.py`), printing (`memory_report.py`), running anything.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.memory_shapes import ModelShape, shapes_of
from avrid.ppo.setup.rollout import gpu_memory_share

GiB = 1 << 30
BUCKET_BYTES = 64 << 20
"""`roles.weight_sync.BUCKET_BYTES` (a test keeps them equal; setup may not import roles)."""
TORCH_ENGINE_BATCH = 256
"""`TorchEngine`'s prompts per generate batch (its `batch_size` default)."""
DEFAULT_MAX_RESPONSE = 256
"""The response budget assumed when `rollout.max_response_tokens` is None (the task's hint
is not read: reading a task may need its data file)."""
CUDA_RUNTIME = 1 * GiB
"""A CUDA process's context, cuBLAS/NCCL workspaces and allocator slack (not measured here:
an allowance)."""
ACT_H, ACT_KV, ACT_I = 9, 6, 4
"""Saved activations of one decoder layer, per token, in units of (width x compute dtype):
two RMSNorms (input, normalised: 2H each), q, k, v and their rotary halves, the attention
output and o_proj's input (~9 H + 6 kv), the MLP's gate, SiLU, up and product (4 I)."""
RECOMPUTE_H, RECOMPUTE_I = 2, 2
"""Backward's transient gradients of one layer's activations (H- and I-wide), on top of
what it saved: with checkpointing, the recomputed layer's working set."""
NOGRAD_H, NOGRAD_I = 4, 2
"""A no-grad forward's working set inside one layer (the MLP's gate and up alive at once)."""
LOGIT_COPIES_FWD, LOGIT_COPIES_ENTROPY, LOGIT_COPIES_BWD = 3, 1, 4
"""fp32 (chunk x vocab) copies alive in `chunked_logprobs`: logits, scaled, the logsumexp
temporary; +2 with the entropy (log_softmax, its exp); backward's recomputation + gradients."""

COMPONENTS = ("params", "grads", "optim", "activ", "logits", "ref", "critic", "engine", "kv",
              "sync", "runtime")


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """The sizes of the largest micro-batch and generate batch one rank runs."""

    rows: int
    """Sequences in the micro-batch."""
    tokens: int
    """Tokens its forward computes (packed: the real ones; padded: rows x longest)."""
    longest: int
    """Its longest sequence (a padded row's length; attention's L)."""
    response_tokens: int
    """Response positions in it (where log-probs are taken)."""
    gen_rows: int
    """Prompts one generate call of one rank's engine holds."""
    gen_len: int
    """Prompt + response budget of a generated sequence."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """One phase of a step on one GPU: its components' bytes at the phase's peak."""

    name: str
    gpu: str
    """Which GPU of the layout: "policy" (actor + reference + engine) or "critic"."""
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
    """Per rank host memory the offloaded state takes (memory.cpu_offload), else 0."""

    def peak(self, gpu: str | None = None) -> int:
        """The largest phase peak (of one GPU kind, or of all)."""
        return max(p.peak for p in self.phases if gpu is None or p.gpu == gpu)


def response_budget(config: PPOConfig) -> int:
    """`rollout.max_response_tokens`, or `DEFAULT_MAX_RESPONSE` where it is None."""
    return config.rollout.max_response_tokens or DEFAULT_MAX_RESPONSE


def workload_of(config: PPOConfig) -> Workload:
    """The worst micro-batch and generate batch `config` lets one actor rank run."""
    t, dp = config.train, config.placement.actor_dp
    response = response_budget(config)
    seq = config.rollout.max_prompt_tokens + response
    step_seqs = t.prompts_per_step * config.algo.responses_per_prompt
    rank_seqs = max(1, math.ceil(min(t.mini_batch_size, step_seqs) / dp))
    if config.memory.pack_sequences:  # the real tokens; rows of half the longest on average
        tokens = min(t.micro_batch_tokens, rank_seqs * seq)
        rows = max(1, min(rank_seqs, tokens // max(1, seq // 2)))
        resp = max(1, tokens * response // seq)
    else:  # right-padded: n rows of the longest, n = the budget over a half-length sequence
        rows = max(1, min(rank_seqs, t.micro_batch_tokens // max(1, seq // 2)))
        tokens, resp = rows * seq, rows * response
    gen_seqs = max(1, math.ceil(step_seqs / dp))
    gen_rows = gen_seqs if config.rollout.engine == "vllm" else min(TORCH_ENGINE_BATCH,
                                                                     gen_seqs)
    return Workload(rows=rows, tokens=tokens, longest=min(seq, tokens), response_tokens=resp,
                    gen_rows=gen_rows, gen_len=seq)


PACKED_SDPA = "packed sdpa"
"""SDPA one sequence at a time over a packed row (`engines.packed_attention`)."""


def attention_kernel(config: PPOConfig) -> str:
    """The trained models' kernel, as `models.trainer_attention` picks it (without importing
    torch): flash-attn 2 for "auto" on CUDA where installed, in bf16 (flash-attn has no
    fp32); SDPA ("auto" or "sdpa") over packed rows is the per-sequence kernel; otherwise the
    choice itself."""
    choice, device = config.memory.attention, config.placement.device
    if (choice == "auto" and device == "cuda" and config.model.dtype == "bfloat16"
            and importlib.util.find_spec("flash_attn")):
        return "flash_attention_2"
    if choice in ("auto", "sdpa"):
        return PACKED_SDPA if config.memory.pack_sequences else "sdpa"
    return choice


def _attention_bytes(shape: ModelShape, w: Workload, kernel: str, cd: int, packed: bool, *,
                     grad: bool, layers_saved: int) -> int:
    """What attention adds beyond the per-token activations (`ACT_*` count q, k, v and the
    output once per token): the per-sequence kernel's (rows, heads, longest, dim) copies of
    q, k, v (GQA-expanded) and output; the mask of SDPA over padded rows; eager's score
    matrices (heads x L x L per row, saved by every layer that keeps activations)."""
    if kernel == "flash_attention_2":
        return 0
    slots = w.rows * w.longest  # the (rows x longest) grid a padded or gathered layout fills
    if kernel == PACKED_SDPA:
        extra = cd * max(0, 4 * slots * shape.hidden
                         - w.tokens * (2 * shape.hidden + 2 * shape.kv_width))
        return extra * (layers_saved if grad else 1)
    squares = w.tokens * w.tokens if packed else w.rows * w.longest * w.longest
    if kernel == "sdpa":
        return 4 * squares  # one float mask (measured: ~4 bytes per entry on CPU)
    per_layer = shape.heads * squares * 4  # softmax in fp32
    return per_layer * ((layers_saved if grad else 0) + 2)


def _layer_activation_bytes(shape: ModelShape, tokens: int, cd: int) -> int:
    return tokens * cd * (ACT_H * shape.hidden + ACT_KV * shape.kv_width
                          + ACT_I * shape.intermediate)


def _forward_bytes(shape: ModelShape, w: Workload, config: PPOConfig, cd: int, *,
                   grad: bool, checkpointing: bool, kernel: str, logits: int) -> int:
    """Activations of one micro-batch's forward (and backward, with `grad`), beyond the
    `logits` bytes of the head: the layers' transient working set and the head's logits never
    coexist (the head runs after the last layer, its backward before the first layer's), so
    only what the larger of the two exceeds the logits by is counted here."""
    h, i, n, layers = shape.hidden, shape.intermediate, w.tokens, shape.layers
    packed = config.memory.pack_sequences
    hidden_rows = w.response_tokens * h * cd * (2 if grad else 1)  # gathered for the head
    if not grad:
        kept = (layers + 1) * n * h * cd  # output_hidden_states: every layer's output
        work = n * cd * (NOGRAD_H * h + NOGRAD_I * i) + _attention_bytes(
            shape, w, kernel, cd, packed, grad=False, layers_saved=0)
        return kept + hidden_rows + max(0, work - logits)
    backward = n * cd * (RECOMPUTE_H * h + RECOMPUTE_I * i)
    if checkpointing:  # each layer's input; one layer recomputed at a time in backward
        saved = (layers + 1) * n * h * cd
        backward += _layer_activation_bytes(shape, n, cd) + _attention_bytes(
            shape, w, kernel, cd, packed, grad=True, layers_saved=1)
    else:
        saved = layers * _layer_activation_bytes(shape, n, cd) + n * h * cd + _attention_bytes(
            shape, w, kernel, cd, packed, grad=True, layers_saved=layers)
    return saved + hidden_rows + max(0, backward - logits)


def _logit_bytes(shape: ModelShape, w: Workload, chunk: int, *, grad: bool,
                 entropy: bool) -> int:
    rows = max(1, min(chunk, w.response_tokens))
    copies = LOGIT_COPIES_BWD if grad else LOGIT_COPIES_FWD
    copies += LOGIT_COPIES_ENTROPY if entropy else 0
    return rows * shape.vocab * 4 * copies


def _state_parts(shape: ModelShape, params: int, dp: int, cd: int, *, fsdp: bool,
                 offload: bool) -> dict[str, int]:
    """A trained model's resident state on its GPU: masters, gathered copies, optimizer."""
    gathered = cd * (2 * shape.layer_params + shape.root_params) if fsdp else 0
    masters = 0 if offload else 4 * math.ceil(params / dp)
    return {"params": masters + gathered,
            "optim": 0 if offload else 8 * math.ceil(params / dp)}


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
    fsdp = p.actor_dp > 1 or cd != 4 or offload  # FSDP2 wraps the model (`fsdp.shard_model`)
    rt = (CUDA_RUNTIME if p.device == "cuda" else 0) if runtime is None else runtime
    notes: list[str] = []

    actor = _state_parts(policy, policy.params, p.actor_dp, cd, fsdp=fsdp, offload=offload)
    # Outside a forward every FSDP unit is resharded: the masters alone (sync reshards first).
    masters_only = {"params": 0 if offload else 4 * math.ceil(policy.params / p.actor_dp)}
    ref = cd * math.ceil(policy.params / p.actor_dp) if a.kl_coef > 0 else 0
    colocated_critic = critic is not None and p.colocate_critic
    critic_state = _state_parts(critic, critic.critic_params, p.critic_dp, cd,
                                fsdp=p.critic_dp > 1 or cd != 4 or offload,
                                offload=offload) if critic is not None else {}
    resident_critic = sum(critic_state.values()) if colocated_critic else 0
    base = {"runtime": rt, "ref": ref, "critic": resident_critic}

    phases: list[Phase] = []
    vllm = config.rollout.engine == "vllm"
    engine_weights = cd * policy.params
    if vllm:
        share = gpu_memory_share(config.rollout, colocated=config.pipeline.mode == "sync")
        kv_need = cd * 2 * policy.layers * policy.kv_width * w.gen_len
        # vLLM takes its share, and cannot start below its weights + one sequence's KV cache.
        engine_part = {"engine": max(int(share * gpu_bytes), engine_weights + kv_need)}
        if share * gpu_bytes < engine_weights + kv_need:
            notes.append(f"vLLM's share ({share:.2f} x GPU) is below its weights plus one "
                         f"sequence's KV cache: counted at that minimum")
    else:
        kv = cd * 2 * policy.layers * policy.kv_width * w.gen_rows * w.gen_len
        logits = w.gen_rows * policy.vocab * 4 * 3  # the step's logits: float, scaled, probs
        prefill = policy.heads * w.gen_rows * config.rollout.max_prompt_tokens ** 2 * 4 * 2
        engine_part = {"engine": engine_weights, "kv": kv + logits + prefill}
    # Generation: the engine awake, the trainer's masters and AdamW resident beside it.
    phases.append(Phase(name="generate", gpu="policy", parts={
        **base, **masters_only, "optim": actor["optim"], **engine_part}))
    lp = _logit_bytes(policy, w, mem.logprob_chunk, grad=False, entropy=True)
    fwd = _forward_bytes(policy, w, config, cd, grad=False, checkpointing=ckpt, kernel=kernel,
                         logits=lp)
    phases.append(Phase(name="old log-probs", gpu="policy", parts={
        **base, **actor, "activ": fwd, "logits": lp}))
    if a.kl_coef > 0:
        rlp = _logit_bytes(policy, w, mem.logprob_chunk, grad=False, entropy=False)
        phases.append(Phase(name="ref log-probs", gpu="policy", parts={
            **base, **actor, "ref": ref + (cd * (2 * policy.layer_params + policy.root_params)
                                           if p.actor_dp > 1 else 0),
            "activ": _forward_bytes(policy, w, config, cd, grad=False, checkpointing=ckpt,
                                    kernel=kernel, logits=rlp), "logits": rlp}))
    ulp = _logit_bytes(policy, w, mem.logprob_chunk, grad=True, entropy=a.entropy_coef > 0)
    bwd = _forward_bytes(policy, w, config, cd, grad=True, checkpointing=ckpt, kernel=kernel,
                         logits=ulp)
    grads = 0 if offload else 4 * math.ceil(policy.params / p.actor_dp)
    grads += cd * policy.layer_params if fsdp else 0  # an unsharded layer's gradient
    phases.append(Phase(name="actor update", gpu="policy", parts={
        **base, **actor, "grads": grads, "activ": bwd, "logits": ulp}))
    if critic is not None:
        # The values come from a one-output head: no log-prob head rows to gather.
        cw = Workload(rows=w.rows, tokens=w.tokens, longest=w.longest, response_tokens=0,
                      gen_rows=0, gen_len=w.gen_len)
        gpu = "policy" if colocated_critic else "critic"
        cbase = {**base, "critic": 0}
        if colocated_critic:  # the actor's state stays on the GPU the critic shares
            cbase = {**cbase, "params": actor["params"], "optim": actor["optim"]}
        cparams = critic_state["params"] + cbase.pop("params", 0)
        coptim = critic_state["optim"] + cbase.pop("optim", 0)
        cgrads = (0 if offload else 4 * math.ceil(critic.critic_params / p.critic_dp))
        phases.append(Phase(name="critic values", gpu=gpu, parts={
            **cbase, "params": cparams, "optim": coptim,
            "activ": _forward_bytes(critic, cw, config, cd, grad=False, checkpointing=ckpt,
                                    kernel=kernel, logits=0)}))
        phases.append(Phase(name="critic update", gpu=gpu, parts={
            **cbase, "params": cparams, "optim": coptim, "grads": cgrads,
            "activ": _forward_bytes(critic, cw, config, cd, grad=True, checkpointing=ckpt,
                                    kernel=kernel, logits=0)}))
    sync = max(BUCKET_BYTES, 2 * cd * policy.largest_module)
    phases.append(Phase(name="weight sync", gpu="policy", parts={
        **base, **masters_only, "optim": actor["optim"], "engine": engine_weights,
        "sync": sync}))
    host = 0
    if offload:
        host = 16 * math.ceil(policy.params / p.actor_dp)
        notes.append("memory.cpu_offload: fp32 masters, gradients and AdamW state in host "
                     f"memory ({host / GiB:.1f} GiB per rank)")
    if kernel in ("sdpa", PACKED_SDPA) and p.device == "cuda":
        notes.append(f"attention: {kernel} assumed (flash-attn is not installed here; with "
                     f"it, memory.attention=auto runs flash_attention_2: less)")
    return Estimate(phases=tuple(_ordered(ph) for ph in phases), policy=policy, critic=critic,
                    workload=w, attention=kernel, notes=tuple(notes), host_bytes=host)


def _ordered(phase: Phase) -> Phase:
    """The phase with every component present (0 where absent), in `COMPONENTS` order."""
    return Phase(name=phase.name, gpu=phase.gpu,
                 parts={c: int(phase.parts.get(c, 0)) for c in COMPONENTS})
