"""Chapter 5 — token log-probabilities and entropy from logits, shared by trainer and rollout.

The rollout engine samples a token and records its log-probability; the actor later recomputes
the log-probability of that same token from the same weights. PPO's importance ratio
``exp(new - old)`` is only right if both sides compute it the same way, so both call the two
functions here (temperature included: sampling at T means the policy is softmax(logits / T)).
The gap between the two is logged every step as `rollout/logprob_gap`.

This file is pure tensor math; it knows nothing about models, engines or workers.
"""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor,
                         temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[token] for each position.

    Args:
        logits: (..., vocab) — any float dtype; computed in float32 for stability.
        tokens: (...) int64 — the token whose log-probability is wanted at each position.
        temperature: > 0; the sampling temperature the tokens were drawn at.

    Returns:
        (...) float32 log-probabilities.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0]])
        >>> round(float(logprobs_from_logits(logits, torch.tensor([1]))[0]), 4)
        -0.6931
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float() / temperature
    # logsumexp + gather instead of a full log_softmax: one (.., vocab) temporary fewer.
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits / temperature), per position.

    Args:
        logits: (..., vocab).
        temperature: > 0.

    Returns:
        (...) float32 entropies in nats.

    Example:
        >>> round(float(entropy_from_logits(torch.zeros(1, 4))[0]), 4)  # uniform over 4: ln 4
        1.3863
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)
