"""The packed batch: slicing, selection and concatenation keep ids with their rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from avrid.dispatch import Batch, Packed

pytestmark = pytest.mark.chapter(2)


def make_batch(lengths: list[tuple[int, int]], first_id: int = 0) -> Batch:
    """A batch whose token values encode (sample id, position) so any mix-up shows."""
    ids = list(range(first_id, first_id + len(lengths)))
    tokens = [torch.arange(p + r) + 1000 * i for i, (p, r) in zip(ids, lengths, strict=True)]
    logprobs = [torch.full((r, 2), float(i)) for i, (_, r) in zip(ids, lengths, strict=True)]
    return Batch.from_rows(sample_ids=ids, prompt_lens=[p for p, _ in lengths],
                           response_lens=[r for _, r in lengths],
                           packed={"tokens": tokens, "logprobs": logprobs},
                           scalars={"reward": torch.tensor(ids, dtype=torch.float32) / 2})


lengths = st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=30)


@given(lengths, st.data())
def test_take_select_and_concat_keep_rows_with_their_ids(ls: list, data: st.DataObject) -> None:
    b = make_batch(ls)
    perm = data.draw(st.permutations(range(len(b))))
    t = b.take(perm)
    for j, p in enumerate(perm):
        assert int(t.sample_ids[j]) == p
        assert torch.equal(t.packed["tokens"].row(j), b.packed["tokens"].row(p))
        assert torch.equal(t.packed["logprobs"].row(j), b.packed["logprobs"].row(p))
        assert float(t.scalars["reward"][j]) == p / 2
    assert t.select(list(range(len(b)))).equals(b)
    cut = data.draw(st.integers(0, len(b)))
    assert Batch.concat([b.slice(0, cut), b.slice(cut, len(b))]).equals(b)


def test_slices_are_views_and_packing_does_not_pad() -> None:
    b = make_batch([(2, 1), (1, 8000), (3, 0)])
    assert b.packed["tokens"].values.numel() == 3 + 8001 + 3  # not 3 x 8001
    s = b.slice(1, 3)
    assert s.packed["tokens"].values.data_ptr() == b.packed["tokens"].row(1).data_ptr()
    assert s.total_lens.tolist() == [8001, 3]


def test_empty_batches_are_allowed_and_keep_their_columns() -> None:
    b = make_batch([(2, 1)])
    e = b.take([])
    assert len(e) == 0 and e.packed["tokens"].values.dtype == torch.int64
    assert Batch.concat([e, b, e]).equals(b)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sample_ids": [1, 2], "prompt_lens": [1, 1], "response_lens": [1]},
     "'response_lens' must be a 1-D int64 tensor of 2 entries"),
    ({"sample_ids": [1, 2], "prompt_lens": [1, 1], "response_lens": [1, 1],
      "scalars": {"reward": [1.0]}}, "column 'reward' has 1 rows but the batch has 2"),
    ({"sample_ids": [1, 2], "prompt_lens": [1, 1], "response_lens": [1, 1],
      "packed": {"tokens": [torch.ones(2)]}}, "column 'tokens' has 1 rows"),
    ({"sample_ids": [1, 1], "prompt_lens": [1, 1], "response_lens": [1, 1]},
     r"sample ids must be unique; repeated: \[1\]"),
    ({"sample_ids": [4, 5], "prompt_lens": [1, 0], "response_lens": [1, 1]},
     "prompt_lens must be >= 1; sample 5 has 0"),
    ({"sample_ids": [4, 5], "prompt_lens": [1, 1], "response_lens": [-3, 1]},
     "response_lens must be >= 0; sample 4 has -3"),
    ({"sample_ids": [4, 5, 6], "prompt_lens": [1, 2, 2], "response_lens": [1, 1, 0],
      "packed": {"tokens": [torch.ones(2), torch.ones(4), torch.ones(1)]}},
     r"column 'tokens' must hold prompt_lens \+ response_lens tokens per sample; sample 5 "
     r"has 4 but its prompt_lens 2 \+ response_lens 1 = 3 \(2 such samples\)"),
])
def test_malformed_batches_fail_naming_the_column(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Batch.from_rows(**kwargs)


def test_bad_offsets_and_unknown_ids() -> None:
    with pytest.raises(ValueError, match="offsets must start at 0"):
        Packed(values=torch.zeros(3), offsets=torch.tensor([0, 2, 1, 3]))
    with pytest.raises(KeyError, match=r"not in this batch: \[99\]"):
        make_batch([(1, 1)]).select([99])
    with pytest.raises(ValueError, match="different columns"):
        Batch.concat([make_batch([(1, 1)]), Batch.from_rows(sample_ids=[5], prompt_lens=[1],
                                                            response_lens=[0])])


def test_a_slice_out_of_range_is_refused_not_made_invalid() -> None:
    batch = make_batch([(2, 3), (1, 4), (3, 0)])
    assert batch.slice(1, 3).equals(batch.take([1, 2]))  # unchecked, and still the same
    for start, stop in ((2, 1), (0, 4), (-1, 2)):
        with pytest.raises(IndexError, match=r"need 0 <= start <= stop <= 3"):
            batch.slice(start, stop)
    with pytest.raises(IndexError, match=r"column of 3 rows"):
        batch.packed["tokens"].slice(0, 5)
