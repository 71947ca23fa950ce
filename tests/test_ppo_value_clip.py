"""Chapter 5: the value loss's clip flags (issue 42, item 7).

`value_loss` clips the new value to [old - clip, old + clip] and flags a token where the
clipped term is the one the loss takes (`critic/vf_clipfrac`). It used to clip as
old + clamp(v - old, -clip, clip), which in floating point is not always `v` for an in-range
value: the two terms then differed by rounding and ~0.5 % of in-range tokens were flagged.
Here: the flag at the boundary (exactly at old +- clip, one float inside, one float outside),
no flag for random in-range values, and the loss and its gradient unchanged from the old
formula, and equal to verl 0.9.1's `compute_value_loss` (written out below) with its clip
fraction."""

from __future__ import annotations

import pytest
import torch

from avrid.ppo.algo.losses import aggregate, value_loss

pytestmark = pytest.mark.chapter(5)

CLIP = 0.2


def old_formula(values, old_values, returns, mask, clip):
    """The loss as it was computed before (per token, and its clipped flags)."""
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    unclipped, clipped = (values - returns) ** 2, (v_clip - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped) * mask, (clipped > unclipped) & mask.bool()


def verl_value_loss(vpreds, values, returns, response_mask, cliprange_value):
    """verl 0.9.1 `core_algos.compute_value_loss` (token-mean), with its `clip_by_value`."""
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value),
                             values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * (clipped_vf_losses * response_mask).sum() / response_mask.sum()
    vf_clipfrac = ((vf_losses2 > vf_losses1).float() * response_mask).sum() / response_mask.sum()
    return vf_loss, vf_clipfrac


def in_range(gen: torch.Generator, shape=(64, 256)):
    """Random old values and new values strictly inside old +- CLIP, with returns anywhere.
    Values of a critic's size (rewards in [0, 1]), drawn in float64 and rounded to float32
    apart, as a critic's two forward passes give them (a float32 v made as old + d would
    make v - old exact): then old + (v - old) rounds away from v for ~8 % of tokens."""
    old = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5
    step = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * (CLIP * 0.999)
    v, old = (old + step).float(), old.float()
    ret = torch.randn(shape, generator=gen)
    return v, old, ret, torch.ones(shape)


def test_random_in_range_values_are_never_flagged() -> None:
    v, old, ret, mask = in_range(torch.Generator().manual_seed(0))
    assert not value_loss(v, old, ret, mask, clip=CLIP).clipped.any()
    # The old formula's rounding flagged some of these same tokens (the bug this pins).
    assert old_formula(v, old, ret, mask, CLIP)[1].any()


def test_the_flag_at_the_boundary() -> None:
    old = torch.tensor([0.3, -1.7, 5.1, 0.0])
    hi, lo = old + CLIP, old - CLIP  # the bounds, as the loss computes them
    inf = torch.tensor(float("inf"))
    # Returns just past a bound: a value clipped back to that bound is further from them, so
    # the clipped term wins wherever the clip changed the value at all.
    past_hi, past_lo = hi + 1e-3, lo - 1e-3
    mask = torch.ones(4)
    cases = [  # (values, returns, expected flags)
        (hi, past_hi, False), (lo, past_lo, False),  # exactly at old +- clip: not clipped
        (torch.nextafter(hi, -inf), past_hi, False),  # one float inside
        (torch.nextafter(lo, inf), past_lo, False),
        (torch.nextafter(hi, inf), past_hi, True),  # one float outside: the clip binds
        (torch.nextafter(lo, -inf), past_lo, True),
        # Outside, but the unclipped term is the larger: the loss takes it, no flag.
        (torch.nextafter(hi, inf), old - 10, False), (torch.nextafter(lo, -inf), old + 10, False),
    ]
    for v, ret, flagged in cases:
        out = value_loss(v[None], old[None], ret[None], mask[None], clip=CLIP)
        assert out.clipped.tolist() == [[flagged] * 4], (v, ret, flagged)


def test_loss_and_gradient_are_those_of_the_old_formula_and_of_verl() -> None:
    gen = torch.Generator().manual_seed(1)
    # Values in range and past it on both sides (drawn as `in_range` draws them).
    old = torch.randn(16, 32, generator=gen, dtype=torch.float64) * 0.5
    step = torch.randn(16, 32, generator=gen, dtype=torch.float64) * CLIP * 2
    new_values, old = (old + step).float(), old.float()
    ret = torch.randn(16, 32, generator=gen)
    mask = (torch.rand(16, 32, generator=gen) < 0.8).float()
    grads = []
    for fn in ("new", "old"):
        v = new_values.clone().requires_grad_(True)
        if fn == "new":
            out = value_loss(v, old, ret, mask, clip=CLIP)
            per_token, flags = out.per_token, out.clipped
        else:
            per_token, flags = old_formula(v, old, ret, mask, CLIP)
        loss = aggregate(per_token, mask, "token-mean")
        loss.backward()
        grads.append((loss.detach(), v.grad, flags))
    (new_loss, new_grad, new_flags), (old_loss, old_grad, old_flags) = grads
    assert torch.allclose(new_loss, old_loss, rtol=1e-6, atol=0)
    assert torch.allclose(new_grad, old_grad, rtol=1e-5, atol=1e-8)
    # The flags differ only where the old one was rounding noise: tokens the new one calls
    # in range, whose two terms the old formula computed within rounding of each other.
    assert not (new_flags & ~old_flags).any()
    want_loss, want_frac = verl_value_loss(new_values, old, ret, mask, CLIP)
    assert torch.allclose(new_loss, want_loss, rtol=1e-6, atol=0)
    frac = (new_flags.float() * mask).sum() / mask.sum()
    assert frac.item() == pytest.approx(want_frac.item(), abs=0)


def test_a_value_exactly_on_a_bound_has_the_in_range_gradient() -> None:
    # The loss has a kink there; clamp's gradient includes its ends, so v - R flows (the old
    # formula's rounding of v - old decided between that and half of it).
    old = torch.tensor([[0.3, -1.7]])
    v = torch.cat([old[:, :1] + CLIP, old[:, 1:] - CLIP], dim=1).requires_grad_(True)
    ret = torch.tensor([[0.9, -2.5]])
    aggregate(value_loss(v, old, ret, torch.ones(1, 2), clip=CLIP).per_token,
              torch.ones(1, 2), "token-mean").backward()
    assert torch.allclose(v.grad, (v.detach() - ret) / 2)
