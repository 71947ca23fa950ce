"""Chapter 5 RL math (avrid.ppo.algo.advantages, .losses) against numbers worked by hand.

Every expected value below is derived in the comment next to it, on paper, not by running the
code: the point is to pin the formulas, not to snapshot whatever the code happens to return.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from avrid.ppo.algo.advantages import check_mask, gae, grpo_advantages, kl_penalized_rewards, whiten
from avrid.ppo.algo.losses import (
    AGG_MODES,
    KL_KINDS,
    aggregate,
    kl_estimate,
    policy_loss,
    token_weights,
    value_loss,
)

pytestmark = pytest.mark.chapter(5)

T = torch.tensor
ONES3 = torch.ones(1, 3)
# Two rows of different valid lengths: 3 and 1 tokens.
MASK_31 = T([[1, 1, 1], [1, 0, 0]])


def close(actual: torch.Tensor, expected, tol: float = 1e-4) -> None:
    want = T(expected, dtype=torch.float32)
    assert actual.shape == want.shape, (actual.shape, want.shape)
    assert torch.allclose(actual.detach().float(), want, atol=tol, rtol=0.0), (actual, want)


def frac(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of valid tokens where `flags` is set (a clip fraction)."""
    return float(flags.sum() / mask.bool().sum())


def poison(x: torch.Tensor, mask: torch.Tensor, value: float = 1e9) -> torch.Tensor:
    """x with every padding position replaced by `value`."""
    return torch.where(mask.bool(), x, T(value))


# ---------------------------------------------------------------- GAE


def test_gae_gamma1_lam1_is_reward_to_go_minus_value():
    # r = [0, 0, 1]: reward-to-go is 1 at every token; A = 1 - V; returns = A + V = 1.
    adv, ret = gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), ONES3, gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_hand_worked_half_half_with_ragged_rows():
    # gamma = lam = 0.5, so gamma*lam = 0.25.
    # Row 0: r = [1, 0, 2], V = [1, 2, 1], 3 valid tokens.
    #   d2 = 2 + 0.5*0 - 1 = 1            A2 = 1
    #   d1 = 0 + 0.5*1 - 2 = -1.5         A1 = -1.5 + 0.25*1     = -1.25
    #   d0 = 1 + 0.5*2 - 1 = 1            A0 =  1   + 0.25*-1.25 = 0.6875
    #   returns = A + V = [1.6875, 0.75, 2]
    # Row 1: r = [0, 3, pad], V = [2, 1, pad], 2 valid tokens (V after the last one is 0).
    #   d1 = 3 + 0 - 1 = 2                A1 = 2
    #   d0 = 0 + 0.5*1 - 2 = -1.5         A0 = -1.5 + 0.25*2 = -1
    #   returns = [1, 3, 0]
    r = T([[1.0, 0.0, 2.0], [0.0, 3.0, 5.0]])
    v = T([[1.0, 2.0, 1.0], [2.0, 1.0, 7.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(r, v, mask, gamma=0.5, lam=0.5)
    close(adv, [[0.6875, -1.25, 1.0], [-1.0, 2.0, 0.0]])
    close(ret, [[1.6875, 0.75, 2.0], [1.0, 3.0, 0.0]])
    # Padding never leaks in, not even 1e9 (or a row of zero valid tokens next to them).
    adv2, ret2 = gae(poison(r, mask), poison(v, mask), mask, gamma=0.5, lam=0.5)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_gae_lam0_is_one_step_td_error():
    # lam = 0: A_t = delta_t. gamma = 1, r = [0, 1], V = [0.5, 0.25]:
    #   d1 = 1 - 0.25 = 0.75; d0 = 0 + 0.25 - 0.5 = -0.25.
    adv, _ = gae(T([[0.0, 1.0]]), T([[0.5, 0.25]]), torch.ones(1, 2), gamma=1.0, lam=0.0)
    close(adv, [[-0.25, 0.75]])


# ---------------------------------------------------------------- GRPO


def test_grpo_std_normalised_and_dr_grpo():
    # Scores [1, 0, 0, 1], one group: mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3,
    # std = 0.57735; A = +-0.5 / 0.57735 = +-0.8660. Dr.GRPO skips the division: +-0.5.
    s, g = T([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long)
    mask = T([[1, 1], [1, 1], [1, 0], [0, 0]])
    a = grpo_advantages(s, g, mask)
    close(a, [[0.8660, 0.8660], [-0.8660, -0.8660], [-0.8660, 0.0], [0.0, 0.0]])
    # The empty last row still counted in the group's statistics (else the others would move).
    d = grpo_advantages(s, g, mask, norm_by_std=False)
    close(d, [[0.5, 0.5], [-0.5, -0.5], [-0.5, 0.0], [0.0, 0.0]])


def test_grpo_several_groups_singletons_and_ties():
    # ids [7, 7, 3, 3, 9], scores [1, 3, 5, 5, 2]:
    #   group 7: mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt 2 -> -+1/sqrt2 = -+0.7071
    #   group 3: all equal -> 0; group 9: a single response -> 0.
    a = grpo_advantages(T([1.0, 3.0, 5.0, 5.0, 2.0]), T([7, 7, 3, 3, 9]), torch.ones(5, 1))
    close(a[:, 0], [-0.7071, 0.7071, 0.0, 0.0, 0.0])


# ---------------------------------------------------------------- KL in reward, whitening


def test_kl_penalized_rewards_puts_score_on_last_valid_token():
    # coef 0.5: row 0 = -0.5*[0.1, 0.2, 0.3] + [0, 0, 1] = [-0.05, -0.1, 0.85]
    #           row 1 = -0.5*[0.4] + [2] = [1.8], then padding 0.
    kl = T([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    out = kl_penalized_rewards(T([1.0, 2.0]), kl, MASK_31, kl_coef=0.5)
    close(out, [[-0.05, -0.1, 0.85], [1.8, 0.0, 0.0]])
    assert torch.equal(out, kl_penalized_rewards(T([1.0, 2.0]), poison(kl, MASK_31),
                                                 MASK_31, kl_coef=0.5))


def test_whiten_masked_unbiased():
    # Valid values 1, 2, 3, 4: mean 2.5; unbiased var = (2.25 + .25 + .25 + 2.25) / 3 = 5/3;
    # 1/std = sqrt(0.6) = 0.774597 -> [-1.5, -0.5, 0.5, 1.5] * 0.774597.
    x = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    w = whiten(x, MASK_31)
    close(w, [[-1.1619, -0.3873, 0.3873], [1.1619, 0.0, 0.0]])
    # shift_mean=False adds the mean 2.5 back on valid tokens only.
    close(whiten(x, MASK_31, shift_mean=False), [[1.3381, 2.1127, 2.8873], [3.6619, 0.0, 0.0]])
    assert torch.equal(w, whiten(poison(x, MASK_31), MASK_31))


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_values():
    # d = logp - ref = +1 and -1.
    #   k1 = d = [1, -1];  k2 = d^2 / 2 = [0.5, 0.5]
    #   k3 = e^-d + d - 1 = [e^-1 + 1 - 1, e^1 - 1 - 1] = [0.36788, 0.71828]
    lp, ref = T([[0.0, -1.0]]), T([[-1.0, 0.0]])
    close(kl_estimate(lp, ref, "k1"), [[1.0, -1.0]])
    close(kl_estimate(lp, ref, "k2"), [[0.5, 0.5]])
    close(kl_estimate(lp, ref, "k3"), [[math.exp(-1), math.e - 2]])
    assert KL_KINDS == ("k1", "k2", "k3")


def test_k3_is_non_negative_and_zero_at_equal_policies():
    g = torch.Generator().manual_seed(0)
    lp, ref = -5 * torch.rand(8, 16, generator=g), -5 * torch.rand(8, 16, generator=g)
    assert (kl_estimate(lp, ref, "k3") >= 0).all()
    assert (kl_estimate(lp, lp, "k3") == 0).all()
    assert torch.isfinite(kl_estimate(T([[0.0]]), T([[-1e9]]), "k3")).all()  # clamped


def test_k3_value_is_capped_at_10_like_verl():
    # verl's low_var_kl: x = clamp(-d, -20, 20); k3 = clamp(e^x - x - 1, -10, 10).
    #   d = -15 (ref likes the token e^15 times more): e^15 - 15 - 1 = 3269001.4  -> 10
    #   d = +15:                                        e^-15 + 15 - 1 = 14.0000003 -> 10
    #   d = -2:                                         e^2 - 2 - 1    = 4.389056 (below the cap)
    #   d = +2:                                         e^-2 + 2 - 1   = 1.135335
    lp = T([[-15.0, 15.0, -2.0, 2.0]], requires_grad=True)
    k3 = kl_estimate(lp, torch.zeros(1, 4), "k3")
    close(k3, [[10.0, 10.0, math.e ** 2 - 3, math.exp(-2) + 1]])
    # A capped token has no gradient (as in verl); below the cap d(k3)/d(logp) = 1 - e^-d.
    k3.sum().backward()
    close(lp.grad, [[0.0, 0.0, 1 - math.e ** 2, 1 - math.exp(-2)]])


def test_kl_estimators_expected_gradients_in_the_loss():
    # What each estimator's gradient is in expectation over tokens drawn from pi (exactly: a
    # sum over the vocabulary weighted by the detached pi), against the closed forms:
    #   k1: E[grad log pi] = 0  (why the config refuses k1 in the loss)
    #   k2: grad KL(pi || ref)     k3: grad KL(ref || pi)
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(7, generator=g, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7, generator=g), 0)

    def expected_grad(kind: str) -> torch.Tensor:
        logp = torch.log_softmax(theta, 0)
        k = kl_estimate(logp[None], ref[None], kind)[0]
        return torch.autograd.grad((logp.exp().detach() * k).sum(), theta)[0]

    def grad_of(f) -> torch.Tensor:
        return torch.autograd.grad(f(torch.log_softmax(theta, 0)), theta)[0]

    reverse = grad_of(lambda lp: (lp.exp() * (lp - ref)).sum())
    forward = grad_of(lambda lp: (ref.exp() * (ref - lp)).sum())
    assert expected_grad("k1").abs().max() < 1e-6
    assert torch.allclose(expected_grad("k2"), reverse, atol=1e-6)
    assert torch.allclose(expected_grad("k3"), forward, atol=1e-6)
    assert reverse.abs().max() > 1e-2 and forward.abs().max() > 1e-2  # not vacuous


# ---------------------------------------------------------------- aggregation


def test_every_aggregation_mode_on_ragged_rows():
    # Row sums 6 (3 tokens) and 4 (1 token); 4 valid tokens; norm_len 4.
    #   token-mean              (1+2+3+4) / 4      = 2.5
    #   seq-mean-token-sum      (6 + 4) / 2        = 5
    #   seq-mean-token-mean     (6/3 + 4/1) / 2    = 3
    #   seq-mean-token-sum-norm (6/4 + 4/4) / 2    = 1.25
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    expected = {"token-mean": 2.5, "seq-mean-token-sum": 5.0, "seq-mean-token-mean": 3.0,
                "seq-mean-token-sum-norm": 1.25}
    assert set(expected) == set(AGG_MODES)
    # A third, empty row is left out of every mean over rows, and padding is never read.
    loss3 = poison(torch.cat([loss, T([[9.0, 9.0, 9.0]])]), torch.cat([MASK_31, T([[0, 0, 0]])]))
    mask3 = torch.cat([MASK_31, T([[0, 0, 0]])])
    for mode, want in expected.items():
        assert float(aggregate(loss, MASK_31, mode, norm_len=4)) == pytest.approx(want), mode
        assert float(aggregate(loss3, mask3, mode, norm_len=4)) == pytest.approx(want), mode


def test_aggregate_nothing_valid_is_zero_with_grad():
    x = torch.full((2, 3), 5.0, requires_grad=True)
    for mode in AGG_MODES:
        out = aggregate(x, torch.zeros(2, 3), mode, norm_len=3)
        assert out.item() == 0.0
        out.backward()
        assert torch.equal(x.grad, torch.zeros(2, 3))
        x.grad = None


@settings(max_examples=100)
@given(data=st.data())
def test_token_weights_summed_over_any_split_of_the_rows_give_the_aggregate(
        data: st.DataObject) -> None:
    # The DP identity: each rank weights its rows with the WHOLE batch's counts; the sum over
    # ranks (and micro-batches) of sum(w * L) is the aggregated loss of the batch, every mode.
    rows, width = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 6))
    lens = data.draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    mask = torch.arange(width)[None, :] < T(lens)[:, None]
    loss = torch.randn(rows, width, generator=torch.Generator().manual_seed(sum(lens)))
    mode, norm_len = data.draw(st.sampled_from(AGG_MODES)), data.draw(st.integers(1, 9))
    cuts = sorted(data.draw(st.lists(st.integers(0, rows), max_size=4)))
    tokens, seqs = int(mask.sum()), int((mask.sum(1) > 0).sum())
    total = sum(float((loss[a:b] * token_weights(mask[a:b], mode, tokens=tokens, seqs=seqs,
                                                 norm_len=norm_len)).sum())
                for a, b in zip([0, *cuts], [*cuts, rows], strict=True))
    want = float(aggregate(loss, mask, mode, norm_len=norm_len))
    assert total == pytest.approx(want, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------- policy loss


def test_policy_loss_clipped_and_unclipped_branches_with_grads():
    # old_logp = 0, A = 1, ratios 1.5 and 0.9, clip 0.2 / 0.2:
    #   token 0: max(-1.5, -1.2) = -1.2  (clipped: 1.5 -> 1.2, gradient 0)
    #   token 1: max(-0.9, -0.9) = -0.9  (inside the range, d/dlogp = -A*ratio = -0.9)
    #   token-mean = -1.05; grads / 2 tokens = [0, -0.45]; clip fraction 1/2
    lp = torch.log(T([[1.5, 0.9]])).requires_grad_()
    mask = torch.ones(1, 2)
    out = policy_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), mask,
                      clip_low=0.2, clip_high=0.2)
    close(out.per_token, [[-1.2, -0.9]])
    loss = aggregate(out.per_token, mask, "token-mean")
    assert loss.item() == pytest.approx(-1.05, abs=1e-5)
    assert out.clipped.tolist() == [[True, False]] and not out.dual_clipped.any()
    loss.backward()
    close(lp.grad, [[0.0, -0.45]])
    assert not out.clipped.requires_grad


def test_policy_loss_negative_advantage_lower_clip_and_asymmetric_high():
    # A = -1, ratio 0.5, clip_low 0.2: max(0.5, 0.8) = 0.8 -> clipped at 1 - 0.2.
    # A = +1, ratio 1.25, clip_high 0.28 (clip-higher): max(-1.25, -1.25) = -1.25, not clipped
    # (it would be with a symmetric 0.2: -1.2). Mean = (0.8 - 1.25) / 2 = -0.225.
    lp = torch.log(T([[0.5, 1.25]]))
    out = policy_loss(lp, torch.zeros(1, 2), T([[-1.0, 1.0]]), torch.ones(1, 2),
                      clip_low=0.2, clip_high=0.28)
    assert aggregate(out.per_token, ONES3[:, :2], "token-mean").item() == pytest.approx(
        -0.225, abs=1e-5)
    assert out.clipped.tolist() == [[True, False]]


def test_dual_clip_caps_negative_advantage_only():
    # Ratio 5 at both tokens, clip 0.2, dual_clip 3.
    #   A = -1: max(5, 1.2) = 5, then min(5, 1 * 3) = 3      (dual cap active)
    #   A = +1: max(-5, -1.2) = -1.2                        (ordinary clip; dual cap not used)
    # with dual clip: (3 - 1.2) / 2 = 0.9; without: (5 - 1.2) / 2 = 1.9.
    lp, old, adv = torch.log(T([[5.0, 5.0]])), torch.zeros(1, 2), T([[-1.0, 1.0]])
    kw = dict(clip_low=0.2, clip_high=0.2)
    mask = torch.ones(1, 2)
    out = policy_loss(lp, old, adv, mask, dual_clip=3.0, **kw)
    assert aggregate(out.per_token, mask, "token-mean").item() == pytest.approx(0.9, abs=1e-5)
    assert out.dual_clipped.tolist() == [[True, False]] and frac(out.clipped, mask) == 0.5
    plain = policy_loss(lp, old, adv, mask, **kw)
    assert float(aggregate(plain.per_token, mask, "token-mean")) == pytest.approx(1.9)


def test_policy_loss_padding_is_never_read_and_grads_stay_finite():
    g = torch.Generator().manual_seed(1)
    lp, old, adv = (torch.randn(2, 3, generator=g) for _ in range(3))
    ref = policy_loss(lp, old, adv, MASK_31, clip_low=0.2, clip_high=0.3, dual_clip=3.0)
    lp_bad = poison(lp, MASK_31).requires_grad_()
    out = policy_loss(lp_bad, poison(old, MASK_31, -1e9), poison(adv, MASK_31), MASK_31,
                      clip_low=0.2, clip_high=0.3, dual_clip=3.0)
    for field in ("per_token", "clipped", "dual_clipped"):
        assert torch.equal(getattr(ref, field), getattr(out, field)), field
    aggregate(out.per_token, MASK_31, "token-mean").backward()
    assert torch.isfinite(lp_bad.grad).all() and (lp_bad.grad[1, 1:] == 0).all()


# ---------------------------------------------------------------- value loss


def test_value_loss_clipping_hand_values_and_grads():
    # values 2, old 1, clip 0.2 -> v_clip = 1.2.
    #   R = 1.5: (2-1.5)^2 = 0.25 vs (1.2-1.5)^2 = 0.09 -> 0.5*0.25 = 0.125, unclipped
    #   R = 3:   (2-3)^2   = 1    vs (1.2-3)^2   = 3.24 -> 0.5*3.24 = 1.62,  clipped
    #   token-mean = 0.8725, clip fraction 1/2; grad = [(2 - 1.5) / 2, 0] = [0.25, 0]
    #   no clip: 0.5 * (0.25 + 1) / 2 = 0.3125
    v = T([[2.0, 2.0]], requires_grad=True)
    old, ret, mask = torch.ones(1, 2), T([[1.5, 3.0]]), torch.ones(1, 2)
    out = value_loss(v, old, ret, mask, clip=0.2)
    loss = aggregate(out.per_token, mask, "token-mean")
    assert loss.item() == pytest.approx(0.8725) and frac(out.clipped, mask) == 0.5
    loss.backward()
    close(v.grad, [[0.25, 0.0]])
    plain = value_loss(v, old, ret, mask, clip=None)
    assert aggregate(plain.per_token, mask, "token-mean").item() == pytest.approx(0.3125)
    assert not plain.clipped.any()


def test_value_loss_every_aggregation_mode():
    # Unclipped (clip=None): L = 0.5 * (v - R)^2 with v - R = [[1, 2, 3], [4, pad, pad]]:
    # per-token [[0.5, 2, 4.5], [8]] — row sums 7 (3 tokens) and 8 (1 token); norm_len 4.
    #   token-mean 15 / 4 = 3.75;  seq-mean-token-sum (7 + 8) / 2 = 7.5
    #   seq-mean-token-mean (7/3 + 8) / 2 = 5.16667;  seq-mean-token-sum-norm (7/4 + 8/4) / 2
    v = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    want = {"token-mean": 3.75, "seq-mean-token-sum": 7.5, "seq-mean-token-mean": 31 / 6,
            "seq-mean-token-sum-norm": 1.875}
    assert set(want) == set(AGG_MODES)
    for mode, expected in want.items():
        out = value_loss(v, v, torch.zeros(2, 3), MASK_31, clip=None)
        assert float(aggregate(out.per_token, MASK_31, mode, norm_len=4)) == pytest.approx(
            expected), mode


def test_value_loss_padding_is_never_read():
    v, old, ret = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]), torch.zeros(2, 3), torch.ones(2, 3)
    a = value_loss(v, old, ret, MASK_31, clip=0.5)
    b = value_loss(poison(v, MASK_31), poison(old, MASK_31, -1e9), poison(ret, MASK_31),
                   MASK_31, clip=0.5)
    assert torch.equal(a.per_token, b.per_token) and torch.equal(a.clipped, b.clipped)


# ---------------------------------------------------------------- argument validation


@pytest.mark.parametrize("call, name", [
    (lambda: gae(ONES3, ONES3, ONES3, gamma=1.5, lam=1.0), "gamma"),
    (lambda: gae(ONES3, ONES3, ONES3, gamma=1.0, lam=-0.1), "lam"),
    (lambda: gae(ONES3, ONES3, T([[1, 0, 1]]), gamma=1.0, lam=1.0), "right-padded"),
    (lambda: gae(ONES3, torch.ones(1, 2), ONES3, gamma=1.0, lam=1.0), "mask"),
    (lambda: gae(torch.ones(1, 2), ONES3, ONES3, gamma=1.0, lam=1.0), "token_rewards"),
    (lambda: check_mask(T([[0.5, 1.0]]), (1, 2)), "mask"),
    (lambda: grpo_advantages(T([1.0]), T([0.0]), torch.ones(1, 2)), "group_ids"),
    (lambda: grpo_advantages(T([1.0]), T([0]), torch.ones(2, 2)), "mask"),
    (lambda: kl_penalized_rewards(T([1.0]), ONES3, ONES3, kl_coef=-1.0), "kl_coef"),
    (lambda: whiten(ONES3, T([[1, 0, 0]])), "at least 2"),
    (lambda: kl_estimate(ONES3, ONES3, "k4"), "('k1', 'k2', 'k3')"),
    (lambda: aggregate(ONES3, ONES3, "mean"), "seq-mean-token-sum-norm"),
    (lambda: aggregate(ONES3, ONES3, "seq-mean-token-sum-norm"), "norm_len"),
    (lambda: aggregate(ONES3, ONES3, "token-mean", norm_len=0), "norm_len"),
    (lambda: policy_loss(ONES3, ONES3, ONES3, ONES3, clip_low=0.0, clip_high=0.2), "clip_low"),
    (lambda: policy_loss(ONES3, ONES3, ONES3, ONES3, clip_low=1.0, clip_high=0.2), "clip_low"),
    (lambda: policy_loss(ONES3, ONES3, ONES3, ONES3, clip_low=0.2, clip_high=0.0), "clip_high"),
    (lambda: policy_loss(ONES3, ONES3, ONES3, ONES3, clip_low=0.2, clip_high=0.2,
                         dual_clip=1.0), "dual_clip"),
    (lambda: value_loss(ONES3, ONES3, ONES3, ONES3, clip=0.0), "clip"),
    (lambda: value_loss(ONES3, ONES3, torch.ones(2, 3), ONES3, clip=0.2), "returns"),
])
def test_invalid_arguments_raise_value_error_naming_them(call, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        call()
