"""Weight fingerprints: additive over any cover of a tensor, bit-exact, and loud on a mismatch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from avrid.reshard.fingerprint import (
    StaleWeightsError,
    check_same,
    combine,
    fingerprint,
    region_checksum,
)

pytestmark = pytest.mark.chapter(4)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


@given(st.lists(st.integers(1, 7), min_size=1, max_size=3), st.sampled_from(DTYPES),
       st.data())
def test_pieces_add_up_to_the_whole(shape: list[int], dtype: torch.dtype,
                                    data: st.DataObject) -> None:
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    t = (torch.randn(shape, generator=gen) * 50).to(dtype)
    dim = data.draw(st.integers(0, len(shape) - 1))
    cut = data.draw(st.integers(0, shape[dim]))
    lo = [(0, n) for n in shape]
    hi = [(0, n) for n in shape]
    lo[dim], hi[dim] = (0, cut), (cut, shape[dim])
    pieces = [region_checksum(t.narrow(dim, a, b - a), shape, bounds)
              for bounds in (lo, hi) for a, b in [bounds[dim]]]
    whole = fingerprint({"t": t}).checksums["t"]
    assert combine([{"t": p} for p in pieces])["t"] == whole


def test_one_flipped_bit_and_the_sign_of_zero_are_seen() -> None:
    t = torch.linspace(-1, 1, 1000)
    bad = t.clone()
    bad.view(torch.int32)[123] ^= 1  # the lowest mantissa bit of one element
    assert fingerprint({"w": t}).checksums != fingerprint({"w": bad}).checksums
    zeros = torch.zeros(4)
    assert (fingerprint({"z": zeros}).checksums
            != fingerprint({"z": -zeros}).checksums)  # -0.0 has other bits
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, other places
    assert fingerprint({"w": t}).checksums != fingerprint({"w": swapped}).checksums


def test_check_same_names_the_stale_tensors() -> None:
    a = fingerprint({"q": torch.ones(3), "k": torch.zeros(2)}).checksums
    b = dict(a, q=a["q"] + 1)
    check_same(a, dict(a))
    with pytest.raises(StaleWeightsError, match=r"differ: \['q'\]"):
        check_same(a, b)
    with pytest.raises(StaleWeightsError, match=r"missing: \['k'\]"):
        check_same(a, {"q": a["q"]})
    with pytest.raises(ValueError, match="cannot be the region"):
        region_checksum(torch.ones(2, 2), (4, 2), [(0, 3), (0, 2)])
