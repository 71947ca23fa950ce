"""Chapter 5 — rollout engines: token ids in, sampled token ids and their log-probs out.

`RolloutEngine` is all the PPO loop asks of a generator: `generate` completions for prompts
(token-in/token-out: tokenizing is the caller's business), `load_weights` after each
optimizer step, and `sleep`/`wake` to hand accelerator memory to the trainer and back when
both share a GPU.

- `TorchEngine`: the transformers model itself with a hand-written sampling loop (prompt
  pass, then one token at a time through the KV cache). Slow, but every step is visible, and
  it runs on CPU: it is the engine of the tests and the reference for `vllm_engine.VllmEngine`.
  The KV cache comes out of each forward call and goes into the next under the name the
  installed transformers gives it: `cache` from 5.24, `past_key_values` before (5.24 still
  takes the old name, with a deprecation warning on every call, until 5.40).

What an engine's log-probs mean, for every engine (`VllmEngine` too): the log-probability
of the sampled token under the BEHAVIOUR policy, the distribution the engine really sampled
from — softmax(logits / T) after top-k and top-p have cut it to the kept tokens, renormalised
over them (`behaviour_logprobs`; vLLM's "processed" log-probs, with vLLM's order and boundary
rules). That is the mu an importance ratio pi / mu needs (chapter 6's `off_policy.py`).
Without top-k/top-p (the defaults) it is exactly what the actor recomputes in training: one
right-padded full-sequence pass, no cache (`columns.model_inputs`, then
`forward.response_logprobs`), over the full vocabulary. The tests pin that equality against
that very code, and the PPO loop logs the difference every step as `rollout/logprob_gap`;
with top-k or top-p on, the gap also holds the truncation's -log(mass kept) >= 0, by design:
the trainer's `old_logp` stays the full-vocabulary policy being trained.

Not here: tokenization, rewards, the vLLM engine (`vllm_engine`), batching across workers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from avrid.ppo.algo.logprobs import logprobs_from_logits
from avrid.ppo.engines.models import pad_left
from avrid.reshard.engines import TorchEngineSink

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample. `top_k=0` and `top_p=1.0` are off; `greedy` takes the argmax (and, like
    vLLM, no temperature: leave it at 1.0, the temperature its log-probs are reported at;
    top-k and top-p do not apply to it). With both on, top-k is applied first, then top-p
    within it (vLLM's order; see `behaviour_logits`).

    Example:
        >>> SamplingParams(max_new_tokens=8, temperature=0.7).top_k
        0
        >>> SamplingParams(max_new_tokens=0)
        Traceback (most recent call last):
        ...
        ValueError: max_new_tokens must be an int >= 1, got 0
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature > 0:  # also rejects NaN
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.greedy and self.temperature != 1.0:
            raise ValueError(f"temperature must stay 1.0 with greedy (argmax ignores it and "
                             f"vLLM reports greedy log-probs at 1.0), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a tuple, got {self.stop_token_ids!r}")

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cut the sampling distribution (never for greedy): then the
        behaviour policy's log-probs differ from the full-vocabulary ones."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """One generated continuation.

    `token_ids` include the stop token if one was sampled. `logprobs[i]` is the log-prob of
    `token_ids[i]` under the distribution it was sampled from (`behaviour_logprobs`):
    softmax(logits / temperature) over the full vocabulary when top-k and top-p are off (what
    the trainer recomputes), renormalised over the kept tokens when they are on.
    `finish_reason` is "stop" when the last token is a stop token (even if it was the last one
    allowed) and "length" when `max_new_tokens` ran out first: a truncated response, which
    the trainer carries as the sample's "truncated" column (see `algo.truncation`).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason


OnFinish = Callable[[int, Completion], None]
"""Told of each completion as it is final: (index of its prompt in the call, completion)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the PPO loop needs from a generator."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_finish: OnFinish | None = None) -> list[Completion]:
        """One completion per prompt (token ids), in the prompts' order; `on_finish(i, c)`
        (optional) is told of completion `c` of prompt `i` once it is final, at the latest
        before `generate` returns (`rollout.stream_rewards` scores it meanwhile)."""
        ...

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take full (unsharded) weights by HF parameter name."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory while the trainer runs on the same device: level 1 keeps
        a host copy of the weights, level 2 drops them (the owner reloads them on waking)."""
        ...

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Take memory back: "weights" (to load new ones into) and "kv_cache" (to generate);
        None: both, in that order."""
        ...


class TorchEngine:
    """A transformers causal LM as a rollout engine, with a hand-written sampling loop.

    The same `params.seed`, prompts, weights and `batch_size` give the same tokens.

    Example:
        >>> from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
        >>> engine = TorchEngine(build_tiny_policy(TinyModelSpec(vocab_size=16), seed=0),
        ...                      pad_token_id=0)
        >>> [c] = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
        >>> len(c.token_ids), len(c.logprobs), c.finish_reason
        (4, 4, 'length')
    """

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int,
                 batch_size: int = 256) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self._sink = TorchEngineSink(self.model)
        self._cache_arg = cache_argument(self.model)
        # While asleep: the level it sleeps at, and where its weights go back to.
        self._asleep_level: int | None = None
        self._awake_device: torch.device | None = None
        self._shapes: dict[str, torch.Size] = {}  # level 2: the shapes of the dropped weights

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_finish: OnFinish | None = None) -> list[Completion]:
        """Sample a completion for every prompt, `batch_size` prompts per batch. A row is
        final at the step it samples a stop token: `on_finish` hears of it then, while the
        rest of its batch decodes on (the rows that run to `max_new_tokens`, at the end).
        Telling changes nothing drawn: the batch still moves together."""
        if self._asleep_level is not None:
            raise RuntimeError(f"the engine is asleep (level {self._asleep_level}): wake() "
                               f"it{' and load weights' * (self._asleep_level == 2)} first")
        device = self.device
        gen = torch.Generator(device=device).manual_seed(params.seed)
        out: list[Completion] = []
        with torch.inference_mode():
            for start in range(0, len(prompts), self.batch_size):
                out += self._generate_batch(prompts[start:start + self.batch_size], params,
                                            gen, device, on_finish, start)
        return out

    def _generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                        gen: torch.Generator, device: torch.device,
                        on_finish: OnFinish | None = None, first: int = 0) -> list[Completion]:
        ids, mask, pos = (t.to(device) for t in pad_left(prompts, self.pad_token_id))
        b = ids.shape[0]
        stop = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
        tokens = torch.full((b, params.max_new_tokens), self.pad_token_id, dtype=torch.long,
                            device=device)
        logps = torch.zeros((b, params.max_new_tokens), dtype=torch.float32, device=device)
        length = torch.full((b,), params.max_new_tokens, dtype=torch.long, device=device)
        stopped = torch.zeros(b, dtype=torch.bool, device=device)
        # The prompt pass fills the cache; only the last column's logits are needed. The
        # cache comes out (and goes back in) under `cache_argument`'s name.
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         use_cache=True, logits_to_keep=1)
        cache, logits = {self._cache_arg: getattr(res, self._cache_arg)}, res.logits[:, -1]
        next_pos = pos[:, -1:] + 1
        for step in range(params.max_new_tokens):
            tok = self._sample(logits, params, gen)
            # The log-prob of the drawn token under the distribution it was drawn from.
            logps[:, step] = behaviour_logprobs(logits, tok, params)
            tokens[:, step] = tok
            hit = ~stopped & torch.isin(tok, stop)
            length = torch.where(hit, step + 1, length)
            stopped |= hit
            if on_finish is not None and bool(hit.any()):  # their tokens so far are final
                for i in hit.nonzero().flatten().tolist():
                    on_finish(first + i, Completion(
                        token_ids=tuple(tokens[i, :step + 1].tolist()),
                        logprobs=tuple(logps[i, :step + 1].tolist()), finish_reason="stop"))
            if bool(stopped.all()) or step + 1 == params.max_new_tokens:
                break
            # Finished rows keep decoding (a batch moves together); their tokens are dropped.
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
            res = self.model(input_ids=tok[:, None], attention_mask=mask,
                             position_ids=next_pos, use_cache=True, **cache)
            cache, logits = {self._cache_arg: getattr(res, self._cache_arg)}, res.logits[:, -1]
            next_pos = next_pos + 1
        tokens_l, logps_l, length_l, stopped_l = (
            tokens.tolist(), logps.tolist(), length.tolist(), stopped.tolist())
        done = [Completion(token_ids=tuple(tokens_l[i][:length_l[i]]),
                           logprobs=tuple(logps_l[i][:length_l[i]]),
                           finish_reason="stop" if stopped_l[i] else "length")
                for i in range(b)]
        if on_finish is not None:  # the rows that ran to the end are final now
            for i in range(b):
                if not stopped_l[i]:
                    on_finish(first + i, done[i])
        return done

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams,
                gen: torch.Generator) -> torch.Tensor:
        """(B, vocab) logits -> (B,) token ids."""
        if params.greedy:
            return logits.argmax(-1)
        probs = torch.softmax(behaviour_logits(logits, params), dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full weights into the model in place; every name, shape and dtype is
        checked before anything is copied (chapter 4's `TorchEngineSink`), so a bad set
        changes nothing. Tensors may live on any device."""
        if self._asleep_level is not None:
            raise RuntimeError("the engine is asleep: wake(tags=['weights']) before loading")
        device = self.device
        tensors = {name: t.detach().to(device) for name, t in named}
        self._sink.load(tensors)
        self._sink.finish()

    @property
    def sink(self) -> TorchEngineSink:
        """Where a weight sync loads full tensors (chapter 4's `TorchEngineSink`): the
        model's own parameters, written in place."""
        return self._sink

    @property
    def asleep(self) -> bool:
        """Whether the engine sleeps (its weights must be woken before anything else)."""
        return self._asleep_level is not None

    def sleep(self, level: int = 1) -> None:
        """Hand the weights' memory to a trainer on the same device, vLLM's two levels:

        - level 1: the weights move to host memory (on CUDA; elsewhere they stay put);
        - level 2: the weights are dropped (their storage freed): for an owner that keeps the
          master weights anyway — the hybrid engine — and reloads them after `wake`.

        Buffers (e.g. the rotary tables) are kept: they are not weights and nobody reloads
        them. A plain torch engine has no KV cache between calls: nothing else to free."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self._asleep_level is not None:
            return
        device = self.device
        self._awake_device, self._asleep_level = device, level
        if level == 1:
            if device.type == "cuda":
                self.model.to("cpu")
        else:
            for name, p in self.model.named_parameters():
                self._shapes[name] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=device)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep` for `tags` ("weights", "kv_cache"; None: both). After a level-2 sleep
        the woken weights are allocated but hold nothing until the owner loads them. A no-op
        for what is awake; "kv_cache" alone is a no-op here (no cache between calls)."""
        wanted = ("weights", "kv_cache") if tags is None else tuple(tags)
        unknown = set(wanted) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake tags {sorted(unknown)}; known: weights, kv_cache")
        if "weights" not in wanted or self._asleep_level is None:
            return
        device = self._awake_device
        if self._asleep_level == 1:
            self.model.to(device)
        else:
            for name, p in self.model.named_parameters():
                p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=device)
            self._shapes = {}
        self._asleep_level = self._awake_device = None

def cache_argument(model: torch.nn.Module) -> str:
    """The name `model`'s forward takes its KV cache by, and returns it under: ``"cache"``
    where the signature has it (transformers >= 5.24, which deprecates the old name both
    ways), else ``"past_key_values"``.

    Read from the model's own signature rather than from a version number: the engine takes
    any causal LM, and the name is its forward's.

    Example:
        >>> from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
        >>> cache_argument(build_tiny_policy(TinyModelSpec(vocab_size=16), seed=0)) in (
        ...     "cache", "past_key_values")
        True
    """
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def behaviour_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float32 logits of the distribution a sample is drawn from: logits / temperature,
    then top-k, then top-p, every cut token at -inf (a softmax renormalises over the rest).
    Greedy: the logits at T = 1 (argmax; vLLM reports its log-probs untruncated).

    vLLM's order and rules (`apply_top_k_top_p_pytorch` in vLLM's
    ``v1/sample/ops/topk_topp_sampler.py``, its path on CPU), so both engines report one
    number: top-k keeps every token >= the k-th largest value (ties at the k-th all stay);
    top-p sorts ascending, drops each token whose cumulative mass, itself and every token
    below it, is <= 1 - top_p, and always keeps the most likely one. vLLM's CUDA kernel keeps
    the same support except at exact ties at the k-th value and float rounding at the cut.

    Example:
        >>> x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
        >>> behaviour_logits(x, SamplingParams(max_new_tokens=1, top_p=0.7)).isfinite().tolist()
        [[True, True, False, False]]
    """
    if params.greedy:
        return logits.float()
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        ascending, order = scaled.sort(dim=-1)
        mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
        # 1 - top_p in float32, as vLLM computes it from its float32 top_p tensor
        drop = mass_up_to <= 1 - torch.tensor(params.top_p, dtype=torch.float32)
        drop[..., -1] = False  # the most likely token always stays
        scaled = scaled.scatter(-1, order, ascending.masked_fill(drop, float("-inf")))
    return scaled


def behaviour_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                       params: SamplingParams) -> torch.Tensor:
    """log p(token) under the behaviour policy: the distribution `TorchEngine` samples from
    (`behaviour_logits`) and the one vLLM's "processed_logprobs" report. Scores any tokens,
    e.g. another engine's, teacher-forced: `logits` (..., vocab), `tokens` (...) int64.

    Without truncation (`params.truncates` False) it is `logprobs_from_logits`, the trainer's
    own function, bit for bit; with it, it exceeds that by -log(mass kept) >= 0.

    Example:
        >>> x = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
        >>> p = SamplingParams(max_new_tokens=1, top_k=2)
        >>> round(float(behaviour_logprobs(x, torch.tensor([0]), p)[0].exp()), 4)  # 0.5 / 0.8
        0.625
    """
    if not params.truncates:
        return logprobs_from_logits(logits, tokens, params.temperature)
    logp = torch.log_softmax(behaviour_logits(logits, params), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
