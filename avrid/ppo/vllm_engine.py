"""Chapter 5 — vLLM as a rollout engine (GPU only), behind the same `RolloutEngine` protocol.

`VllmEngine` wraps a ``vllm.LLM`` so the PPO loop can swap it for `rollout.TorchEngine`
without noticing: token ids in, token ids and log-probs out, `load_weights` after each
optimizer step (through chapter 4's `VllmSink` and `AvridWorkerExtension`), and vLLM's sleep
mode to hand the GPU to a colocated trainer.

Three choices make its log-probs mean what the trainer's mean (`logprobs.logprobs_from_logits`):

- ``logprobs_mode="processed_logprobs"``: vLLM's default (raw) log-probs come from the logits
  BEFORE temperature; processed ones are after it, i.e. log softmax(logits / T), ours.
- With ``top_k > 0`` vLLM's processed log-probs are renormalised over the top-k support: they
  exceed ours by -log(mass of the top k) >= 0. We do not correct this (the mass is not
  returned); keep top_k off for PPO with vLLM, or expect that offset in `rollout/logprob_gap`.
- ``ignore_eos=True``: vLLM would otherwise also stop at the checkpoint's EOS ids from its
  generation config; here, as in `TorchEngine`, only `stop_token_ids` stop a row (put EOS in).

Not here: tokenization (``skip_tokenizer_init=True``; prompts are token ids), async or
server engines, sliced TP loading (use `VllmSink` with a layout directly). vllm is imported
only inside `VllmEngine`, so this module imports fine without it; the tests are marked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from avrid.ppo.rollout import Completion, SamplingParams
from avrid.reshard.engines import VLLM_EXTENSION, VllmSink

_SLEEP_TAGS = ("weights", "kv_cache")


def request_seed(seed: int, index: int) -> int:
    """A per-request vLLM seed: vLLM seeds every request on its own, so one seed for the
    whole batch would give identical samples for identical prompts (GRPO's groups!). Mixed
    by a hash, not `seed + index`, so step s's request i+1 is not step s+1's request i.

    >>> request_seed(0, 1) == request_seed(0, 1), request_seed(0, 1) == request_seed(1, 0)
    (True, False)
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    # 31 bits: non-negative and small enough for any seed tensor a sampler keeps.
    return int.from_bytes(digest, "little") >> 33


class VllmEngine:
    """A ``vllm.LLM`` over a local checkpoint as a rollout engine (needs a CUDA GPU).

    Usage (GPU)::

        engine = VllmEngine("/ckpt/qwen2.5-0.5b", max_model_len=1024, seed=0)
        done = engine.generate([[151644, 872, 198]], SamplingParams(max_new_tokens=64))
        engine.sleep()                      # trainer step on the freed GPU memory
        engine.wake(tags=["weights"])       # weights back first ...
        engine.load_weights(policy.named_parameters())
        engine.wake()                       # ... then the KV cache
    """

    def __init__(self, model_path: str, *, max_model_len: int, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = True,
                 tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                 enforce_eager: bool = False, **llm_kwargs: Any) -> None:
        from vllm import LLM

        self.enable_sleep_mode = enable_sleep_mode
        self.llm = LLM(
            model=model_path, max_model_len=max_model_len, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
            tensor_parallel_size=tensor_parallel_size, dtype=dtype, enforce_eager=enforce_eager,
            worker_extension_cls=VLLM_EXTENSION,  # chapter 4's load/checksum RPCs
            logprobs_mode="processed_logprobs",  # after temperature: see the module docstring
            skip_tokenizer_init=llm_kwargs.pop("skip_tokenizer_init", True),
            **llm_kwargs)
        # The sink also exposes `checksums(layout)` for the driver's stale-weight check.
        self.sink = VllmSink(self.llm)
        self._asleep: set[str] = set()

    def _vllm_params(self, params: SamplingParams, index: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1, max_tokens=params.max_new_tokens,
            # vLLM's greedy is temperature 0; it then reports log-probs at T = 1, which is why
            # our SamplingParams pins greedy's temperature to 1.0.
            temperature=0.0 if params.greedy else params.temperature,
            top_k=params.top_k,  # 0 = off, as ours (older vLLMs wanted -1)
            seed=None if params.greedy else request_seed(params.seed, index),
            logprobs=0,  # just the sampled token's
            stop_token_ids=list(params.stop_token_ids), ignore_eos=True, detokenize=False)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order; vLLM batches and schedules them itself."""
        from vllm import TokensPrompt

        if self._asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self._asleep)}): wake() first")
        if not prompts:
            return []
        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        sampling = [self._vllm_params(params, i) for i in range(len(prompts))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        return [_completion(out.outputs[0]) for out in outputs]

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors by HF name into every worker (vLLM fuses and shards them), then a
        prefix-cache reset: KV blocks computed with the old weights must not be reused."""
        if "weights" in self._asleep:
            raise RuntimeError("the weights are asleep: wake(tags=['weights']) before loading")
        self.sink.load(dict(named))
        self.sink.finish()

    def sleep(self) -> None:
        """Level 1: weights offloaded to host memory, KV cache dropped (and the prefix cache
        with it). A no-op without ``enable_sleep_mode``."""
        if not self.enable_sleep_mode or self._asleep:
            return
        self.llm.sleep(level=1)
        self._asleep = set(_SLEEP_TAGS)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Restore `tags` (default: weights, then the KV cache). Wake the weights alone to
        load new ones before the KV cache takes its memory back."""
        wanted = list(_SLEEP_TAGS) if tags is None else list(tags)
        unknown = set(wanted) - set(_SLEEP_TAGS)
        if unknown:
            raise ValueError(f"unknown wake tags {sorted(unknown)}; known: {_SLEEP_TAGS}")
        for tag in wanted:  # one at a time, in this order: weights before the KV cache
            if tag in self._asleep:
                self.llm.wake_up(tags=[tag])
                self._asleep.discard(tag)

    def close(self) -> None:
        """Stop the engine and free its GPU memory now rather than at garbage collection
        (`del` alone leaves the engine core alive while anything still refers to it)."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
        else:  # vLLM versions without LLM.shutdown()
            llm.llm_engine.engine_core.shutdown()


def _completion(out: Any) -> Completion:
    """A vLLM ``CompletionOutput`` as our `Completion` (sampled-token log-probs picked out)."""
    if out.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {out.finish_reason!r}")
    ids = tuple(int(t) for t in out.token_ids)
    if out.logprobs is None or len(out.logprobs) != len(ids):
        raise RuntimeError("vLLM returned no log-prob per token: was logprobs=0 dropped?")
    logprobs = tuple(float(out.logprobs[i][t].logprob) for i, t in enumerate(ids))
    return Completion(token_ids=ids, logprobs=logprobs, finish_reason=out.finish_reason)
