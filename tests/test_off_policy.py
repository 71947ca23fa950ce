"""Chapter 6 off-policy correction (avrid.ppo.algo.off_policy) against numbers worked by hand.

As in test_ppo_math.py, every expected value is derived in the comment next to it, on paper.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from avrid.ppo.algo.losses import policy_loss
from avrid.ppo.algo.off_policy import (
    CORRECTIONS,
    ImportanceWeights,
    importance_weights,
    weight_stats,
)

pytestmark = pytest.mark.chapter(6)

T = torch.tensor
INF = math.inf

# Ragged (2, 3) batch: row 0 has 3 valid tokens, row 1 has 2.
MASK = T([[1, 1, 1], [1, 1, 0]])
# Behaviour probabilities mu and proximal probabilities pi_prox of the sampled tokens:
#   row 0: pi_prox / mu = 0.2/0.4 = 0.5, 0.5/0.5 = 1, 0.6/0.2 = 3
#   row 1: pi_prox / mu = 0.6/0.4 = 1.5, 0.4/0.1 = 4
# i.e. log-ratios ln 0.5, 0, ln 3, ln 1.5, ln 4. Padding holds +inf / -inf: it must never be
# read (inf - (-inf) would be inf, and inf * 0 nan).
MU = T([[0.4, 0.5, 0.2], [0.4, 0.1, 1.0]])
PROX = T([[0.2, 0.5, 0.6], [0.6, 0.4, 1.0]])
ROLLOUT_LOGP = torch.where(MASK.bool(), MU.log(), T(-INF))
OLD_LOGP = torch.where(MASK.bool(), PROX.log(), T(INF))
RAW = [[0.5, 1.0, 3.0], [1.5, 4.0, 0.0]]  # padding 0
CAP = 2.0


def close(actual: torch.Tensor, expected, tol: float = 1e-5) -> None:
    want = T(expected, dtype=torch.float32)
    assert actual.shape == want.shape, (actual.shape, want.shape)
    assert actual.dtype == torch.float32, actual.dtype
    assert torch.allclose(actual, want, atol=tol, rtol=0.0), (actual, want)


def weights_of(correction: str, mask: torch.Tensor = MASK) -> ImportanceWeights:
    return importance_weights(OLD_LOGP, ROLLOUT_LOGP, mask, correction=correction, cap=CAP)


# ---------------------------------------------------------------- each mode, by hand


@pytest.mark.parametrize("mask", [MASK, MASK.float(), MASK.bool()], ids=["int", "float", "bool"])
def test_none_is_one_on_valid_tokens_and_ignores_the_behaviour_policy(mask):
    iw = weights_of("none", mask)
    assert torch.equal(iw.weights, T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    # The raw ratio is still reported: the mismatch is worth logging even when not corrected.
    close(iw.raw_ratio, RAW)
    assert iw.capped.dtype == torch.bool
    assert not iw.capped.any()


@pytest.mark.parametrize("mask", [MASK, MASK.float(), MASK.bool()], ids=["int", "float", "bool"])
def test_tis_truncates_ratios_above_the_cap(mask):
    # C = 2: min(0.5, 2) = 0.5, min(1, 2) = 1, min(3, 2) = 2; min(1.5, 2) = 1.5, min(4, 2) = 2.
    iw = weights_of("tis", mask)
    close(iw.weights, [[0.5, 1.0, 2.0], [1.5, 2.0, 0.0]])
    close(iw.raw_ratio, RAW)
    # Capped where rho > 2: 3 and 4. Padding: False.
    assert iw.capped.tolist() == [[False, False, True], [False, True, False]]


@pytest.mark.parametrize("mask", [MASK, MASK.float(), MASK.bool()], ids=["int", "float", "bool"])
def test_decoupled_drops_ratios_above_the_cap(mask):
    # C = 2: 0.5 and 1 and 1.5 kept as they are; 3 and 4 exceed 2 and become 0 (dropped).
    iw = weights_of("decoupled", mask)
    close(iw.weights, [[0.5, 1.0, 0.0], [1.5, 0.0, 0.0]])
    close(iw.raw_ratio, RAW)
    assert iw.capped.tolist() == [[False, False, True], [False, True, False]]


def test_a_cap_above_every_ratio_makes_tis_and_decoupled_equal_to_the_raw_ratio():
    # C = 5 > 4, the largest ratio: nothing is truncated or dropped.
    for correction in ("tis", "decoupled"):
        iw = importance_weights(OLD_LOGP, ROLLOUT_LOGP, MASK, correction=correction, cap=5.0)
        close(iw.weights, RAW)
        assert not iw.capped.any()


def test_decoupled_loss_is_the_decoupled_ppo_objective_by_hand():
    # One row, two tokens, eps = 0.2. mu = 0.25, pi_prox = 0.5 -> rho = 2 (cap 3, kept);
    # pi_theta = 0.75 -> r = 1.5, clip(r) = 1.2.
    #   A = +1: min(r A, clip(r) A) = min(1.5, 1.2) = 1.2    -> term = 2 * 1.2  = 2.4
    #   A = -1: min(-1.5, -1.2) = -1.5                       -> term = 2 * -1.5 = -3.0
    # The loss is minus the objective: [-2.4, 3.0].
    mask = torch.ones(1, 2)
    rollout, old, logp = (torch.full((1, 2), p).log() for p in (0.25, 0.5, 0.75))
    adv = T([[1.0, -1.0]])
    iw = importance_weights(old, rollout, mask, correction="decoupled", cap=3.0)
    loss = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2).per_token * iw.weights
    close(loss, [[-2.4, 3.0]])


# ---------------------------------------------------------------- on-policy: exactly plain PPO


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_every_mode_is_exactly_one_when_behaviour_equals_proximal(correction):
    torch.manual_seed(0)
    old = -torch.rand(2, 3) * 5  # arbitrary log-probs in (-5, 0]
    logp = old + 0.3 * torch.randn(2, 3)
    adv = torch.randn(2, 3)
    # exp(0) is exactly 1, and the cap (>= 1) never bites on 1: w = 1 bit for bit.
    iw = importance_weights(old, old.clone(), MASK, correction=correction, cap=1.0)
    ones = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert torch.equal(iw.weights, ones)
    assert torch.equal(iw.raw_ratio, ones)
    assert not iw.capped.any()
    per_token = policy_loss(logp, old, adv, MASK, clip_low=0.2, clip_high=0.28).per_token
    assert per_token.abs().sum() > 0  # the equality below is not between two zero matrices
    assert torch.equal(per_token * iw.weights, per_token)


# ---------------------------------------------------------------- detached


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_weights_are_detached_and_gradient_flows_through_the_ratio_only(correction):
    # Inputs that all require grad, with logp = old_logp so r = 1 (inside the clip):
    #   L_t = -A_t * r_t * w_t  ->  dL/dlogp_t = -A_t * r_t * w_t = -A_t * w_t.
    # With w from the hand example (C = 2) and A = [[1, 2, -1], [3, -2, pad]]:
    #   none:      -A * [1, 1, 1 | 1, 1]         = [[-1, -2, 1], [-3, 2, 0]]
    #   tis:       -A * [0.5, 1, 2 | 1.5, 2]     = [[-0.5, -2, 2], [-4.5, 4, 0]]
    #   decoupled: -A * [0.5, 1, 0 | 1.5, 0]     = [[-0.5, -2, 0], [-4.5, 0, 0]]
    want = {"none": [[-1.0, -2.0, 1.0], [-3.0, 2.0, 0.0]],
            "tis": [[-0.5, -2.0, 2.0], [-4.5, 4.0, 0.0]],
            "decoupled": [[-0.5, -2.0, 0.0], [-4.5, 0.0, 0.0]]}[correction]
    old = torch.where(MASK.bool(), PROX.log(), 0.0).requires_grad_()
    rollout = torch.where(MASK.bool(), MU.log(), 0.0).requires_grad_()
    logp = old.detach().clone().requires_grad_()
    adv = T([[1.0, 2.0, -1.0], [3.0, -2.0, 0.0]])
    iw = importance_weights(old, rollout, MASK, correction=correction, cap=CAP)
    for t in (iw.weights, iw.raw_ratio):
        assert t.requires_grad is False and t.grad_fn is None
    per_token = policy_loss(logp, old, adv, MASK, clip_low=0.2, clip_high=0.2).per_token
    (per_token * iw.weights).sum().backward()
    close(logp.grad, want)
    # Neither the proximal nor the behaviour log-probs receive any gradient through w.
    assert old.grad is None and rollout.grad is None


# ---------------------------------------------------------------- robustness


def test_an_absurd_log_ratio_stays_finite():
    # Log-ratios +1000 and -1000 are clamped to +-20: rho = e^20 = 4.85e8 and e^-20 = 2.06e-9.
    old, rollout, mask = T([[0.0, -1000.0]]), T([[-1000.0, 0.0]]), torch.ones(1, 2)
    big, small = math.exp(20.0), math.exp(-20.0)
    tis = importance_weights(old, rollout, mask, correction="tis", cap=2.0)
    dec = importance_weights(old, rollout, mask, correction="decoupled", cap=2.0)
    for iw in (tis, dec):
        assert torch.isfinite(iw.weights).all() and torch.isfinite(iw.raw_ratio).all()
        assert torch.allclose(iw.raw_ratio, T([[big, small]]), rtol=1e-5, atol=0.0)
        assert iw.capped.tolist() == [[True, False]]
    assert torch.allclose(tis.weights, T([[2.0, small]]), rtol=1e-5, atol=0.0)  # truncated
    assert torch.allclose(dec.weights, T([[0.0, small]]), rtol=1e-5, atol=0.0)  # dropped
    # Even with a cap past the clamp, tis weights are e^20 at most, not inf.
    huge = importance_weights(old, rollout, mask, correction="tis", cap=1e30)
    assert torch.allclose(huge.weights, T([[big, small]]), rtol=1e-5, atol=0.0)
    assert not huge.capped.any()


def test_low_precision_inputs_give_float32():
    iw = importance_weights(OLD_LOGP.bfloat16(), ROLLOUT_LOGP.bfloat16(), MASK,
                            correction="tis", cap=CAP)
    assert iw.weights.dtype == iw.raw_ratio.dtype == torch.float32
    # bf16 keeps ~3 significant digits of the log-probs: the ratios survive to ~1e-2.
    close(iw.weights, [[0.5, 1.0, 2.0], [1.5, 2.0, 0.0]], tol=2e-2)


# ---------------------------------------------------------------- bad inputs


def test_unknown_correction_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="correction must be one of") as err:
        importance_weights(OLD_LOGP, ROLLOUT_LOGP, MASK, correction="is", cap=CAP)
    assert all(repr(c) in str(err.value) for c in CORRECTIONS), str(err.value)
    assert "'is'" in str(err.value)


@pytest.mark.parametrize("cap", [0.5, 0.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_cap_must_be_finite_and_at_least_one(correction, cap):
    with pytest.raises(ValueError, match=re.escape("cap must be a finite number >= 1")):
        importance_weights(OLD_LOGP, ROLLOUT_LOGP, MASK, correction=correction, cap=cap)


def test_cap_of_exactly_one_is_allowed():
    # C = 1: tis weights min(rho, 1) = [0.5, 1, 1 | 1, 1]; only rho > 1 is capped (3, 1.5, 4).
    iw = importance_weights(OLD_LOGP, ROLLOUT_LOGP, MASK, correction="tis", cap=1.0)
    close(iw.weights, [[0.5, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert iw.capped.tolist() == [[False, False, True], [True, True, False]]


def test_shape_mismatches_name_the_input():
    with pytest.raises(ValueError, match=re.escape("rollout_logp must have shape (2, 3), "
                                                   "got (2, 2)")):
        importance_weights(OLD_LOGP, ROLLOUT_LOGP[:, :2], MASK, correction="tis", cap=CAP)
    with pytest.raises(ValueError, match=re.escape("mask must have shape (2, 3)")):
        importance_weights(OLD_LOGP, ROLLOUT_LOGP, MASK[:1], correction="tis", cap=CAP)
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        importance_weights(OLD_LOGP, ROLLOUT_LOGP, MASK * 2, correction="tis", cap=CAP)
    iw = weights_of("tis")
    with pytest.raises(ValueError, match=re.escape("mask must have shape (2, 3)")):
        weight_stats(iw, MASK[:, :2])


# ---------------------------------------------------------------- metrics


def test_weight_stats_by_hand():
    # Valid raw ratios 0.5, 1, 3, 1.5, 4: mean 10 / 5 = 2, max 4.
    # tis and decoupled cap 3 and 4: 2 of 5 tokens = 0.4; none caps nothing.
    for correction, capped_frac in (("none", 0.0), ("tis", 0.4), ("decoupled", 0.4)):
        stats = weight_stats(weights_of(correction), MASK)
        assert set(stats) == {"is_weight_mean", "is_weight_max", "is_capped_frac"}
        assert all(type(v) is float for v in stats.values())
        assert stats["is_weight_mean"] == pytest.approx(2.0, abs=1e-5)
        assert stats["is_weight_max"] == pytest.approx(4.0, abs=1e-5)
        assert stats["is_capped_frac"] == pytest.approx(capped_frac, abs=1e-7)
    # Over a narrower mask (row 0 only): ratios 0.5, 1, 3 -> mean 1.5, max 3, capped 1/3.
    row0 = T([[1, 1, 1], [0, 0, 0]])
    stats = weight_stats(weights_of("tis"), row0)
    assert stats == pytest.approx({"is_weight_mean": 1.5, "is_weight_max": 3.0,
                                   "is_capped_frac": 1 / 3}, abs=1e-5)


def test_weight_stats_of_an_all_padding_batch_are_zeros_not_nan():
    empty = torch.zeros(2, 3)
    iw = weights_of("decoupled", empty)
    assert torch.equal(iw.weights, torch.zeros(2, 3))
    assert torch.equal(iw.raw_ratio, torch.zeros(2, 3))
    assert not iw.capped.any()
    assert weight_stats(iw, empty) == {"is_weight_mean": 0.0, "is_weight_max": 0.0,
                                       "is_capped_frac": 0.0}
