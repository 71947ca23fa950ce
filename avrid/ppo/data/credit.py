"""Chapter 5 — a scored batch's credit: shaped scores, token rewards, then the advantages.

The driver calls `compute_advantages` once per step, after the reward, log-probs and values
have been added to the batch as columns. It does the parts that are about the BATCH (which
columns, truncated responses, the KL's place, the loss mask) and hands the math to the
estimator `algo.name` names (`algo/registry.py`), always through the same `AdvantageInputs`.
`shaped_scores` is shared with dynamic sampling (`dynamic_sampling.py`), which must filter on
the scores that will actually train; `shaping_metrics` logs what its overlong penalty took.

With an "action_mask" column (chapter 7: a multi-turn response interleaves the policy's tokens
with observation tokens) the estimator runs on a COMPRESSED view (`ActionView`): per row only
its action tokens, right-padded, so every estimator, a user's included, sees the prefix mask
it always does. The score lands at the row's last action token, GAE's next value after an
action is the value at the NEXT ACTION token (verl's multi-turn GAE: an observation is not a
step of the policy), and the advantages and returns come back at the action positions, 0 on
observation tokens.

Not here: the estimators' formulas (`algo/`), the reward itself (`roles/reward.py`).
"""

from __future__ import annotations

import torch

from avrid.dispatch import Batch
from avrid.ppo.algo.advantages import kl_penalized_rewards
from avrid.ppo.algo.losses import kl_estimate
from avrid.ppo.algo.registry import AdvantageInputs, estimate
from avrid.ppo.algo.shaping import overlong_penalty
from avrid.ppo.data.columns import (
    ACTION_MASK,
    action_mask,
    add_columns,
    packed,
    padded,
    response_mask,
)
from avrid.ppo.setup.config import PPOConfig


def advantages_reads(config: PPOConfig) -> tuple[str, ...]:
    """The batch columns `compute_advantages` reads under `config`: the score, the truncation
    flag and the groups always, the log-probs when the KL goes in the reward, the values when
    the estimator uses a critic (plus "action_mask" when the batch has it)."""
    a = config.algo
    out = ("score", "truncated", "group")
    if a.kl_coef > 0 and a.kl_in == "reward":
        out += ("old_logp", "ref_logp")
    if a.uses_critic:
        out += ("values",)
    return out


def advantages_writes(config: PPOConfig) -> tuple[str, ...]:
    """The columns `compute_advantages` adds under `config`: "advantages" and "loss_mask",
    and the value targets "returns" for an estimator with a critic (PPO's GAE)."""
    return ("advantages", "loss_mask") + (("returns",) if config.algo.uses_critic else ())


def shaped_scores(batch: Batch, config: PPOConfig, max_response: int | None) -> torch.Tensor:
    """(n,) float32: the task's scores with `algo.truncation`'s penalty and DAPO's overlong
    penalty applied (`algo/shaping.py`; it needs `max_response`, the response budget).
    The overlong penalty reads `response_lens`, every response token (observation tokens
    included): it is about the length of the whole trajectory, which is what the budget
    bounds."""
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


def shaping_metrics(batch: Batch, config: PPOConfig,
                    max_response: int | None) -> dict[str, float]:
    """What `shaped_scores`' overlong penalty took off the step's scores, as a metric:
    ``reward/overlong_penalty``, its mean over the responses (<= 0), when
    `algo.overlong_buffer` > 0; nothing otherwise. `train/reward` is the task's score before
    it, so the two side by side show what the penalty costs."""
    a = config.algo
    if a.overlong_buffer <= 0 or max_response is None or not len(batch):
        return {}
    penalty = overlong_penalty(batch.response_lens, max_response=max_response,
                               buffer=a.overlong_buffer, factor=a.overlong_penalty)
    return {"reward/overlong_penalty": float(penalty.mean())}


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
    With an "action_mask" column the estimator sees the action tokens only (`ActionView`;
    the KL, the values and the score's place are taken there) and observation tokens get
    advantage and return 0; a row without any action token gets 0 everywhere.
    """
    a = config.algo
    mask = response_mask(batch)
    view = ActionView(action_mask(batch)) if ACTION_MASK in batch.packed else None
    at = view.compress if view is not None else (lambda t: t)
    actions = view.mask if view is not None else mask
    scores = shaped_scores(batch, config, max_response)
    cut = truncated(batch, a.truncation)
    kept = {"loss_mask": 1.0 - cut if a.truncation == "mask" else torch.ones_like(scores)}
    kl = torch.zeros_like(actions)
    if a.kl_coef > 0 and a.kl_in == "reward":
        kl = kl_estimate(at(padded(batch, "old_logp")), at(padded(batch, "ref_logp")),
                         a.kl_kind) * actions
    token_rewards = kl_penalized_rewards(scores, kl, actions, kl_coef=a.kl_coef)
    inputs = AdvantageInputs(
        # A KL in the reward lowers each response's outcome score by its summed KL.
        scores=scores - a.kl_coef * kl.sum(1), token_rewards=token_rewards,
        group_ids=batch.scalars["group"], mask=actions,
        values=at(padded(batch, "values")) if a.uses_critic else None, algo=a)
    out = estimate(a.name, inputs)  # `algo/registry.py`: the estimator, its output checked
    back = view.expand if view is not None else (lambda t: t)
    columns = {"advantages": packed(back(out.advantages.detach().float()), mask)}
    if out.returns is not None:
        columns["returns"] = packed(back(out.returns.detach().float()), mask)
    return add_columns(batch, packed=columns, scalars=kept)


class ActionView:
    """The action tokens of (n, T) response tensors, compressed to the left of each row.

    Row i's k-th action token (the k-th 1 of `actions[i]`) sits at column k of the compressed
    (n, K) tensors, K = the most action tokens of any row; the rest is right padding, so
    `mask` is a prefix mask, what the estimators expect. `expand` puts compressed values back
    at their response positions, 0 on observation tokens and padding.

    Example (one row [a a o o a]):
        >>> v = ActionView(torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]]))
        >>> v.compress(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])).tolist(), v.mask.tolist()
        ([[1.0, 2.0, 5.0]], [[1.0, 1.0, 1.0]])
        >>> v.expand(torch.tensor([[7.0, 8.0, 9.0]])).tolist()
        [[7.0, 8.0, 0.0, 0.0, 9.0]]
    """

    def __init__(self, actions: torch.Tensor) -> None:
        self.actions = actions.bool()
        counts = self.actions.sum(1)
        width = int(counts.max()) if len(counts) else 0
        self.mask = (torch.arange(width, device=actions.device) < counts[:, None]).float()
        """(n, K) float32 prefix mask of the compressed rows."""

    def compress(self, full: torch.Tensor) -> torch.Tensor:
        """(n, T) -> (n, K): each row's values at its action tokens, in order, then 0."""
        out = torch.zeros(self.mask.shape, dtype=full.dtype, device=full.device)
        # Both boolean selections walk row-major: the k-th action of row i meets column k.
        out[self.mask.bool()] = full[self.actions]
        return out

    def expand(self, compressed: torch.Tensor) -> torch.Tensor:
        """(n, K) -> (n, T): the inverse of `compress`, 0 off the action tokens."""
        out = torch.zeros(self.actions.shape, dtype=compressed.dtype, device=compressed.device)
        out[self.actions] = compressed[self.mask.bool()]
        return out


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
