"""Chapter 5 — advantage estimators: who gets credit for a reward, token by token.

PPO and GRPO differ mostly here. PPO learns a value function V and spreads each reward over
the tokens before it with Generalised Advantage Estimation (`gae`); the rewards it sees are
usually the task score at the last token minus a per-token KL penalty (`kl_penalized_rewards`),
and its advantages are then whitened over the batch (`whiten`). GRPO has no critic: it samples
a group of responses per prompt and scores each one against its siblings (`grpo_advantages`).

Conventions shared by every function (and by `losses.py`):

- Tensors are right-padded (B, T) over RESPONSE tokens only (the prompt is not in them).
- `mask` (B, T), bool or float 0/1, marks the real response tokens; each row is a prefix of
  ones followed by padding. Padding positions never influence a result (they are replaced by
  zeros before any arithmetic, so even inf there stays out) and always come back as 0.
- Everything is computed in float32 whatever the input dtype.

This file is pure tensor math; it knows nothing about models, workers or Ray. The losses that
consume these advantages live in `losses.py`.
"""

from __future__ import annotations

import torch


def check_mask(mask: torch.Tensor, shape: torch.Size | tuple[int, ...], *,
               prefix: bool = False) -> torch.Tensor:
    """Validate a response mask and return it as bool.

    Args:
        mask: (B, T) bool, or any numeric dtype holding only 0 and 1.
        shape: the (B, T) shape the mask must have (that of the tensors it goes with).
        prefix: also require each row to be ones then zeros (right padding).

    Returns:
        (B, T) bool mask.

    Example:
        >>> check_mask(torch.tensor([[1.0, 1.0, 0.0]]), (1, 3)).tolist()
        [[True, True, False]]
    """
    if mask.dim() != 2 or tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must have shape {tuple(shape)} (B, T), got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask must hold only 0 and 1 (or be bool)")
        mask = mask != 0
    # A 0 followed by a 1 is a hole: right padding means no row ever turns back on.
    if prefix and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("mask must be right-padded: each row ones, then only zeros")
    return mask


def check_groups(scores: torch.Tensor, group_ids: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate an outcome estimator's inputs: (B,) scores, (B,) integer group ids, a (B, T)
    mask. Returns (mask as bool, scores as float32 without grad, each response's group index
    0..G-1 in the order of the sorted ids).

    Example:
        >>> m, s, g = check_groups(torch.tensor([1, 0]), torch.tensor([7, 3]), torch.ones(2, 1))
        >>> s.tolist(), g.tolist()
        ([1.0, 0.0], [1, 0])
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (B,), got shape {tuple(scores.shape)}")
    if group_ids.shape != scores.shape:
        raise ValueError(f"group_ids must have shape {tuple(scores.shape)}, "
                         f"got {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex \
            or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    T = mask.shape[1] if mask.dim() == 2 else -1  # -1 makes check_mask reject a non-2-D mask
    m = check_mask(mask, (scores.shape[0], T))
    _, inv = torch.unique(group_ids, return_inverse=True)
    return m, scores.detach().float(), inv


def _check_like(name: str, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Shape-check a (B, T) input against its mask; return it as float32 with padding zeroed."""
    if tuple(t.shape) != tuple(mask.shape):
        raise ValueError(f"{name} must have shape {tuple(mask.shape)}, got {tuple(t.shape)}")
    # where, not multiply: inf * 0 is nan, where(False, inf, 0) is 0.
    return torch.where(mask, t.float(), 0.0)


def _check_unit(name: str, x: float) -> None:
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {x}")


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016), per row, backwards in time.

        delta_t = r_t + gamma * V_{t+1} - V_t        (V after the row's last valid token = 0)
        A_t     = delta_t + gamma * lam * A_{t+1}     (A after the last valid token = 0)
        R_t     = A_t + V_t                           (the value target, "returns")

    lam trades bias for variance: lam = 1 gives the Monte-Carlo return minus V (unbiased, noisy);
    lam = 0 gives the one-step TD error (low variance, as biased as V). With gamma = lam = 1,
    A_t = (sum of rewards from t on) - V_t, the usual LLM setting.

    Args:
        token_rewards: (B, T) reward received at each response token.
        values: (B, T) critic estimate V_t at each response token.
        mask: (B, T) valid response tokens; must be right-padded (rows of any length, even 0).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        (advantages, returns), both (B, T) float32 and 0 on padding. Neither carries gradient:
        they are targets, not functions of the policy.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0]])
        >>> v = torch.tensor([[0.5, 0.6, 0.7]])
        >>> adv, ret = gae(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
        >>> [round(x, 4) for x in adv[0].tolist()], [round(x, 4) for x in ret[0].tolist()]
        ([0.5, 0.4, 0.3], [1.0, 1.0, 1.0])
    """
    _check_unit("gamma", gamma)
    _check_unit("lam", lam)
    m = check_mask(mask, values.shape, prefix=True)
    r = _check_like("token_rewards", token_rewards, m).detach()
    v = _check_like("values", values, m).detach()
    B, T = v.shape
    adv = torch.zeros_like(v)
    running = v.new_zeros(B)  # A_{t+1}
    next_v = v.new_zeros(B)   # V_{t+1}
    # Padding has r = V = 0, and (right padding) nothing valid follows it, so the recursion
    # leaves A = 0 there and reaches each row's last valid token with A_{t+1} = V_{t+1} = 0:
    # one loop serves rows of every length. T is the response length, so a Python loop is fine.
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = delta + gamma * lam * running
        adv[:, t] = running
        next_v = v[:, t]
    returns = torch.where(m, adv + v, 0.0)
    return torch.where(m, adv, 0.0), returns


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, *,
                    norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-relative advantage (Shao et al. 2024), one value per response.

        A_i = (s_i - mean_g) / (std_g + eps)     norm_by_std=True   (GRPO)
        A_i =  s_i - mean_g                       norm_by_std=False  (Dr.GRPO)

    where g is i's group (the responses to the same prompt), mean_g its mean score and std_g
    its UNBIASED standard deviation (divides by n - 1, like torch.std and verl). A group of one
    response has no sibling to compare with: its advantage is 0. A group whose scores are all
    equal also gets 0 (s_i - mean_g = 0): nothing there to learn from.

    Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training") drops the std division,
    which over-weights prompts that are almost always (or never) solved, and pairs it with the
    "seq-mean-token-sum-norm" aggregation in `losses.py`, which drops the 1/length per response
    that biases GRPO towards long wrong answers.

    Args:
        scores: (B,) one scalar score (reward) per response.
        group_ids: (B,) integer; equal ids mark responses to the same prompt.
        mask: (B, T) valid response tokens; the advantage is broadcast over them.
        norm_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: > 0, keeps a zero-std group finite.

    Returns:
        (B, T) float32 advantages: A_i on row i's valid tokens, 0 on padding. A row with no
        valid tokens still counts in its group's statistics.

    Example:
        >>> s = torch.tensor([1.0, 0.0, 0.0, 1.0])
        >>> a = grpo_advantages(s, torch.zeros(4, dtype=torch.long), torch.ones(4, 2))
        >>> [round(x, 4) for x in a[:, 0].tolist()]
        [0.866, -0.866, -0.866, 0.866]
    """
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    m, s, inv = check_groups(scores, group_ids, mask)
    n = torch.bincount(inv).float()
    mean = torch.zeros_like(n).index_add_(0, inv, s) / n
    centred = s - mean[inv]
    if norm_by_std:
        sq = torch.zeros_like(n).index_add_(0, inv, centred * centred)
        # Bessel's n - 1; a lone response has centred = 0 and var 0, so its A is 0 / eps = 0.
        std = (sq / (n - 1).clamp(min=1)).sqrt()
        adv = centred / (std[inv] + eps)
    else:
        adv = centred
    return torch.where(m, adv.unsqueeze(1), 0.0)


def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, *,
                         kl_coef: float) -> torch.Tensor:
    """Token rewards with the KL penalty folded in ("KL in reward", InstructGPT-style PPO).

        r_t = -kl_coef * kl_t  +  [t == last valid token of the row] * score

    The task reward arrives only when the response ends; the penalty for drifting from the
    reference model is paid at every token, so GAE can credit each token with both.

    Args:
        scores: (B,) sequence-level score per response.
        kl: (B, T) per-token KL estimate between policy and reference (see `kl_estimate`).
        mask: (B, T) valid response tokens.
        kl_coef: >= 0 (0 switches the penalty off).

    Returns:
        (B, T) float32 token rewards, 0 on padding. A row with no valid tokens has no last
        token, so its score is dropped (its rewards are all 0).

    Example:
        >>> kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]])
        >>> mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        >>> r = kl_penalized_rewards(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.5)
        >>> [[round(x, 4) for x in row] for row in r.tolist()]
        [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    m = check_mask(mask, kl.shape)
    if tuple(scores.shape) != (kl.shape[0],):
        raise ValueError(f"scores must have shape ({kl.shape[0]},), got {tuple(scores.shape)}")
    # Negate inside the where: -c * 0.0 is -0.0, and padding should read as a plain 0.
    rewards = torch.where(m, -kl_coef * _check_like("kl", kl, m), 0.0)
    T = m.shape[1]
    # Index of the last True per row: argmax of position * mask picks the largest position.
    last = (torch.arange(T, device=m.device) * m).argmax(dim=1)
    has_tokens = m.any(dim=1)
    bonus = torch.where(has_tokens, scores.float(), 0.0)
    return rewards.scatter_add(1, last.unsqueeze(1), bonus.unsqueeze(1))


def whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening over all valid tokens of the batch (PPO's advantage normalisation).

        mu  = mean of values over valid tokens
        var = unbiased variance over valid tokens (divides by n - 1, like verl)
        out = (values - mu) / sqrt(var + eps)        (+ mu again if shift_mean=False)

    Whitening keeps the policy-gradient step size independent of the reward scale. With
    shift_mean=False the scale is normalised but the mean kept, so a batch that did better
    than V on average still pushes those tokens up.

    Args:
        values: (B, T) e.g. GAE advantages.
        mask: (B, T) valid tokens; at least 2 (a variance needs two samples).
        shift_mean: subtract the mean (True) or keep it (False).
        eps: > 0, added to the variance.

    Returns:
        (B, T) float32, 0 on padding.

    Example:
        >>> w = whiten(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(1, 4))
        >>> [round(x, 4) for x in w[0].tolist()]
        [-1.1619, -0.3873, 0.3873, 1.1619]
    """
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    m = check_mask(mask, values.shape)
    x = _check_like("values", values, m)
    n = m.sum()
    if int(n) < 2:
        raise ValueError(f"mask must mark at least 2 tokens to whiten, got {int(n)}")
    mean = x.sum() / n
    var = torch.where(m, (x - mean) ** 2, 0.0).sum() / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0)
