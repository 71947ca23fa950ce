"""avrid.ppo.algo.estimators and .policy_losses against verl's code, transcribed below, on
random inputs (Hypothesis), and against numbers worked by hand.

The verl code is verl 0.9.1 as published on PyPI (verl-0.9.1-py3-none-any.whl,
verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py), copied with only the
`config` objects replaced by their fields (gamma, clip_ratio_low/high) and the dp_size=1 path
of agg_loss kept. Outputs must agree within 1e-6 (absolute and relative) in float32.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from avrid.ppo.algo.estimators import (
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from avrid.ppo.algo.losses import AGG_MODES, aggregate, policy_loss, token_weights
from avrid.ppo.algo.policy_losses import cispo_policy_loss, gspo_policy_loss

pytestmark = pytest.mark.chapter(5)

T = torch.tensor
TOL = dict(atol=1e-6, rtol=1e-6)


# ------------------------------------------------- verl 0.9.1, transcribed (see module docstring)


def masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    s = masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def masked_var(values, mask, unbiased=True):
    mean = masked_mean(values, mask)
    centered_values = values - mean
    variance = masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        loss = masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        loss = masked_sum(seq_losses, seq_mask) / seq_mask.sum()
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss /= loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        loss = masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    return loss


def verl_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    with torch.no_grad():
        for i in range(scores.shape[0]):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(scores.shape[0]):
            response_num = len(id2score[index[i]])
            if response_num > 1:
                scores[i] = scores[i] * response_num / (response_num - 1) - id2mean[
                    index[i]] * response_num / (response_num - 1)
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_reinforce_pp(token_level_rewards, response_mask, gamma):
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            new_running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = new_running_return * response_mask[:, t]
            running_return = (new_running_return * response_mask[:, t]
                              + running_return * (1 - response_mask[:, t]))
        advantages = masked_whiten(returns, response_mask)
        advantages = advantages * response_mask
    return advantages, returns


def verl_reinforce_pp_baseline(token_level_rewards, response_mask, index):
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    with torch.no_grad():
        for i in range(scores.shape[0]):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(scores.shape[0]):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        scores = masked_whiten(scores, response_mask) * response_mask
    return scores, scores


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
              clip_ratio_low, clip_ratio_high, loss_scale_factor=None):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = (log_prob - log_prob.detach()
                                + negative_approx_kl_seq.detach().unsqueeze(-1))
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low,
                                           1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    return pg_loss, pg_clipfrac.item()


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
               clip_ratio_low, clip_ratio_high, loss_scale_factor=None):
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return pg_loss, pg_clipfrac.item()


# ---------------------------------------------------------------- random batches


def frac(flags: torch.Tensor, mask: torch.Tensor) -> float:
    return float(flags.sum() / mask.bool().sum())


def poison(x: torch.Tensor, mask: torch.Tensor, value: float = 1e9) -> torch.Tensor:
    """x with every padding position replaced by `value` (avrid must never read it)."""
    return torch.where(mask.bool(), x, T(value))


@st.composite
def batches(draw, *, holes: bool = False, smallest: int = 2):
    """(mask float (B, T), group ids np.int64 (B,), torch.Generator): 1-4 groups of
    `smallest`-16 responses in shuffled order, ragged lengths (empty rows too), >= 2 valid
    tokens in all."""
    sizes = draw(st.lists(st.integers(smallest, 16), min_size=1, max_size=4))
    width = draw(st.integers(2, 12))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    order = torch.randperm(sum(sizes), generator=gen).numpy()
    ids = np.repeat(np.arange(len(sizes)) * 7 + 100, sizes)[order]
    lengths = torch.randint(0, width + 1, (len(ids),), generator=gen)
    lengths[0] = max(int(lengths[0]), 2)
    mask = (torch.arange(width) < lengths.unsqueeze(1)).float()
    if holes:  # verl 0.9.1's REINFORCE++ skips masked observation spans inside a row
        mask = mask * (torch.rand(mask.shape, generator=gen) > 0.2).float()
        mask[0, :2] = 1.0
    return mask, ids, gen


def token_level_rewards(mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random rewards on valid tokens (a score plus KL terms), 0 on padding, as verl has them."""
    return torch.randn(mask.shape, generator=gen) * mask


@settings(max_examples=60)
@given(batch=batches() | batches(smallest=1))  # groups of one too: verl's baseline is 0 there
# ... and always one such group (test_ppo_estimator_edges.py works it by hand)
@example(batch=(torch.ones(3, 2), np.array([100, 100, 107]), torch.Generator().manual_seed(0)))
def test_rloo_and_reinforce_pp_baseline_equal_verl(batch):
    mask, ids, gen = batch
    tlr = token_level_rewards(mask, gen)
    # verl sums token_level_rewards into the score; avrid takes that sum as `scores`.
    scores, gids = tlr.sum(-1), torch.from_numpy(ids)
    want, _ = verl_rloo(tlr.clone(), mask, ids)
    torch.testing.assert_close(rloo_advantages(scores, gids, mask), want, **TOL)
    want, _ = verl_reinforce_pp_baseline(tlr.clone(), mask, ids)
    torch.testing.assert_close(reinforce_pp_baseline_advantages(scores, gids, mask.bool()),
                               want, **TOL)


@settings(max_examples=60)
@given(batch=batches(holes=True), gamma=st.sampled_from([1.0, 0.99, 0.5, 0.0]))
def test_reinforce_pp_equals_verl_with_ragged_rows_and_masked_spans(batch, gamma):
    mask, _, gen = batch
    tlr = token_level_rewards(mask, gen)
    want, _ = verl_reinforce_pp(tlr, mask, gamma)
    got = reinforce_pp_advantages(poison(tlr, mask, float("inf")), mask, gamma=gamma)
    torch.testing.assert_close(got, want, **TOL)


def _policy_inputs(mask, gen, per_seq: bool):
    logp = -torch.rand(mask.shape, generator=gen) * 3
    old = logp + torch.randn(mask.shape, generator=gen) * 0.2
    adv = torch.randn(mask.shape[0] if per_seq else mask.shape, generator=gen)
    return logp, old, (adv.unsqueeze(1).expand(mask.shape) if per_seq else adv)


@settings(max_examples=40)
@given(batch=batches(), per_seq=st.booleans(), name=st.sampled_from(["gspo", "cispo"]),
       clip=st.sampled_from([(0.2, 0.28), (0.1, 0.1), (3e-4, 4e-4), (0.2, 5.0)]))
def test_gspo_and_cispo_equal_verl_in_every_mode_value_gradient_and_clipfrac(
        batch, per_seq, name, clip):
    mask, _, gen = batch
    logp, old, adv = _policy_inputs(mask, gen, per_seq)
    ours_fn, verl_fn = {"gspo": (gspo_policy_loss, verl_gspo),
                        "cispo": (cispo_policy_loss, verl_cispo)}[name]
    for mode in AGG_MODES:
        lp_v = logp.clone().requires_grad_()
        want, want_clipfrac = verl_fn(old, lp_v, adv, mask, mode, *clip, loss_scale_factor=9)
        want.backward()
        lp_a = logp.clone().requires_grad_()
        out = ours_fn(lp_a, poison(old, mask), poison(adv, mask), mask,
                      clip_low=clip[0], clip_high=clip[1])
        # The one departure: verl aggregates inside the loss; avrid returns per-token losses
        # and the caller aggregates them (here the whole batch at once).
        got = aggregate(out.per_token, mask, mode, norm_len=9)
        got.backward()
        torch.testing.assert_close(got, want.detach(), **TOL)
        torch.testing.assert_close(lp_a.grad, lp_v.grad, **TOL)
        assert frac(out.clipped, mask) == pytest.approx(want_clipfrac, abs=1e-6)


def test_split_over_micro_batches_the_token_weighted_sums_add_up_to_verls_loss():
    # Why avrid aggregates outside the loss: each micro-batch weights its rows with the whole
    # batch's counts, and the parts add up to verl's whole-batch scalar exactly.
    mask = T([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]).float()
    logp, old, adv = _policy_inputs(mask, torch.Generator().manual_seed(3), per_seq=True)
    tokens, seqs = int(mask.sum()), int((mask.sum(1) > 0).sum())
    for mode in AGG_MODES:
        want, _ = verl_gspo(old, logp, adv, mask, mode, 0.2, 0.2, loss_scale_factor=4)
        parts = [(gspo_policy_loss(logp[s], old[s], adv[s], mask[s], clip_low=0.2,
                                   clip_high=0.2).per_token
                  * token_weights(mask[s], mode, tokens=tokens, seqs=seqs, norm_len=4)).sum()
                 for s in (slice(0, 2), slice(2, 4))]
        torch.testing.assert_close(sum(parts), want, **TOL)


# ---------------------------------------------------------------- by hand


def test_rloo_hand_worked_with_singleton_ties_and_an_empty_row():
    mask = T([[1, 1], [1, 0], [0, 0], [1, 1], [1, 0], [1, 1]])
    scores = T([3.0, 1.0, 2.0, 5.0, 4.0, 4.0])
    ids = T([0, 0, 0, 1, 2, 2])
    a = rloo_advantages(scores, ids, mask)
    # Group 0: 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; the empty row's 2 still counts for the
    # others but has no token. Group 1 is alone: baseline 0, A = 5. Group 2 ties: 0.
    assert a.tolist() == [[1.5, 1.5], [-1.5, 0.0], [0.0, 0.0], [5.0, 5.0], [0.0, 0.0],
                          [0.0, 0.0]]


def test_reinforce_pp_hand_worked_discounted_returns_then_whitened():
    # gamma 0.5: row 0 G = [1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2] = [1.5, 1, 2];
    # row 1 has one token, G = [3]. Mean of [1.5, 1, 2, 3] = 1.875; squared deviations
    # 0.140625 + 0.765625 + 0.015625 + 1.265625 = 2.1875, unbiased var = 2.1875 / 3.
    r = T([[1.0, 0.0, 2.0], [3.0, 7.0, 7.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    a = reinforce_pp_advantages(r, mask, gamma=0.5)
    sd = (2.1875 / 3 + 1e-8) ** 0.5
    want = [[(1.5 - 1.875) / sd, (1 - 1.875) / sd, (2 - 1.875) / sd], [(3 - 1.875) / sd, 0, 0]]
    torch.testing.assert_close(a, T(want), **TOL)


def test_reinforce_pp_baseline_hand_worked_and_edge_cases():
    # Group 7: c = [0.5, -0.5] on 2 and 1 tokens; group 9 is one response, baseline 0, c = 0.
    # Tokens [0.5, 0.5, -0.5, 0, 0]: mean 0.1, squared deviations 0.16 + 0.16 + 0.36 + 0.01
    # + 0.01 = 0.7, unbiased var 0.7 / 4 = 0.175.
    mask = T([[1, 1], [1, 0], [1, 1]])
    a = reinforce_pp_baseline_advantages(T([1.0, 0.0, 0.0]), T([7, 7, 9]), mask)
    sd = (0.175 + 1e-8) ** 0.5
    want = T([[0.4 / sd, 0.4 / sd], [-0.6 / sd, 0.0], [-0.1 / sd, -0.1 / sd]])
    torch.testing.assert_close(a, want, **TOL)
    # All-equal scores: nothing to learn, all zeros (0 / sqrt(eps), no nan).
    z = reinforce_pp_baseline_advantages(T([2.0, 2.0, 2.0]), T([1, 1, 1]), mask)
    assert z.abs().max() == 0
    assert rloo_advantages(T([2.0, 2.0]), T([4, 4]), T([[1, 1], [1, 0]])).abs().max() == 0


def test_gspo_is_one_ratio_per_sequence_and_gives_the_sequence_level_gradient():
    # Token ratios 2 and 0.5 multiply to 1: GSPO's s = 1 for the whole row (nothing clipped),
    # where PPO, token by token, clips the ratio 2 (A > 0, beyond 1.2).
    logp = T([[0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.log(T([[0.5, 2.0, 1.0]]))
    mask, adv = T([[1, 1, 0]]), T([[1.0, 1.0, 1.0]])
    out = gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(out.per_token, T([[-1.0, -1.0, 0.0]]), **TOL)
    assert not out.clipped.any()
    assert policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2).clipped.sum() == 1
    # With one advantage per row and seq-mean-token-mean, the gradient is the paper's sequence
    # objective's: -A * s_i * mean_t grad logp_t (s_i differentiated as a whole).
    aggregate(out.per_token, mask, "seq-mean-token-mean").backward()
    seq = T([[0.0, 0.0, 0.0]], requires_grad=True)
    s = torch.exp(((seq - old) * mask).sum(1) / mask.sum(1))
    (-(adv[:, 0] * s)).mean().backward()
    torch.testing.assert_close(logp.grad, seq.grad, **TOL)
    torch.testing.assert_close(logp.grad, T([[-0.5, -0.5, 0.0]]), **TOL)


def test_cispo_clipped_tokens_keep_a_bounded_gradient_where_ppo_gives_none():
    # Ratios 1.5 (A > 0, beyond 1 + 0.2) and 0.9 (inside): CISPO's gradient is -w * A with
    # w = 1.2 and 0.9; PPO's clipped token gets no gradient at all.
    logp = torch.log(T([[1.5, 0.9]])).requires_grad_()
    args = (torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    out = cispo_policy_loss(logp, *args, clip_low=0.2, clip_high=0.2)
    out.per_token.sum().backward()
    torch.testing.assert_close(logp.grad, T([[-1.2, -0.9]]), **TOL)
    assert out.clipped.tolist() == [[True, False]]
    ppo_lp = logp.detach().clone().requires_grad_()
    policy_loss(ppo_lp, *args, clip_low=0.2, clip_high=0.2).per_token.sum().backward()
    torch.testing.assert_close(ppo_lp.grad, T([[0.0, -0.9]]), **TOL)


def test_losses_never_read_padding_and_a_fully_masked_row_gives_zero():
    mask = T([[1, 1, 0], [0, 0, 0]])
    logp = poison(T([[-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]]), mask, float("inf"))
    old = poison(T([[-1.1, -1.9, 0.0], [0.0, 0.0, 0.0]]), mask, float("nan"))
    adv = poison(torch.ones(2, 3), mask, float("-inf"))
    for fn in (gspo_policy_loss, cispo_policy_loss):
        lp = logp.clone().requires_grad_()
        out = fn(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
        aggregate(out.per_token, mask, "token-mean").backward()
        assert torch.isfinite(out.per_token).all() and torch.isfinite(lp.grad).all()
        assert out.per_token[:, 2].abs().sum() == 0 and out.per_token[1].abs().sum() == 0
        assert not out.dual_clipped.any()


# ---------------------------------------------------------------- bad input

ONES = torch.ones(2, 3)


@pytest.mark.parametrize("call, name", [
    (lambda: rloo_advantages(ONES, T([0, 0]), ONES), "scores must be 1-D"),
    (lambda: rloo_advantages(T([1.0, 2.0]), T([0.0, 0.0]), ONES), "group_ids"),
    (lambda: rloo_advantages(T([1.0, 2.0]), T([0]), ONES), "group_ids"),
    (lambda: rloo_advantages(T([1.0, 2.0]), T([0, 0]), torch.ones(3, 3)), "mask"),
    (lambda: rloo_advantages(T([1.0, float("nan")]), T([0, 0]), ONES), "scores must be finite"),
    (lambda: reinforce_pp_baseline_advantages(T([1.0, 2.0]), T([0, 1]), T([[1, 0, 0], [0, 0, 0]])),
     "at least 2"),
    (lambda: reinforce_pp_advantages(ONES, ONES, gamma=1.5), "gamma"),
    (lambda: reinforce_pp_advantages(ONES, torch.ones(2, 2)), "mask"),
    (lambda: reinforce_pp_advantages(ONES * float("inf"), ONES), "token_rewards"),
    (lambda: gspo_policy_loss(ONES, ONES, ONES, ONES, clip_low=1.0, clip_high=0.2),
     "clip_low must be in (0, 1)"),
    (lambda: gspo_policy_loss(ONES, ONES, ONES, ONES, clip_low=0.2, clip_high=0.0), "clip_high"),
    (lambda: cispo_policy_loss(ONES, ONES, ONES, ONES, clip_low=0.0, clip_high=0.2),
     "clip_low must be in (0, 1]"),
    (lambda: cispo_policy_loss(ONES, torch.ones(1, 3), ONES, ONES, clip_low=0.2, clip_high=0.2),
     "old_logp"),
])
def test_invalid_arguments_raise_value_error_naming_them(call, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        call()


def test_cispo_accepts_clip_low_one_no_lower_bound():
    out = cispo_policy_loss(torch.log(T([[0.01]])), T([[0.0]]), T([[1.0]]), T([[1]]),
                            clip_low=1.0, clip_high=0.2)
    assert not out.clipped.any()  # w = 0.01 stays: with clip_low = 1 the lower bound is 0
