"""Chapter 5 — two alternatives to PPO's clipped token ratio: GSPO (one importance ratio per
sequence) and CISPO (clip the importance weight, never the gradient), each equal per token to
verl 0.9.1's (`verl/trainer/ppo/core_algos.py`: compute_policy_loss_gspo, _cispo).

Both return `losses.PolicyLossOut`, like `losses.policy_loss`: the (B, T) per-token loss and
where clipping was active, and nothing is averaged here. verl aggregates inside each loss
function (`agg_loss`); avrid leaves that to `losses.token_weights` (or `losses.aggregate` for
one matrix), so that a loss split over micro-batches and ranks adds up exactly. That is the one
deliberate departure: the per-token losses equal verl's, and `aggregate` of them equals verl
0.9.1's scalar in all four of avrid's modes (norm_len = verl's loss_scale_factor); verl's extra
"token-sum" mode has no counterpart here. (verl 0.9.1 GSPO aggregates in the configured mode;
the paper, and verl's default argument, use "seq-mean-token-mean".)

Conventions are those of `losses.py`: right-padded (B, T) response tensors, a `mask` (bool or
0/1), float32 math, padding never read and returned as 0. Pure tensor math; no models, no Ray.
"""

from __future__ import annotations

import torch

from avrid.ppo.algo.advantages import check_mask
from avrid.ppo.algo.losses import PolicyLossOut

# verl's clamps on the log-ratios: GSPO caps the sequence log-ratio at 10 (above only); CISPO
# clamps the token log-ratio to [-20, 20], where exp() is still finite in float32.
_GSPO_MAX_LOG_RATIO = 10.0
_CISPO_MAX_LOG_RATIO = 20.0


def _check_clip(clip_low: float, clip_high: float, *, low_may_be_one: bool) -> None:
    if not (0.0 < clip_low < 1.0 or (low_may_be_one and clip_low == 1.0)):
        raise ValueError(f"clip_low must be in (0, 1{']' if low_may_be_one else ')'}, "
                         f"got {clip_low}")
    if clip_high <= 0:
        raise ValueError(f"clip_high must be > 0, got {clip_high}")


def _inputs(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mask as bool, logp, old_logp, advantages) as float32 with padding zeroed; only logp
    keeps its gradient."""
    m = check_mask(mask, logp.shape)
    out = [m]
    for name, t in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        if tuple(t.shape) != tuple(m.shape):
            raise ValueError(f"{name} must have shape {tuple(m.shape)}, got {tuple(t.shape)}")
        # where, not multiply: inf * 0 is nan, and exp(inf) would poison the backward.
        out.append(torch.where(m, t.float(), 0.0))
    out[2], out[3] = out[2].detach(), out[3].detach()  # targets: gradient through logp only
    return tuple(out)


def gspo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, *, clip_low: float, clip_high: float) -> PolicyLossOut:
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071), in the
    token form ("GSPO-token") that verl implements.

        log s_i   = (1 / |y_i|) * sum_t (logp_it - old_logp_it)      length-normalised
        s_it      = sg[s_i] * pi(y_it) / sg[pi(y_it)]                 value s_i, grad via logp_it
        L_it      = max(-A_it * s_it, -A_it * clip(s_it, 1 - clip_low, 1 + clip_high))

    (sg = stop-gradient; log s_it is capped at 10 before exp, as in verl.) PPO's token ratio is
    noisy for long responses and clips tokens one by one; GSPO clips whole sequences on the
    geometric mean of their token ratios, since the reward is given to the sequence. The
    gradient of L_it is -A_it * s_i * grad logp_it while unclipped, so with one advantage per
    sequence and "seq-mean-token-mean" aggregation it is exactly GSPO's sequence gradient
    (A_i * s_i * mean_t grad logp_it); token advantages keep the token variant's freedom.
    The paper's clip ranges are tiny (3e-4 / 4e-4), since s_i is a per-token geometric mean.

    Args:
        logp: (B, T) log-probs under the policy being trained (grad).
        old_logp: (B, T) log-probs under the policy that sampled the tokens.
        advantages: (B, T) per-token advantages (normally one value per sequence).
        mask: (B, T) valid response tokens; an empty row has s_i = 1 and no loss.
        clip_low: in (0, 1). clip_high: > 0.

    Returns:
        PolicyLossOut; `clipped` marks every valid token of a sequence whose clipped term won
        (verl's pg_clipfrac is its share); `dual_clipped` is all False.

    Example:
        >>> lp = torch.log(torch.tensor([[1.5, 1.5], [1.0, 0.9]]))  # s = 1.5 and 0.9487
        >>> out = gspo_policy_loss(lp, torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2),
        ...                        clip_low=0.2, clip_high=0.2)
        >>> [[round(x, 4) for x in r] for r in out.per_token.tolist()], out.clipped.tolist()
        ([[-1.2, -1.2], [-0.9487, -0.9487]], [[True, True], [False, False]])
    """
    _check_clip(clip_low, clip_high, low_may_be_one=False)
    m, lp, old, adv = _inputs(logp, old_logp, advantages, mask)
    lengths = m.sum(dim=1).clamp(min=1)
    seq_log_ratio = ((lp - old).sum(dim=1) / lengths).detach()
    # lp - lp.detach() is 0 in value and carries d/dlogp = 1: s_it has s_i's value and
    # s_i * grad logp_it as gradient, i.e. each token's gradient is weighted by its sequence.
    log_ratio = (lp - lp.detach() + seq_log_ratio.unsqueeze(1)).clamp(max=_GSPO_MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    return PolicyLossOut(per_token=torch.where(m, per_token, 0.0),
                         clipped=(clipped > unclipped) & m, dual_clipped=torch.zeros_like(m))


def cispo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, *, clip_low: float, clip_high: float) -> PolicyLossOut:
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1",
    arXiv 2506.13585): clip the importance weight and stop its gradient, so every token keeps
    a REINFORCE gradient, only re-weighted.

        r_t = exp(clamp(logp_t - old_logp_t, -20, 20))
        w_t = sg[clip(r_t, 1 - clip_low, 1 + clip_high)]
        L_t = -w_t * A_t * logp_t                      grad: -w_t * A_t * grad logp_t

    PPO's clip zeroes the gradient of a token whose ratio left the range in the rewarded
    direction; in long reasoning those are often the rare "fork" tokens (however, recheck, ...)
    that matter most. CISPO bounds such a token's weight instead and still learns from it.
    The loss VALUE is not a surrogate objective (it is -w A logp, far from 0); only its
    gradient is meaningful, exactly as in verl. clip_low may be 1 (no lower bound: w >= 0).

    Args:
        logp: (B, T) log-probs under the policy being trained (grad).
        old_logp: (B, T) log-probs under the policy that sampled the tokens.
        advantages: (B, T) per-token advantages.
        mask: (B, T) valid response tokens.
        clip_low: in (0, 1]. clip_high: > 0.

    Returns:
        PolicyLossOut; `clipped` marks tokens whose weight was clipped (r_t outside the range,
        verl's pg_clipfrac is their share); `dual_clipped` is all False.

    Example:
        >>> lp = torch.log(torch.tensor([[1.5, 0.9]]))  # ratios 1.5 and 0.9 (old_logp = 0)
        >>> out = cispo_policy_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
        ...                         clip_low=0.2, clip_high=0.2)
        >>> [round(x, 4) for x in out.per_token[0].tolist()], out.clipped.tolist()
        ([-0.4866, 0.0948], [[True, False]])
    """
    _check_clip(clip_low, clip_high, low_may_be_one=True)
    m, lp, old, adv = _inputs(logp, old_logp, advantages, mask)
    ratio = torch.exp((lp - old).clamp(-_CISPO_MAX_LOG_RATIO, _CISPO_MAX_LOG_RATIO)).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -weight * adv * lp
    return PolicyLossOut(per_token=torch.where(m, per_token, 0.0),
                         clipped=(ratio != weight) & m, dual_clipped=torch.zeros_like(m))
