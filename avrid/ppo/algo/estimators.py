"""Chapter 5 — three more critic-free advantage estimators: RLOO, REINFORCE++ and
REINFORCE++-baseline, each equal to verl 0.9.1's (`verl/trainer/ppo/core_algos.py`).

`advantages.py` holds GAE (with a critic) and GRPO (group-normalised scores). The estimators
here differ in their baseline, the number subtracted from a response's reward so that the
gradient's variance drops without biasing it:

- RLOO: the mean score of the OTHER responses to the same prompt (leave-one-out).
- REINFORCE++: no per-prompt baseline at all; the discounted return of each token (the KL
  penalty paid at every token is part of the reward) is whitened over the whole batch.
- REINFORCE++-baseline: the group mean is subtracted, then the result whitened over the batch.

Conventions are those of `advantages.py`: right-padded (B, T) tensors over response tokens, a
`mask` for the valid ones, float32 math, padding never read and returned as 0. Outcome scores
are (B,) one per response; `group_ids` (B,) integers mark the responses to the same prompt.

There is no name -> function registry here: these take (scores, group_ids, mask) or
(token_rewards, mask) and GAE takes values as well, so a uniform signature is a question for
the config wiring, not for the math. This file is pure tensor math; no models, no Ray.
"""

from __future__ import annotations

import torch

from avrid.ppo.algo.advantages import check_groups, check_mask, whiten


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Validate outcome inputs (`check_groups`, and finite scores); return (mask as bool,
    scores float32, per-response group sum, per-response group size), the last two gathered
    back to shape (B,)."""
    m, s, inv = check_groups(scores, group_ids, mask)
    if not bool(torch.isfinite(s).all()):
        raise ValueError("scores must be finite")
    n = torch.bincount(inv).float()
    total = torch.zeros_like(n).index_add_(0, inv, s)
    return m, s, total[inv], n[inv]


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """RLOO, REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024,
    "Back to Basics", arXiv 2402.14740): each response's baseline is its siblings' mean score.

        A_i = s_i - (sum_{j in g, j != i} s_j) / (n_g - 1)  =  n_g / (n_g - 1) * (s_i - mean_g)

    The baseline does not depend on s_i, so the gradient stays unbiased (GRPO's mean_g includes
    s_i itself, and its std division rescales each prompt). A group of one response has no
    sibling: its baseline is 0, A_i = s_i (plain REINFORCE), as in verl. With all-equal scores
    every A_i is 0.

    verl computes the score as token_level_rewards.sum(-1); with the KL penalty in the reward
    pass that row sum (score - kl_coef * sum_t kl_t) as `scores`.

    Args:
        scores: (B,) one score per response (finite).
        group_ids: (B,) integer; equal ids mark responses to the same prompt.
        mask: (B, T) valid response tokens; A_i is broadcast over row i's.

    Returns:
        (B, T) float32 advantages, 0 on padding. An empty row still counts in its group.

    Example:
        >>> a = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0]),
        ...                     torch.tensor([0, 0, 0, 1]), torch.ones(4, 1))
        >>> a[:, 0].tolist()
        [1.0, -0.5, -0.5, 2.0]
    """
    m, s, total, n = _group_stats(scores, group_ids, mask)
    others = (total - s) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, s - others, s)
    return torch.where(m, adv.unsqueeze(1), 0.0)


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, *,
                            gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): discounted return per token, whitened
    over every valid token of the batch; no critic and no per-prompt baseline.

        G_t = r_t + gamma * G_{t'}       t' the next VALID token of the row (G after the last = 0)
        A   = whiten(G)                  mean and unbiased variance over all valid tokens

    `token_rewards` is where the KL penalty goes: with `advantages.kl_penalized_rewards` each
    token pays -kl_coef * kl_t and the last one also earns the score, so G_t is the score minus
    the KL still to be paid from t on. The batch-wide whitening is the paper's stand-in for a
    baseline; it makes the step size independent of the reward scale.

    Positions where the mask is 0 are skipped (the return is carried over them undiscounted),
    as verl 0.9.1 does for observation tokens inside a multi-turn row; with right padding that
    only means padding adds nothing.

    Args:
        token_rewards: (B, T) reward at each response token (finite on valid tokens).
        mask: (B, T) valid response tokens, at least 2 in the batch (a variance needs two).
        gamma: discount in [0, 1]; 1 for the usual LLM setting.

    Returns:
        (B, T) float32 advantages, 0 on padding. They carry no gradient. (verl also returns
        the unwhitened G as "returns"; without a critic nothing reads them, so avrid does not.)

    Example:
        >>> a = reinforce_pp_advantages(torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
        ...                             torch.tensor([[1, 1], [1, 0]]))
        >>> [round(x, 4) for x in a.flatten().tolist()]  # G = [1, 1, 0]: mean 2/3, std 0.5774
        [0.5774, 0.5774, -1.1547, 0.0]
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    m = check_mask(mask, token_rewards.shape)
    # where, not multiply: inf * 0 is nan; padding must never be read.
    r = torch.where(m, token_rewards.detach().float(), 0.0)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("token_rewards must be finite on valid tokens")
    returns = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    # T is the response length, so a Python loop is fine (as in `gae`).
    for t in reversed(range(r.shape[1])):
        step = r[:, t] + gamma * running
        returns[:, t] = torch.where(m[:, t], step, 0.0)
        running = torch.where(m[:, t], step, running)
    return whiten(returns, m)


def reinforce_pp_baseline_advantages(scores: torch.Tensor, group_ids: torch.Tensor,
                                     mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): subtract the group mean, then
    whiten over every valid token of the batch.

        c_i = s_i - mean_g          (mean_g = 0 for a group of one response, as in verl)
        A   = whiten(c_i broadcast over row i's valid tokens)

    Unlike GRPO the scale comes from the whole batch, not from each prompt's std, so a prompt
    whose few responses happen to agree is not blown up by a tiny std. The whitening is over
    TOKENS: a long response weighs more in the batch mean and variance, exactly as in verl.
    The KL term may go in the loss (pass the task score) or in the reward: verl sums its
    token_level_rewards into the score, so with KL in the reward pass that row sum as `scores`.

    Args:
        scores: (B,) one score per response (finite).
        group_ids: (B,) integer; equal ids mark responses to the same prompt.
        mask: (B, T) valid response tokens, at least 2 in the batch. An empty row still counts
            in its group's mean but not in the whitening.

    Returns:
        (B, T) float32 advantages, 0 on padding. All-equal scores give all zeros.

    Example:
        >>> a = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0]),
        ...                                      torch.tensor([7, 7]), torch.ones(2, 1))
        >>> [round(x, 4) for x in a[:, 0].tolist()]  # c = [0.5, -0.5], std 0.7071
        [0.7071, -0.7071]
    """
    m, s, total, n = _group_stats(scores, group_ids, mask)
    centred = torch.where(n > 1, s - total / n, s)
    return whiten(torch.where(m, centred.unsqueeze(1), 0.0), m)
