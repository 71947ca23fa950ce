"""Cost models: token and FLOP costs, user functions, and the checks that name bad samples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from avrid.dispatch.cost import (
    CostModel,
    FlopCost,
    FunctionCost,
    TokenCost,
    check_costs,
    sequence_lengths,
)
from avrid.dispatch.partition import partition

pytestmark = pytest.mark.chapter(2)

LLAMA_7B = {"hidden_size": 4096, "num_layers": 32, "intermediate_size": 11008,
            "vocab_size": 32000}
lengths = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)), max_size=50)


def _split(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


@given(lengths)
def test_token_cost_is_the_whole_sequence_length(pairs: list[tuple[int, int]]) -> None:
    p, r = _split(pairs)
    out = TokenCost()(p, r)
    assert out.dtype == np.float64 and out.shape == (len(pairs),)
    assert out.tolist() == [float(a + b) for a, b in pairs]


@given(lengths)
def test_flop_cost_is_linear_plus_quadratic_in_length(pairs: list[tuple[int, int]]) -> None:
    p, r = _split(pairs)
    out = FlopCost(linear=3.0, quadratic=0.5)(p, r)
    s = (p + r).astype(np.float64)
    np.testing.assert_allclose(out, 3.0 * s + 0.5 * s**2)


def test_flop_cost_from_a_7b_config_matches_verls_constant() -> None:
    cost = FlopCost.from_model(**LLAMA_7B)
    # linear / quadratic = 2h + 1.5i + V/(2L) = 25204, within 3% of verl's 6h = 24576.
    assert cost.linear / cost.quadratic == pytest.approx(25204)
    assert cost.linear / cost.quadratic == pytest.approx(6 * 4096, rel=0.03)
    # 6 FLOPs per parameter per token (forward + backward) over ~6.6e9 matmul parameters.
    assert cost.linear == pytest.approx(6 * 6.607e9, rel=1e-3)
    assert cost.quadratic == 12 * 32 * 4096


def test_flop_cost_grouped_query_attention_and_plain_mlp_shrink_the_linear_term() -> None:
    full = FlopCost.from_model(**LLAMA_7B)
    gqa = FlopCost.from_model(**LLAMA_7B, num_heads=32, num_kv_heads=8)
    plain = FlopCost.from_model(**LLAMA_7B, gated_mlp=False)
    assert gqa.linear < full.linear and plain.linear < full.linear
    assert gqa.quadratic == plain.quadratic == full.quadratic
    # k and v shrink from h*h to h*h/4 each: 1.5 h^2 fewer parameters per layer.
    assert full.linear - gqa.linear == pytest.approx(6 * 32 * 1.5 * 4096**2)


def test_flop_cost_favours_spreading_long_sequences() -> None:
    # Same tokens, but one long sequence costs more than many short ones (attention).
    cost = FlopCost.from_model(**LLAMA_7B)
    long = cost(np.array([0]), np.array([16384]))
    short = cost(np.zeros(16, dtype=np.int64), np.full(16, 1024))
    assert long[0] > short.sum()
    assert TokenCost()(np.array([0]), np.array([16384]))[0] == 16384.0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"hidden_size": 0}, r"hidden_size must be an integer >= 1, got 0"),
    ({"num_layers": 2.5}, r"num_layers must be an integer >= 1"),
    ({"num_heads": 32, "num_kv_heads": 5}, r"num_kv_heads=5 needs num_heads divisible"),
    ({"num_kv_heads": 8}, r"num_kv_heads=8 needs num_heads"),
])
def test_flop_cost_from_model_rejects_bad_dimensions(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FlopCost.from_model(**(LLAMA_7B | kwargs))


@pytest.mark.parametrize(("linear", "quadratic"), [(-1.0, 1.0), (1.0, float("nan"))])
def test_flop_cost_rejects_bad_terms(linear: float, quadratic: float) -> None:
    with pytest.raises(ValueError, match=r"FlopCost\.(linear|quadratic) must be finite and >= 0"):
        FlopCost(linear=linear, quadratic=quadratic)


def test_function_cost_per_sequence_and_vectorized_agree() -> None:
    p, r = np.array([10, 0, 7]), np.array([5, 3, 0])
    each = FunctionCost(fn=lambda a, b: a + 2 * b)
    whole = FunctionCost(fn=lambda a, b: a + 2 * b, vectorized=True)
    assert each(p, r).tolist() == whole(p, r).tolist() == [20.0, 6.0, 7.0]
    assert each(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).shape == (0,)


def test_bad_function_costs_are_caught_by_the_checks_downstream() -> None:
    # A FunctionCost returns what the user's function said; make_plan (by sample id, see
    # test_dispatch_plan) and every partitioner (by position) refuse NaN and negative costs.
    p, r = np.array([1, 2, 3]), np.array([1, 1, 1])
    nan = FunctionCost(fn=lambda a, b: float("nan") if a == 2 else 1.0)(p, r)
    with pytest.raises(ValueError, match=r"position 1 is nan; costs must be finite"):
        partition(nan, 2)
    negative = FunctionCost(fn=lambda a, b: 1.0 - (a == 3) * 2.0)(p, r)
    with pytest.raises(ValueError, match=r"position 2 is -1.0; costs must be >= 0"):
        partition(negative, 2)
    with pytest.raises(ValueError, match=r"returned shape \(2,\) for 3 sequences"):
        FunctionCost(fn=lambda a, b: a[:2], vectorized=True)(p, r)


def test_every_model_satisfies_the_protocol() -> None:
    for model in (TokenCost(), FlopCost(linear=1.0, quadratic=0.0),
                  FunctionCost(fn=lambda a, b: a)):
        assert isinstance(model, CostModel)


def test_check_costs_names_the_first_bad_sample_by_id() -> None:
    ids = np.array([101, 102, 103, 104])
    with pytest.raises(ValueError, match=r"sample id 103 \(position 2\) is nan"):
        check_costs([1.0, 2.0, float("nan"), float("nan")], sample_ids=ids)
    with pytest.raises(ValueError, match=r"sample id 'b' \(position 1\) is -0.5; costs must be"):
        check_costs([1.0, -0.5], sample_ids=["a", "b"])
    with pytest.raises(ValueError, match=r"sample_ids has 1 ids for 2 costs"):
        check_costs([1.0, 2.0], sample_ids=[1])
    with pytest.raises(ValueError, match=r"costs must be 1-D .* got shape \(1, 2\)"):
        check_costs([[1.0, 2.0]])


def test_check_costs_returns_float64_and_accepts_empty() -> None:
    out = check_costs([1, 2, 0])
    assert out.dtype == np.float64 and out.tolist() == [1.0, 2.0, 0.0]
    assert check_costs([]).shape == (0,)


@pytest.mark.parametrize(("prompt", "response", "match"), [
    ([1, -2], [1, 1], r"the prompt length at position 1 is -2.0; lengths must be finite"),
    ([1, 2], [1, float("nan")], r"the response length at position 1 is nan"),
    ([1, 2], [1], r"must be 1-D and of equal length, got shapes \(2,\) and \(1,\)"),
])
def test_bad_lengths_are_rejected_by_every_model(prompt: list, response: list,
                                                 match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sequence_lengths(prompt, response)
    for model in (TokenCost(), FlopCost(linear=1.0, quadratic=1.0),
                  FunctionCost(fn=lambda a, b: a + b)):
        with pytest.raises(ValueError, match=match):
            model(np.array(prompt), np.array(response))
