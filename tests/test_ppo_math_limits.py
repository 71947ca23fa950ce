"""Chapter 5 — the RL math at its limits: absurd log-ratios, exponents past float32, a batch
with no variance, targets handed in with gradient.

`test_ppo_math.py` pins the formulas on ordinary numbers; these pin the guards around them
(the clamps, the eps, the detaches), each of which a mutation check
(`benchmarks/mutants.py`) found could be removed without any test noticing. As there,
every expected value is worked out in the comment next to it.
"""

from __future__ import annotations

import math

import pytest
import torch

from avrid.ppo.algo.advantages import whiten
from avrid.ppo.algo.losses import kl_estimate, policy_loss, value_loss
from tests.test_ppo_math import MASK_31, T, close

pytestmark = pytest.mark.chapter(5)


def test_policy_loss_an_absurd_log_ratio_stays_finite():
    # A stale old_logp 100 nats below logp: exp(100) is inf in float32, so the log-ratio is
    # clamped at 20. With A = -1 and no dual clip, L = -A * max(r, clip(r)) = e^20 = 4.85e8,
    # finite; past the clamp its gradient is 0 (not inf * 0 = nan). The second token, ratio
    # 1 and A = 1, has L = -r and gradient -1.
    lp = T([[0.0, -0.5]], requires_grad=True)
    out = policy_loss(lp, T([[-100.0, -0.5]]), T([[-1.0, 1.0]]), torch.ones(1, 2),
                      clip_low=0.2, clip_high=0.2)
    assert out.per_token[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    out.per_token.sum().backward()
    close(lp.grad, [[0.0, -1.0]])


def test_value_loss_gradient_flows_through_the_values_only():
    # The old values and the returns are targets: even handed in with grad, they get none.
    v = T([[2.0, 2.0]], requires_grad=True)
    old, ret = T([[1.0, 1.0]], requires_grad=True), T([[1.5, 3.0]], requires_grad=True)
    for clip in (0.2, None):
        value_loss(v, old, ret, torch.ones(1, 2), clip=clip).per_token.sum().backward()
        assert old.grad is None and ret.grad is None, clip


def test_k3_gradient_stays_finite_far_beyond_the_cap():
    # d = logp - ref = -100: exp(100) is inf in float32. The value is capped at 10 (zero
    # gradient there); the inner clamp keeps exp finite so that zero is 0, not 0 * inf = nan.
    logp = T([[-100.0, 0.0]], requires_grad=True)
    kl = kl_estimate(logp, T([[0.0, 0.5]]), "k3")
    assert kl[0, 0].item() == 10.0
    kl.sum().backward()
    # d/dlogp k3 = 1 - exp(-d) at d = -0.5: 1 - e^0.5 = -0.6487
    close(logp.grad, [[0.0, 1.0 - math.exp(0.5)]])


def test_whiten_of_a_constant_batch_is_zero_not_nan():
    # var = 0: eps keeps 1 / sqrt(var + eps) finite, and (x - mean) = 0 makes the result 0.
    assert torch.equal(whiten(torch.full((2, 3), 3.0), MASK_31), torch.zeros(2, 3))

