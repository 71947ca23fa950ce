"""Chapter 6 — the off-policy correction for asynchronous RL: one detached weight per token.

Three policies touch every token of an asynchronous batch, and each has its log-probability:

- the BEHAVIOUR policy mu (`rollout_logp`): the rollout engine that sampled the token, with
  weights that may be K versions older than the trainer's (and with its own kernels, so even at
  K = 0 its numbers differ slightly from the trainer's);
- the PROXIMAL policy pi_prox (`old_logp`): the trainer's weights at the start of this training
  step, recomputed by the trainer on the sampled tokens; PPO's ratio is taken against it;
- the CURRENT policy pi_theta (`logp`): the one being optimised, with gradient.

Why staleness needs a correction: PPO's clipped surrogate, with r = pi_theta / pi_prox, is an
expectation over tokens sampled from pi_prox. In a synchronous loop mu IS pi_prox and all is
well. Asynchronously the tokens come from mu, so the same average estimates
E_mu[...] instead, a different (biased) objective that grows worse the staler mu is. The
importance weight pi_prox / mu turns an average over mu's samples into one over pi_prox's.
Taking the ratio against mu instead (old_logp := rollout_logp) would also be unbiased, but it
centres the clip's trust region on a stale policy: the staler the batch, the more tokens start
out clipped. Keeping r = pi_theta / pi_prox and multiplying by pi_prox / mu separates the two
jobs: the clip bounds the update, the weight corrects the sampling (Hilton et al. 2021).

With rho_t = exp(old_logp_t - rollout_logp_t) = pi_prox / mu, the cap C >= 1 and
L_t = `losses.policy_loss(logp, old_logp, A, mask, ...).per_token`, the loss is w_t * L_t:

    correction   w_t                          capped_t    source
    none         1                            never       plain PPO: mu is ignored
    tis          min(rho_t, C)                rho_t > C   verl's TIS (Yao et al. 2025)
    decoupled    rho_t if rho_t <= C else 0   rho_t > C   decoupled PPO (Hilton et al. 2021;
                                                          AReaL, Fu et al. 2025)

so decoupled PPO's objective J = E_mu[(pi_prox / mu) * min(r A, clip(r, 1-eps, 1+eps) A)] is
exactly -sum_t w_t L_t. The two corrections agree below the cap and differ above it: a token
mu found far less likely than pi_prox does has a huge, high-variance rho; TIS keeps it at
weight C (biased, bounded), decoupled drops it (it trusts no such token). Both give w = 1
exactly when old_logp == rollout_logp, i.e. in a synchronous run with identical numerics.

The weight is DETACHED: mu and pi_prox are both fixed (neither is pi_theta), so rho is a
constant that reweights the sampled tokens, not something to optimise; the gradient flows
through r only, as in the derivation. Detaching also means a caller that hands in log-probs
with grad cannot leak gradient into the rollout engine's or the proximal policy's numbers.

What this file is not: it does not compute the PPO loss (`losses.policy_loss` does; the caller
multiplies its `per_token` by `weights`, then reduces with `losses.token_weights` as before),
and it knows nothing of versions, queues or engines. Conventions are those of `losses.py`:
right-padded (B, T) tensors, a `mask` of valid tokens, float32 math, padding never read.
In a multi-turn batch (chapter 7) callers pass the ACTION mask (`columns.action_mask`): an
observation token has no behaviour log-prob (rollout_logp 0), so it must get no ratio, no
weight and no place in `weight_stats`, exactly like padding. The mask need not be a prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from avrid.ppo.algo.advantages import check_mask

Correction = Literal["none", "tis", "decoupled"]
"""How a token's policy loss is reweighted for the behaviour policy (see `importance_weights`)."""
CORRECTIONS: tuple[str, ...] = get_args(Correction)

# As in losses.py: exp() of a log-ratio beyond this is inf in float32 anyway, and clamping keeps
# one absurd token (a rollout log-prob of -1000) from making a weight, or a metric, inf.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportanceWeights:
    """What `importance_weights` returns; every tensor is (B, T) and carries no gradient.

    weights: float32, the w_t to multiply `policy_loss(...).per_token` by; 0 on padding.
    raw_ratio: float32, rho_t = exp(old_logp - rollout_logp) before any cap, whatever the
        correction (it measures how far the behaviour policy is from the proximal one, which is
        worth logging even with "none"); 0 on padding.
    capped: bool, where the cap bit (tis: truncated to C; decoupled: dropped to 0); False on
        padding and everywhere for "none".
    """

    weights: torch.Tensor
    raw_ratio: torch.Tensor
    capped: torch.Tensor


def _check_like(name: str, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Shape-check a (B, T) input against its mask; return it detached, as float32 with padding
    zeroed."""
    if tuple(t.shape) != tuple(mask.shape):
        raise ValueError(f"{name} must have shape {tuple(mask.shape)}, got {tuple(t.shape)}")
    # where, not multiply: -inf * 0 is nan, where(False, -inf, 0) is 0.
    return torch.where(mask, t.detach().float(), 0.0)


def importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                       *, correction: str, cap: float) -> ImportanceWeights:
    """Per-token off-policy weights w_t for the policy loss, from the proximal and behaviour
    log-probs of the sampled tokens. With rho_t = exp(clamp(old_logp_t - rollout_logp_t, -20,
    20)) = pi_prox / mu and C = cap:

        none        w_t = 1                                capped_t = False
        tis         w_t = min(rho_t, C)                    capped_t = rho_t > C   (truncated)
        decoupled   w_t = rho_t if rho_t <= C else 0       capped_t = rho_t > C   (dropped)

    The loss of a token is then w_t * `policy_loss(...).per_token`_t (see the module docstring
    for why, and why w is detached). All three give w_t = 1 exactly where old_logp equals
    rollout_logp. The clamp keeps every weight finite: a log-ratio of +1000 gives rho = e^20.

    Args:
        old_logp: (B, T) log pi_prox(token), the trainer's recomputed log-probs.
        rollout_logp: (B, T) log mu(token), recorded by the rollout engine that sampled it.
        mask: (B, T) valid response tokens (bool or 0/1).
        correction: one of CORRECTIONS.
        cap: C, finite and >= 1 (checked for every correction, "none" included, so a bad
            config fails the same whichever correction it names).

    Returns:
        ImportanceWeights, detached, 0 / False on padding.

    Example:
        >>> ratios = torch.tensor([[0.5, 3.0]])  # pi_prox / mu per token
        >>> iw = importance_weights(ratios.log(), torch.zeros(1, 2), torch.ones(1, 2),
        ...                         correction="tis", cap=2.0)
        >>> [round(x, 4) for x in iw.weights[0].tolist()], iw.capped.tolist()
        ([0.5, 2.0], [[False, True]])
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, got {correction!r}")
    # `not (>= 1)` rather than `< 1`: nan compares False with everything and must fail too.
    if not (math.isfinite(cap) and cap >= 1.0):
        raise ValueError(f"cap must be a finite number >= 1, got {cap!r}")
    m = check_mask(mask, old_logp.shape)
    old = _check_like("old_logp", old_logp, m)
    rollout = _check_like("rollout_logp", rollout_logp, m)
    # Padding has log-ratio 0 here (both zeroed), so exp never sees garbage; zeroed below.
    log_ratio = (old - rollout).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    raw = torch.where(m, torch.exp(log_ratio), 0.0)
    if correction == "none":
        capped = torch.zeros_like(m)
        weights = m.float()
    else:
        capped = (raw > cap) & m
        if correction == "tis":
            weights = raw.clamp(max=cap)  # padding stays 0: 0 < C
        else:
            weights = torch.where(capped, 0.0, raw)
    return ImportanceWeights(weights=weights, raw_ratio=raw, capped=capped)


def weight_stats(iw: ImportanceWeights, mask: torch.Tensor) -> dict[str, float]:
    """The per-batch metrics of the correction, over the valid tokens of `mask`:

        is_weight_mean   mean of raw_ratio     ~1 when mu is close to pi_prox; it drifts as the
                                               batch grows staler
        is_weight_max    max of raw_ratio      the worst token (at most e^20, the clamp)
        is_capped_frac   share of tokens capped (truncated by tis, dropped by decoupled)

    The raw ratio, not the applied weight, so that the mismatch is visible whatever the
    correction ("none" included). All three are 0.0 when no token is valid (never nan).

    Example:
        >>> iw = importance_weights(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2),
        ...                         torch.tensor([[1, 0]]), correction="tis", cap=2.0)
        >>> weight_stats(iw, torch.tensor([[1, 0]]))
        {'is_weight_mean': 1.0, 'is_weight_max': 1.0, 'is_capped_frac': 0.0}
    """
    m = check_mask(mask, iw.raw_ratio.shape)
    n = int(m.sum())
    if n == 0:
        return {"is_weight_mean": 0.0, "is_weight_max": 0.0, "is_capped_frac": 0.0}
    raw = iw.raw_ratio.detach().float()[m]
    return {"is_weight_mean": float(raw.sum() / n), "is_weight_max": float(raw.max()),
            "is_capped_frac": float((iw.capped & m).sum() / n)}
