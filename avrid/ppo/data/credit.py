"""Chapter 5 — a scored batch's credit: shaped scores, token rewards, then the advantages.

The driver calls `compute_advantages` once per step, after the reward, log-probs and values
have been added to the batch as columns. It does the parts that are about the BATCH (which
columns, truncated responses, the KL's place, the loss mask) and hands the math to the
estimator `algo.name` names (`algo/registry.py`), always through the same `AdvantageInputs`.
`shaped_scores` is shared with dynamic sampling (`dynamic_sampling.py`), which must filter on
the scores that will actually train.

Not here: the estimators' formulas (`algo/`), the reward itself (`roles/reward.py`).
"""

from __future__ import annotations

import torch

from avrid.dispatch import Batch
from avrid.ppo.algo.advantages import kl_penalized_rewards
from avrid.ppo.algo.losses import kl_estimate
from avrid.ppo.algo.registry import AdvantageInputs, estimate
from avrid.ppo.algo.shaping import overlong_penalty
from avrid.ppo.data.columns import add_columns, packed, padded, response_mask
from avrid.ppo.setup.config import PPOConfig


def shaped_scores(batch: Batch, config: PPOConfig, max_response: int | None) -> torch.Tensor:
    """(n,) float32: the task's scores with `algo.truncation`'s penalty and DAPO's overlong
    penalty applied (`algo/shaping.py`; it needs `max_response`, the response budget)."""
    a = config.algo
    scores = batch.scalars["score"].float()
    if a.truncation == "penalty":
        scores = scores - a.truncation_penalty * truncated(batch, a.truncation)
    if a.overlong_buffer > 0:
        if max_response is None:
            raise ValueError("algo.overlong_buffer > 0 needs the response budget "
                             "(max_response) to shape the scores")
        scores = scores + overlong_penalty(batch.response_lens, max_response=max_response,
                                           buffer=a.overlong_buffer,
                                           factor=a.overlong_penalty)
    return scores


def compute_advantages(batch: Batch, config: PPOConfig, *,
                       max_response: int | None = None) -> Batch:
    """Token rewards (shaped score at the last token, minus the KL if it goes in the reward),
    then the advantages of the estimator `algo.name` names.

    A truncated response (scalar "truncated" = 1: it hit the response budget without a stop
    token) is treated as `algo.truncation` says; with s_i its score and c the penalty:

        keep      s_i as it is; it trains like any other response
        penalty   s_i - c, before the KL, the estimator or the group statistics see it
        mask      s_i as it is, but loss_mask_i = 0: it weighs nothing in the actor and critic
                  losses and is not counted in their denominators (DAPO's overlong
                  filtering). It still counts in group statistics and whitening: it is a
                  sample of the policy like the others.

    `algo.overlong_buffer` > 0 adds DAPO's soft overlong penalty (needs `max_response`).
    Adds packed "advantages" (and "returns" when the estimator gives value targets: PPO's)
    and the scalar "loss_mask" (1 = the sample trains; read by `columns.sample_loss_mask`).
    """
    a = config.algo
    mask = response_mask(batch)
    scores = shaped_scores(batch, config, max_response)
    cut = truncated(batch, a.truncation)
    kept = {"loss_mask": 1.0 - cut if a.truncation == "mask" else torch.ones_like(scores)}
    kl = torch.zeros_like(mask)
    if a.kl_coef > 0 and a.kl_in == "reward":
        kl = kl_estimate(padded(batch, "old_logp"), padded(batch, "ref_logp"), a.kl_kind) * mask
    token_rewards = kl_penalized_rewards(scores, kl, mask, kl_coef=a.kl_coef)
    inputs = AdvantageInputs(
        # A KL in the reward lowers each response's outcome score by its summed KL.
        scores=scores - a.kl_coef * kl.sum(1), token_rewards=token_rewards,
        group_ids=batch.scalars["group"], mask=mask,
        values=padded(batch, "values") if a.uses_critic else None, algo=a)
    out = estimate(a.name, inputs)  # `algo/registry.py`: the estimator, its output checked
    columns = {"advantages": packed(out.advantages.detach().float(), mask)}
    if out.returns is not None:
        columns["returns"] = packed(out.returns.detach().float(), mask)
    return add_columns(batch, packed=columns, scalars=kept)


def truncated(batch: Batch, choice: str) -> torch.Tensor:
    """(n,) float32, 1 where the response was truncated (the batch's "truncated" column)."""
    column = batch.scalars.get("truncated")
    if column is None:
        if choice != "keep":  # "keep" ignores it, so hand-made batches may leave it out
            raise ValueError(f"algo.truncation={choice!r} needs the batch's per-sample "
                             f"'truncated' column (PolicyWorker.generate writes it); "
                             f"columns: {sorted(batch.scalars)}")
        return torch.zeros(len(batch))
    return column.float()
