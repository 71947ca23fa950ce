"""Chapter 5 — the rollout engine on one rank: build it, load weights into it, generate.

Two kinds of worker hold an engine: the policy (`policy.py`, the hybrid engine: the engine
shares a process with the actor) and, in chapter 6's disaggregated pipeline, a rollout worker
in a pool of its own (`avrid.pipeline.rollout`). Both build, feed and call their engine
through these functions, so the same seed and weights give the same samples wherever the
engine lives — which is what lets a K = 0 pipeline reproduce the synchronous run exactly.

    build_engine     TorchEngine (a copy of the model, in `model.dtype`) or VllmEngine
    generate_shard   one response per prompt of a shard, as a chapter 3 `WorkerResult`
    close_engine     stop the engine and remove its scratch directory

Not here: when weights move (the workers and the driver decide), and the log-probs the
trainer recomputes (`forward.py`).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from typing import Any

import torch

from avrid.dispatch import Packed, Shard
from avrid.ppo.engines.models import ATTN_IMPLEMENTATION
from avrid.ppo.engines.torch_engine import OnFinish, SamplingParams, TorchEngine
from avrid.ppo.roles import fsdp
from avrid.ppo.roles.adapter_sync import serves_adapters
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.rollout import gpu_memory_share
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import WorkerIdentity

GENERATE_WRITES = ("rollout_logp", "truncated")
"""The columns `generate_shard` adds besides packed "response", which the driver joins to the
prompt's "tokens" (`columns.with_responses`): the rows then hold whole sequences."""


def build_engine(config: PPOConfig, model: torch.nn.Module, *, rank: int, pad_id: int,
                 max_response: int, colocated: bool = True) -> tuple[Any, str | None]:
    """(engine, scratch directory or None) for `config.rollout.engine`, on the run's device
    (`placement.device`). The torch engine gets its own copy of `model` (an fp32 model, on any
    device) cast to `model.dtype`; vLLM only reads the model's config (see `_vllm_engine`).

    `colocated`: the engine shares its GPU with a trainer (the hybrid engine: vLLM's sleep
    mode on, a smaller memory share) or has one of its own (chapter 6's rollout pool: it
    never sleeps and may take most of the GPU)."""
    if config.rollout.engine == "vllm":
        return _vllm_engine(config, model, rank=rank, max_response=max_response,
                            colocated=colocated)
    dtype = getattr(torch, config.model.dtype)
    # A copy: the policy's FSDP2 will shard its own model in place.
    engine_model = fsdp.cast_parameters(copy.deepcopy(model), dtype).eval()
    # The copy has the trainer's attention kernel, made for packed rows; the engine decodes
    # left-padded batches through a KV cache, with the kernel models are built with.
    engine_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return TorchEngine(engine_model.to(config.placement.device), pad_token_id=pad_id), None


def _vllm_engine(config: PPOConfig, model: torch.nn.Module, *, rank: int,
                 max_response: int, colocated: bool) -> tuple[Any, str]:
    """vLLM built from the model's config alone (``load_format="dummy"``: random weights):
    the owner loads the trained weights into it before anything is generated, so a fresh
    run, a resumed run and a checkpoint path all start from the weights being trained."""
    from avrid.ppo.engines.vllm_engine import VllmEngine  # vllm is imported only where used

    max_model_len = config.rollout.max_prompt_tokens + max_response
    hf_config = copy.deepcopy(model.config)
    # vLLM refuses a context longer than the declared maximum; this RoPE has no
    # length-dependent scaling, so raising the declared maximum changes no number.
    hf_config.max_position_embeddings = max(hf_config.max_position_embeddings, max_model_len)
    engine_dir = tempfile.mkdtemp(prefix=f"avrid-vllm-{rank}-")
    hf_config.save_pretrained(engine_dir)
    mib = config.rollout.vllm_kv_cache_mib
    engine = VllmEngine(engine_dir, load_format="dummy", dtype=config.model.dtype,
                        seed=config.train.seed, max_model_len=max_model_len,
                        gpu_memory_utilization=gpu_memory_share(config.rollout,
                                                                colocated=colocated),
                        # A GPU of its own: nothing to hand over, so no sleep mode (its
                        # allocator costs memory and every sleep a round trip).
                        enable_sleep_mode=None if colocated else False,
                        seed_mode=config.rollout.seed_mode,
                        kv_cache_bytes=None if mib is None else mib << 20,
                        # LoRA kernels only where the adapters themselves are served.
                        lora_rank=config.lora.rank if serves_adapters(config) else 0)
    return engine, engine_dir


def generate_shard(engine: Any, shard: Shard, identity: WorkerIdentity, config: PPOConfig, *,
                   stop_ids: tuple[int, ...], max_response: int, max_new_tokens: int,
                   greedy: bool, seed: int, scalars: dict[str, int] | None = None,
                   on_finish: OnFinish | None = None) -> WorkerResult:
    """Sample one response per prompt of the shard (the rows' "tokens" are prompts).
    Outputs: packed "response" token ids and "rollout_logp" (sampled-token log-probs), the
    per-sample scalar "truncated" (1 where the response hit `max_new_tokens` without a stop
    token: finish reason "length") and each of `scalars` (a constant stamped on every
    sample, e.g. chapter 6's weight "version"). `max_response` is the budget the engine's
    context was sized for: a larger `max_new_tokens` is refused. `on_finish(i, c)`: told of
    row i's completion as soon as it is final (`streaming.py`'s reward stream)."""
    if max_new_tokens > max_response:
        raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the run's response budget "
                         f"of {max_response} tokens")
    builder = ResultBuilder.for_shard(identity, shard)
    batch = shard.batch
    prompts = [batch.packed["tokens"].row(i).tolist() for i in range(len(batch))]
    r = config.rollout
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=greedy,
                            temperature=1.0 if greedy else r.temperature,
                            top_k=0 if greedy else r.top_k, top_p=1.0 if greedy else r.top_p,
                            stop_token_ids=stop_ids,
                            seed=seed + identity.rank)  # one stream per rank
    # The engine must be awake: its owner orders the hand-over (`handoff.py`).
    with builder.span("generate"):
        if not prompts:
            done = []
        elif on_finish is None:  # an engine that takes no `on_finish` (a test's) still runs
            done = engine.generate(prompts, params)
        else:
            done = engine.generate(prompts, params, on_finish)
    lengths = [len(c.token_ids) for c in done]
    truncated = torch.tensor([c.finish_reason == "length" for c in done], dtype=torch.int64)
    stamped = {name: torch.full((len(done),), value, dtype=torch.int64)
               for name, value in (scalars or {}).items()}
    builder.add(batch.sample_ids, packed={
        "response": Packed.from_rows([torch.tensor(c.token_ids, dtype=torch.int64)
                                      for c in done]),
        "rollout_logp": Packed.from_rows([torch.tensor(c.logprobs, dtype=torch.float32)
                                          for c in done])},
        scalars={"truncated": truncated, **stamped})
    builder.metric("rollout/response_len", torch.tensor(lengths, dtype=torch.float64),
                   "mean_samples")
    builder.metric("rollout/truncation_rate", truncated.to(torch.float64), "mean_samples")
    builder.metric("rollout/tokens", float(sum(lengths)), "sum")
    return builder.build()


def close_engine(engine: Any, engine_dir: str | None) -> None:
    """Stop the engine (vLLM's has processes and memory to free) and remove its directory."""
    try:
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    finally:
        if engine_dir is not None:
            shutil.rmtree(engine_dir, ignore_errors=True)
