"""Chapter 5 — the edge cases of the new estimators and losses, as fixed examples.

`test_ppo_estimators.py` compares RLOO, REINFORCE++-baseline and GSPO with verl's code on
batches Hypothesis draws; a rule that only a rare draw reaches (a prompt with one response,
a sequence whose log-ratio passes GSPO's cap) is checked there only when the draw happens to
hit it. Here each such rule is one fixed case, worked by hand:

- a group of one response has no baseline (RLOO: A = s; REINFORCE++-baseline: c = s, then
  whitened with the rest), with a non-zero score, so that "baseline 0" and "A = 0" differ;
- GSPO caps the sequence log-ratio at 10 before exp (verl's clamp): a log-ratio of 100
  gives the ratio e^10 and no gradient, not inf and nan.
"""

from __future__ import annotations

import math

import pytest
import torch

from avrid.ppo.algo.estimators import reinforce_pp_baseline_advantages, rloo_advantages
from avrid.ppo.algo.policy_losses import gspo_policy_loss

pytestmark = pytest.mark.chapter(5)

T = torch.tensor
TOL = dict(atol=1e-6, rtol=1e-6)


def test_rloo_a_group_of_one_response_keeps_its_score_beside_groups_of_two_and_three() -> None:
    # Group 7: 1 - 0 = 1, 0 - 1 = -1. Group 9 (alone): 3. Group 4: 2 - (5+8)/2 = -4.5,
    # 5 - (2+8)/2 = 0, 8 - (2+5)/2 = 4.5.
    scores = T([1.0, 0.0, 3.0, 2.0, 5.0, 8.0])
    a = rloo_advantages(scores, T([7, 7, 9, 4, 4, 4]), torch.ones(6, 1))
    assert a[:, 0].tolist() == [1.0, -1.0, 3.0, -4.5, 0.0, 4.5]


def test_reinforce_pp_baseline_a_group_of_one_response_is_centred_at_zero() -> None:
    # c = [0.5, -0.5, 3] (group 9 alone: no mean subtracted), one token each: mean 1,
    # deviations [-0.5, -1.5, 2], unbiased variance (0.25 + 2.25 + 4) / 2 = 3.25.
    a = reinforce_pp_baseline_advantages(T([1.0, 0.0, 3.0]), T([7, 7, 9]), torch.ones(3, 1))
    sd = math.sqrt(3.25 + 1e-8)
    torch.testing.assert_close(a[:, 0], T([-0.5 / sd, -1.5 / sd, 2.0 / sd]), **TOL)


@pytest.mark.parametrize("log_ratio, capped", [(100.0, True), (10.0, False), (9.5, False)])
def test_gspo_caps_the_sequence_log_ratio_at_ten(log_ratio: float, capped: bool) -> None:
    # A < 0: the unclipped term -A * s wins, so the loss is the ratio itself. Past the cap
    # it is e^10 with no gradient (verl's clamp); without the cap e^100 is inf in float32.
    logp = torch.full((1, 3), log_ratio, requires_grad=True)
    out = gspo_policy_loss(logp, torch.zeros(1, 3), torch.full((1, 3), -1.0),
                           torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
    want = math.exp(min(log_ratio, 10.0))
    torch.testing.assert_close(out.per_token, torch.full((1, 3), want), **TOL)
    out.per_token.sum().backward()
    grad = logp.grad
    assert torch.isfinite(grad).all()
    assert (grad == 0).all() == capped  # a capped ratio is a constant
