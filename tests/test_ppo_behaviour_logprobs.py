"""What a rollout engine's log-probs mean: the behaviour policy's own probability of the
sampled token (softmax(logits / T) cut by top-k and top-p, renormalised over the kept tokens),
checked on CPU against a hand-written truncation, for top-k, top-p and both at T = 0.7.

`VllmEngine` reports the same numbers (vLLM's processed log-probs): that is checked on the
real engine in `test_ppo_vllm.py`. Without truncation the engine's log-probs are the
trainer's bit for bit (`test_ppo_rollout.py` pins that against the training code).
Not here: sampling statistics, stop tokens, the trainer's own log-probs."""

from __future__ import annotations

import pytest
import torch

from avrid.ppo.algo.logprobs import logprobs_from_logits
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.engines.torch_engine import (
    SamplingParams,
    TorchEngine,
    behaviour_logits,
    behaviour_logprobs,
)

pytestmark = pytest.mark.chapter(5)

SPEC = TinyModelSpec(vocab_size=32, num_kv_heads=2)
PAD = 0
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11], [12, 13, 14, 1, 2]]
T = 0.7


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    model = build_tiny_policy(SPEC, seed=0, pad_token_id=PAD)
    with torch.no_grad():  # a random model is nearly flat: sharpen it so the cuts bite
        model.lm_head.weight.mul_(8.0)
    return model


def kept_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The textbook truncation of one position's (vocab,) logits, written independently of
    the engine: softmax at T; top-k keeps the k most likely; top-p keeps, among those, the
    most likely tokens until their (renormalised) mass reaches top_p; the rest get 0. The
    result is renormalised."""
    probs = torch.softmax(logits.double() / T, dim=-1)
    order = probs.argsort(descending=True).tolist()
    if top_k:
        order = order[:top_k]
    kept, mass, total = [], 0.0, float(probs[order].sum())
    for t in order:
        kept.append(t)
        mass += float(probs[t]) / total
        if mass >= top_p:
            break
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def teacher_forced_logits(policy: torch.nn.Module, prompt: list[int],
                          response: tuple[int, ...]) -> torch.Tensor:
    """(len(response), vocab) logits that predicted each response token, in one pass."""
    with torch.no_grad():
        out = policy(input_ids=torch.tensor([prompt + list(response)]))
    return out.logits[0, len(prompt) - 1:-1]


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8), (5, 0.8)])
def test_engine_logprobs_are_the_truncated_distributions(policy: torch.nn.Module, top_k: int,
                                                         top_p: float) -> None:
    engine = TorchEngine(policy, pad_token_id=PAD)
    worst_full = 0.0
    for seed in range(3):
        params = SamplingParams(max_new_tokens=10, temperature=T, top_k=top_k, top_p=top_p,
                                seed=seed)
        for prompt, c in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
            logits = teacher_forced_logits(policy, prompt, c.token_ids)
            for i, tok in enumerate(c.token_ids):
                kept = kept_probs(logits[i], top_k, top_p)
                assert kept[tok] > 0, "sampled a token the truncation cuts"
                assert abs(c.logprobs[i] - float(kept[tok].log())) < 1e-5
            full = logprobs_from_logits(logits, torch.tensor(c.token_ids), T)
            worst_full = max(worst_full, float((torch.tensor(c.logprobs) - full).abs().max()))
    # The full-vocabulary value (what the engine reported before) is a different number.
    assert worst_full > 0.05, worst_full


def test_without_truncation_it_is_the_trainers_function_bit_for_bit() -> None:
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    for params in (SamplingParams(max_new_tokens=1, temperature=T),
                   SamplingParams(max_new_tokens=1, greedy=True, top_k=5)):  # greedy: no cut
        assert not params.truncates
        assert torch.equal(behaviour_logprobs(logits, tokens, params),
                           logprobs_from_logits(logits, tokens, params.temperature))


def test_the_cut_follows_vllms_boundary_rules() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    logits = probs.log() * T  # so that softmax(logits / T) is `probs`
    # top-k keeps every token tied with the k-th value (4 of them in the flat row)
    kept = behaviour_logits(logits, SamplingParams(max_new_tokens=1, temperature=T, top_k=2))
    assert kept.isfinite().sum(-1).tolist() == [2, 4]
    # top-p: the smallest most-likely set whose mass reaches p (0.4 + 0.3 >= 0.65)
    kept = behaviour_logits(logits[:1], SamplingParams(max_new_tokens=1, temperature=T,
                                                       top_p=0.65))
    assert kept.isfinite().tolist() == [[True, True, False, False]]
    # a tiny top_p still keeps the most likely token
    kept = behaviour_logits(logits[:1], SamplingParams(max_new_tokens=1, temperature=T,
                                                       top_p=0.01))
    assert kept.isfinite().tolist() == [[True, False, False, False]]
    logp = behaviour_logprobs(logits[:1], torch.tensor([0]),
                              SamplingParams(max_new_tokens=1, temperature=T, top_p=0.01))
    assert float(logp[0]) == pytest.approx(0.0, abs=1e-6)  # the only kept token: p = 1
