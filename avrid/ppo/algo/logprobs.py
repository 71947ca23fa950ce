"""Chapter 5 — token log-probabilities and entropy from logits, shared by trainer and rollout.

The rollout engine samples a token and records its log-probability; the actor later recomputes
the log-probability of that same token from the same weights. PPO's importance ratio
``exp(new - old)`` is only right if both sides compute it the same way, so both call the two
functions here (temperature included: sampling at T means the policy is softmax(logits / T)).
The gap between the two is logged every step as `rollout/logprob_gap`.

`chunked_logprobs` is the trainer's way to the same numbers from hidden states: the output
projection over a few positions at a time, so the (tokens x vocab) logits are never whole.

This file is tensor math; it knows nothing about models' structure, engines or workers.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint


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


def chunked_logprobs(hidden: torch.Tensor, head: torch.nn.Module, tokens: torch.Tensor,
                     temperature: float = 1.0, *, chunk: int = 1024,
                     with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs_from_logits(head(hidden), tokens)` (and the entropy) without ever holding
    the (positions x vocab) logits of all positions: `chunk` positions at a time.

    Each chunk's logits (chunk, vocab) are made, reduced to one log-prob (and one entropy)
    per position and dropped. With grad, each chunk runs under activation checkpointing
    (`torch.utils.checkpoint`): backward recomputes that chunk's logits instead of keeping
    every chunk's, so the peak is one chunk x vocab, forward and backward. Positions never
    mix, so the result equals the full computation up to the matmul's summation order.

    Args:
        hidden: (R, hidden) final hidden states (after the model's last norm).
        head: the output projection as a module (e.g. ``model.lm_head``; a tied one shares
            the embedding's weight, which is used, never copied).
        tokens: (R,) int64 — the token whose log-probability is wanted at each position.
        temperature: > 0; logits are divided by it, as in `logprobs_from_logits`.
        chunk: positions per chunk (> 0).
        with_entropy: also return the (R,) entropies.

    Returns:
        (R,) float32 log-probs and (R,) float32 entropies, or None.

    Example:
        >>> head = torch.nn.Linear(2, 3, bias=False)
        >>> h, t = torch.randn(5, 2), torch.tensor([0, 1, 2, 0, 1])
        >>> lp, _ = chunked_logprobs(h, head, t, chunk=2)
        >>> torch.allclose(lp, logprobs_from_logits(head(h), t))
        True
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of positions, got {chunk}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    def one_chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = head(h)
        logp = logprobs_from_logits(logits, t, temperature)
        return (logp, entropy_from_logits(logits, temperature)) if with_entropy else (logp,)

    # Checkpoint only where backward would keep the chunk's logits alive.
    keep_graph = torch.is_grad_enabled() and (hidden.requires_grad or any(
        p.requires_grad for p in head.parameters()))
    parts = []
    for start in range(0, len(hidden), chunk):
        h, t = hidden[start:start + chunk], tokens[start:start + chunk]
        if keep_graph:
            parts.append(torch.utils.checkpoint.checkpoint(one_chunk, h, t,
                                                           use_reentrant=False))
        else:
            parts.append(one_chunk(h, t))
    if not parts:  # no positions: empty results, still on the hidden states' graph
        empty = hidden.sum(-1).float()[:0]
        return empty, (empty if with_entropy else None)
    logp = torch.cat([p[0] for p in parts])
    return logp, (torch.cat([p[1] for p in parts]) if with_entropy else None)
