"""Weight fingerprints: additive over any cover of a tensor, bit-exact, and loud on a mismatch;
computed in chunks that give the one-shot value bit for bit, with temporaries of a few chunks
(measured: every byte an op allocates is counted while it lives)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


def one_shot(local: torch.Tensor, global_shape: Sequence[int],
             bounds: Sequence[tuple[int, int]] | None = None) -> int:
    """The checksum as it was computed before chunking (69520cb): the whole region at once."""
    bounds = [(0, n) for n in global_shape] if bounds is None else bounds
    if local.numel() == 0:
        return 0
    bits = local.detach().contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                             8: torch.int64}[local.element_size()])
    bits = bits.to(torch.int64).reshape(-1)
    index = torch.zeros((), dtype=torch.int64)
    for (start, stop), size in zip(bounds, global_shape, strict=True):
        index = index.unsqueeze(-1) * size + torch.arange(start, stop, dtype=torch.int64)
    a, b = 0x9E3779B97F4A7C15 - 2**64, 0xBF58476D1CE4E5B9 - 2**64  # as signed int64
    mixed = (index.reshape(-1) * a + 1) * (bits * b + a)
    return int(mixed.sum()) & (2**64 - 1)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=4),
       st.sampled_from([*DTYPES, torch.float64, torch.int32, torch.bool]), st.data())
def test_chunks_give_the_one_shot_value_bit_for_bit(shape: list[int], dtype: torch.dtype,
                                                     data: st.DataObject) -> None:
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    t = (torch.randn(shape, generator=gen) * 50).to(dtype)
    # A region with bounds anywhere (the middle of a dim too): a non-contiguous view.
    bounds = [tuple(sorted((data.draw(st.integers(0, n)), data.draw(st.integers(0, n)))))
              for n in shape]
    local = t[tuple(slice(a, b) for a, b in bounds)]
    chunk = data.draw(st.integers(1, 64))  # tiny chunks: every way of cutting is taken
    want = one_shot(local, shape, bounds)
    assert region_checksum(local, shape, bounds, chunk_elements=chunk) == want
    assert region_checksum(local, shape, bounds) == want


def test_zero_dim_and_empty_tensors() -> None:
    scalar = torch.tensor(-3.25)
    assert region_checksum(scalar, ()) == one_shot(scalar, ()) != 0
    assert region_checksum(scalar, (), [], chunk_elements=1) == one_shot(scalar, ())
    for shape in [(0,), (3, 0), (0, 4, 2)]:
        assert region_checksum(torch.ones(shape), shape, chunk_elements=1) == 0
    with pytest.raises(ValueError, match="chunk_elements must be >= 1"):
        region_checksum(torch.ones(2), (2,), chunk_elements=0)


class PeakBytes(TorchDispatchMode):
    """Peak bytes held by the storages that ops allocate while the mode is on. An output that
    shares an input's storage (a view, an in-place op) allocates nothing; a new storage
    counts from the op that makes it until its last tensor is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        given_in = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given_in:
                storage = t.untyped_storage()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage.nbytes())
        return out


@pytest.mark.slow
def test_temporaries_are_a_few_chunks_not_the_whole_tensor() -> None:
    t = torch.randn(4096, 2304, generator=torch.Generator().manual_seed(0))
    bounds = [(100, 4000), (3, 2303)]  # 9.0M elements, not contiguous
    local = t[100:4000, 3:2303]
    want = one_shot(local, t.shape, bounds)
    with PeakBytes() as mem:
        got = region_checksum(local, t.shape, bounds)
    assert got == want
    # One int64 copy of the region is 8 bytes an element: the one-shot formula held ~5.
    assert mem.peak < 8 * local.numel(), f"peak {mem.peak / 2**20:.0f} MiB of temporaries"
    from avrid.reshard.fingerprint import CHUNK_ELEMENTS  # here: the bound above comes first

    assert mem.peak <= 6 * 8 * CHUNK_ELEMENTS, f"peak {mem.peak / 2**20:.0f} MiB"
    print(f"peak temporaries: {mem.peak / 2**20:.1f} MiB for {local.numel() / 1e6:.1f}M "
          f"elements (chunks of {CHUNK_ELEMENTS / 2**20:g}M)")
