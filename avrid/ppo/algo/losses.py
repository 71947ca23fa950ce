"""Chapter 5 — the PPO/GRPO losses: clipped policy surrogate, clipped value loss, KL estimators,
and the one definition of how a (B, T) loss matrix becomes the scalar that is backpropagated.

Every loss here is first computed per token, then reduced with `token_weights`, the one
definition of the four aggregation modes (`aggregate` applies them to one matrix). The
reduction is not a detail: token-mean, seq-mean-token-mean and Dr.GRPO's
seq-mean-token-sum-norm weight long and short responses differently, and that changes what the
model learns. It is one config field (`algo.loss_agg`) so that experiments can switch it.

Conventions are those of `advantages.py`: right-padded (B, T) tensors over response tokens, a
`mask` (bool or 0/1) for the valid ones, float32 math, padding never read. The ratio
exp(logp - old_logp) needs the two log-probabilities computed the same way: both come from
`logprobs.logprobs_from_logits` (and entropies from `logprobs.entropy_from_logits`).

A worker sees only its micro-batches of a mini-batch, so it weights each token with the WHOLE
mini-batch's counts (`token_weights`); the sum over micro-batches and ranks is then exactly
the mini-batch's loss (`forward.train_shard`).

Which KL estimator where (d = log pi - log ref on tokens sampled from pi; Schulman 2020;
Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL"):

- In the REWARD only the estimate's VALUE matters (it is a penalty the policy gradient then
  optimises): k1 and k3 are unbiased estimates of KL(pi || ref), k3 with lower variance;
  k2's mean is KL(pi || ref) only to second order in d.
- In the LOSS only its GRADIENT matters, taken through log pi at fixed samples:
  k1: E[grad d] = E[grad log pi] = 0 — no pull towards the reference at all, only noise, so
      the config refuses k1 in the loss;
  k2: E[d * grad log pi] = grad KL(pi || ref) on-policy — the reverse KL's gradient;
  k3: E[(1 - ref/pi) * grad log pi] = grad KL(ref || pi) — the forward KL's gradient, also
      zero exactly at pi = ref (GRPO's choice).

Pure tensor math; no models, no workers, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Literal, get_args

import torch

from avrid.ppo.algo.advantages import check_mask

KlKind = Literal["k1", "k2", "k3"]
"""Schulman's KL estimators (see `kl_estimate`)."""
KL_KINDS: tuple[str, ...] = get_args(KlKind)
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm"]
"""How token losses become one number (see `token_weights`)."""
AGG_MODES: tuple[str, ...] = get_args(AggMode)

# exp() of a log-ratio beyond this is inf in float32 anyway; clamping keeps one absurd token
# (a stale old_logp, a reference that gives a token ~0 probability) from making the loss inf.
_MAX_LOG_RATIO = 20.0
# verl's cap on the k3 value ("low_var_kl": clamp(kl, -10, 10); k3 >= 0, so only the top bites).
_MAX_K3 = 10.0


def _checked(mask: torch.Tensor, **inputs: torch.Tensor) -> list[torch.Tensor]:
    """[mask as bool, *inputs as float32 with padding zeroed], each input shape-checked
    against the mask (whose shape is the first input's)."""
    m = check_mask(mask, next(iter(inputs.values())).shape)
    return [m, *(_check_like(name, t, m) for name, t in inputs.items())]


def _check_like(name: str, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Shape-check a (B, T) input against its mask; return it as float32 with padding zeroed."""
    if tuple(t.shape) != tuple(mask.shape):
        raise ValueError(f"{name} must have shape {tuple(mask.shape)}, got {tuple(t.shape)}")
    # where, not multiply: inf * 0 is nan, and the backward of exp(inf) poisons gradients.
    return torch.where(mask, t.float(), 0.0)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the log-probs of tokens sampled from pi.

    With d = logp - ref_logp (Schulman, "Approximating KL divergence", 2020):

        k1 = d                          unbiased, high variance, can be negative
        k2 = 0.5 * d^2                  biased, low variance, >= 0
        k3 = exp(-d) - (-d) - 1         unbiased, low variance, >= 0 (since e^x >= 1 + x)

    k3 is computed as verl's "low_var_kl" is, with two clamps:

        k3 = clamp(exp(x) - x - 1, max=10)     with x = clamp(-d, -20, 20)

    The first keeps exp finite; the second bounds the value, which grows like exp(-d): at
    d = -15 (the reference finds the token 15 nats likelier than pi does) it would be 3.3e6,
    and one such token in the reward would swamp every score and critic target of the batch.
    A clamped token has zero gradient. Which estimator is sound where (reward or loss): see
    the module docstring; k1 in the loss is not.

    Args:
        logp: (B, T) log pi(token) under the current policy.
        ref_logp: (B, T) log ref(token) under the reference model.
        kind: one of KL_KINDS.

    Returns:
        (B, T) float32 estimates (mask them with `aggregate`); k3 lies in [0, 10].

    Example:
        >>> lp, ref = torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, 0.0]])
        >>> [round(x, 4) for x in kl_estimate(lp, ref, "k3")[0].tolist()]
        [0.3679, 0.7183]
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp must have shape {tuple(logp.shape)}, "
                         f"got {tuple(ref_logp.shape)}")
    d = logp.float() - ref_logp.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    neg = (-d).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # log(ref / pi)
    return (torch.exp(neg) - neg - 1.0).clamp(max=_MAX_K3)


def token_weights(mask: torch.Tensor, mode: str, *, tokens: int, seqs: int,
                  norm_len: int | None = None) -> torch.Tensor:
    """The one definition of the aggregation modes: (B, T) weights w such that sum(w * L),
    added up over every part of a batch, is that batch's loss in `mode`. With L_it the loss,
    n_i row i's valid count, N = `tokens` (all valid tokens of the batch) and S = `seqs`
    (its rows that have any):

        token-mean               w_it = 1 / N                     every token weighs the same
        seq-mean-token-sum       w_it = 1 / S                     long rows weigh more
        seq-mean-token-mean      w_it = 1 / (n_i S)               every row weighs the same
        seq-mean-token-sum-norm  w_it = 1 / (norm_len S)          Dr.GRPO: a constant divisor

    (0 on padding). Because N and S are the WHOLE batch's counts, the weights of a row do not
    depend on which other rows share its micro-batch or its data-parallel rank: each worker
    weights its own rows, and the sum over workers is exactly the batch's loss, not a mean of
    per-worker means. `aggregate` is the same weights applied to one (B, T) matrix.

    norm_len is Dr.GRPO's constant, normally the maximum response length; it must stay fixed
    through training. (Older verl divided the sum over ROWS by the padded width instead; that
    differs from this by the constant factor B, which the learning rate absorbs.)

    Example (two rows split over two workers: their weighted sums add up to the mean):
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> [token_weights(m, "seq-mean-token-mean", tokens=4, seqs=2)[i].tolist()
        ...  for i in (0, 1)]
        [[0.1666666716337204, 0.1666666716337204, 0.1666666716337204], [0.5, 0.0, 0.0]]
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode must be one of {AGG_MODES}, got {mode!r}")
    if norm_len is not None and (isinstance(norm_len, bool) or not isinstance(norm_len, Integral)
                                 or norm_len < 1):
        raise ValueError(f"norm_len must be an int >= 1, got {norm_len!r}")
    if mode == "seq-mean-token-sum-norm" and norm_len is None:
        raise ValueError("norm_len is required for mode 'seq-mean-token-sum-norm' "
                         "(the fixed maximum response length)")
    m = mask.float()
    if mode == "token-mean":
        return m / max(tokens, 1)
    if mode == "seq-mean-token-sum":
        return m / max(seqs, 1)
    if mode == "seq-mean-token-mean":
        return m / m.sum(1, keepdim=True).clamp(min=1) / max(seqs, 1)
    return m / (int(norm_len) * max(seqs, 1))


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *,
              norm_len: int | None = None) -> torch.Tensor:
    """Reduce one per-token loss matrix to a scalar: sum(L * `token_weights`), with the
    matrix's own counts (see there for the four modes).

    Rows with no valid token are left out of the mean over rows (they have no loss to give, and
    counting them would shrink the loss according to how many empty rows a batch happens to
    hold). If nothing at all is valid the result is 0, still attached to the graph, so that
    backward() works and gives zero gradients.

    Args:
        loss_mat: (B, T) per-token losses.
        mask: (B, T) valid tokens.
        mode: one of AGG_MODES.
        norm_len: int >= 1; required by (and only used by) "seq-mean-token-sum-norm".

    Returns:
        0-d float32 tensor.

    Example:
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> [float(aggregate(loss, mask, m, norm_len=4)) for m in AGG_MODES]
        [2.5, 5.0, 3.0, 1.25]
    """
    if mode not in AGG_MODES:  # before the mask: the clearer error first
        raise ValueError(f"mode must be one of {AGG_MODES}, got {mode!r}")
    m = check_mask(mask, loss_mat.shape)
    x = _check_like("loss_mat", loss_mat, m)
    w = token_weights(m, mode, tokens=int(m.sum()), seqs=int((m.sum(1) > 0).sum()),
                      norm_len=norm_len)
    return (x * w).sum()


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyLossOut:
    """What every policy loss returns (`policy_loss`, GSPO, CISPO, and yours: the contract of
    ``algo.policy_loss=module:function``, `registry.PolicyLossInputs` in, this out), for one
    micro-batch of B rows and T response tokens. The actor's update uses it so:

        loss = sum(per_token * off_policy_weight * token_weights) + KL and entropy terms

    `token_weights` holds the whole mini-batch's counts in `algo.loss_agg`'s mode, so the sum
    over micro-batches and ranks is the mini-batch's loss (a data-parallel update is exact):
    a loss must not average its tokens itself. `compute_policy_loss` checks the three shapes.

    Example (a REINFORCE loss, -A_t logp_t, that never clips):
        >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> zero = torch.zeros(1, 2, dtype=torch.bool)
        >>> out = PolicyLossOut(per_token=-torch.tensor([[1.0, 0.5]]) * lp, clipped=zero,
        ...                     dual_clipped=zero)
        >>> out.per_token.detach().tolist()
        [[1.0, 1.0]]
    """

    per_token: torch.Tensor
    """(B, T) float loss of each token, with the gradient through `logp`; 0 on padding."""
    clipped: torch.Tensor
    """(B, T) bool: where a clip was the active term (`actor/pg_clipfrac` is its share of the
    valid tokens); all False for a loss without one."""
    dual_clipped: torch.Tensor
    """(B, T) bool: where the dual-clip cap was (all False without dual clip)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueLossOut:
    """What `value_loss` returns: the (B, T) `per_token` loss (grad; 0 on padding; weight it
    as `PolicyLossOut.per_token`) and `clipped`, (B, T) bool, where the clipped term won."""

    per_token: torch.Tensor
    clipped: torch.Tensor


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_low: float, clip_high: float,
                dual_clip: float | None = None) -> PolicyLossOut:
    """PPO's clipped surrogate (Schulman et al. 2017), with asymmetric and dual clipping.

        ratio_t = exp(logp_t - old_logp_t)
        L_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))
        if dual_clip and A_t < 0:   L_t = min(L_t, -A_t * dual_clip)

    The max (of negated objectives) is the pessimistic bound: once the ratio has moved past the
    clip range in the direction the advantage rewards, the gradient is 0, so one batch cannot
    push the policy far from the one that sampled it. clip_high > clip_low ("clip-higher", DAPO)
    leaves more room to raise unlikely tokens. Dual clip (Ye et al. 2020): for A < 0 and a huge
    ratio, -A * ratio is unbounded; capping it at -A * dual_clip bounds that one token's pull.

    Args:
        logp: (B, T) log-probs of the sampled tokens under the policy being trained (grad).
        old_logp: (B, T) log-probs under the policy that sampled them (no grad needed).
        advantages: (B, T) per-token advantages (from `gae` or `grpo_advantages`).
        mask: (B, T) valid response tokens.
        clip_low: in (0, 1). clip_high: > 0. dual_clip: > 1, or None for no dual clip.

    Returns:
        PolicyLossOut; only `per_token` carries gradient.

    Example:
        >>> lp = torch.log(torch.tensor([[1.5, 0.9]]))  # ratios 1.5 and 0.9 (old_logp = 0)
        >>> out = policy_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
        ...                   clip_low=0.2, clip_high=0.2)
        >>> out.per_token.tolist(), out.clipped.tolist()  # 1.5 is clipped to 1.2
        ([[-1.2000000476837158, -0.8999999761581421]], [[True, False]])
    """
    if not 0.0 < clip_low < 1.0:
        raise ValueError(f"clip_low must be in (0, 1), got {clip_low}")
    if clip_high <= 0:
        raise ValueError(f"clip_high must be > 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    m, lp, old, adv = _checked(mask, logp=logp, old_logp=old_logp, advantages=advantages)
    old, adv = old.detach(), adv.detach()  # targets: the gradient flows through logp only
    # Padding has log-ratio 0, so ratio 1 there: exp never sees garbage, grads stay finite.
    log_ratio = (lp - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    # Strictly greater: inside the range (and where A = 0) both terms are equal, nothing clipped.
    clip_flags = clipped > unclipped
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_flags = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual_flags, cap, per_token)
    else:
        dual_flags = torch.zeros_like(m)
    return PolicyLossOut(per_token=torch.where(m, per_token, 0.0), clipped=clip_flags & m,
                         dual_clipped=dual_flags & m)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, *, clip: float | None) -> ValueLossOut:
    """PPO's clipped value loss: the critic may move at most `clip` from its old prediction.

        v_clip_t = clamp(values_t, old_values_t - clip, old_values_t + clip)
        L_t      = 0.5 * max((values_t - R_t)^2, (v_clip_t - R_t)^2)
        L_t      = 0.5 * (values_t - R_t)^2                            if clip is None

    Like the policy clip, the max is pessimistic: the clipped branch only wins when the new
    value moved past the clip range, and there its gradient is 0. The clip bounds `values`
    itself (as verl's `clip_by_value` does), not old + clamp(values - old): in floating point
    old + (values - old) is not always `values`, and that rounding flagged ~0.5 % of in-range
    tokens as clipped. Here an in-range value is returned unchanged, so its two terms are equal
    and it is never flagged.

    Args:
        values: (B, T) current critic predictions (grad).
        old_values: (B, T) predictions made at rollout time.
        returns: (B, T) targets, e.g. the returns of `gae`.
        mask: (B, T) valid response tokens.
        clip: > 0, or None for the plain squared error.

    Returns:
        ValueLossOut; only `per_token` carries gradient.

    Example:
        >>> out = value_loss(torch.tensor([[2.0, 2.0]]), torch.ones(1, 2),
        ...                  torch.tensor([[1.5, 3.0]]), torch.ones(1, 2), clip=0.2)
        >>> [round(x, 4) for x in out.per_token[0].tolist()], out.clipped.tolist()
        ([0.125, 1.62], [[False, True]])
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 (or None), got {clip}")
    m, v, old, ret = _checked(mask, values=values, old_values=old_values, returns=returns)
    old, ret = old.detach(), ret.detach()  # targets: the gradient flows through values only
    unclipped = (v - ret) ** 2
    if clip is None:
        per_token = 0.5 * unclipped
        clip_flags = torch.zeros_like(m)
    else:
        # Tensor bounds: clamp's gradient is 1 on [old - clip, old + clip], ends included.
        v_clip = v.clamp(old - clip, old + clip)
        clipped = (v_clip - ret) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clip_flags = clipped > unclipped
    return ValueLossOut(per_token=torch.where(m, per_token, 0.0), clipped=clip_flags & m)
