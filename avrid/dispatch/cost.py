"""Chapter 2 — cost models: what one sequence costs the worker that trains on it.

Balancing shards needs a number per sequence. Training runs forward and backward over the
whole sequence, so the cost depends on its full length s = prompt + response. Three models
share one protocol (`CostModel`):

- `TokenCost`: s. Right when the work is linear in tokens (memory, short sequences).
- `FlopCost`: linear·s + quadratic·s², the matmul work plus the attention score work, with
  `FlopCost.from_model` deriving both terms from a model's dimensions. For long sequences the
  quadratic term matters: two 8k sequences cost more than one 16k-token pile of short ones.
- `FunctionCost`: your own function of (prompt_len, response_len).

Token and FLOP costs are checked here (1-D, finite, >= 0); a user function's costs are checked
by `make_plan`, which names the sample id of a bad one, and again by every partitioner, so a
partitioner never sees a NaN. This module does not partition, measure real step times or
calibrate constants against hardware; it only turns lengths into comparable numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class CostModel(Protocol):
    """Anything that turns per-sequence token counts into per-sequence costs."""

    def __call__(self, prompt_lens: np.ndarray, response_lens: np.ndarray) -> np.ndarray:
        """Costs as a float64 array, one per sequence, checked by `check_costs`."""
        ...


def check_costs(costs: Sequence[float] | np.ndarray, *,
                sample_ids: Sequence[object] | np.ndarray | None = None) -> np.ndarray:
    """Validate per-sample costs and return them as a 1-D float64 array.

    An empty array is allowed here (a cost model may be asked about no samples); partitioners
    reject it themselves. `sample_ids`, when given, must be parallel to `costs` and is used to
    name the offending sample in the error.

    Raises:
        ValueError: costs that are not numbers, not 1-D, not finite (NaN, inf) or negative;
            the message names the first offending sample (its id if known, and its position)
            and its value.
    """
    try:
        c = np.asarray(costs, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"costs must be numbers, one per sample: {e}") from None
    if c.ndim != 1:
        raise ValueError(f"costs must be 1-D (one cost per sample), got shape {c.shape}")
    if sample_ids is not None and len(sample_ids) != len(c):
        raise ValueError(f"sample_ids has {len(sample_ids)} ids for {len(c)} costs")
    # Both checks are one vectorised pass each; only the failing path looks for the culprit.
    finite = np.isfinite(c)
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        raise ValueError(f"the cost of {_name(i, sample_ids)} is {c[i]}; costs must be finite "
                         f"(a NaN or inf usually means a broken length or cost function)")
    negative = c < 0
    if negative.any():
        i = int(np.flatnonzero(negative)[0])
        raise ValueError(f"the cost of {_name(i, sample_ids)} is {c[i]}; costs must be >= 0")
    return c


def _name(i: int, sample_ids: Sequence[object] | np.ndarray | None) -> str:
    if sample_ids is None:
        return f"the sample at position {i}"
    sid = sample_ids[i]
    sid = sid.item() if isinstance(sid, np.generic) else sid
    return f"sample id {sid!r} (position {i})"


def sequence_lengths(prompt_lens: Sequence[float] | np.ndarray,
                     response_lens: Sequence[float] | np.ndarray) -> np.ndarray:
    """Full sequence lengths prompt + response as float64, after checking both inputs.

    Raises:
        ValueError: inputs that are not 1-D, differ in length, or hold a negative or
            non-finite length (the message names the first such position).
    """
    p = np.asarray(prompt_lens, dtype=np.float64)
    r = np.asarray(response_lens, dtype=np.float64)
    if p.ndim != 1 or r.ndim != 1 or p.shape != r.shape:
        raise ValueError(f"prompt_lens and response_lens must be 1-D and of equal length, got "
                         f"shapes {p.shape} and {r.shape}")
    for name, lens in (("prompt", p), ("response", r)):
        bad = ~np.isfinite(lens) | (lens < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"the {name} length at position {i} is {lens[i]}; lengths must be "
                             f"finite and >= 0")
    return p + r


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenCost:
    """Cost = number of tokens in the whole sequence (prompt + response).

    Example:
        >>> TokenCost()(np.array([10, 20]), np.array([5, 0])).tolist()
        [15.0, 20.0]
    """

    def __call__(self, prompt_lens: np.ndarray, response_lens: np.ndarray) -> np.ndarray:
        """Per-sequence token counts as float64."""
        return check_costs(sequence_lengths(prompt_lens, response_lens))


@dataclass(frozen=True, slots=True, kw_only=True)
class FlopCost:
    """Cost(s) = linear·s + quadratic·s² for a sequence of s = prompt + response tokens.

    The linear term is the matmul work every token does; the quadratic term is attention's
    score and value products, which grow with the square of the sequence length. Only the
    ratio linear / quadratic changes which partition is best; the scale makes the numbers
    readable as FLOPs. Use `from_model` to derive both terms, or give your own.

    Example:
        >>> FlopCost(linear=2.0, quadratic=1.0)(np.array([1, 2]), np.array([2, 2])).tolist()
        [15.0, 24.0]
    """

    linear: float
    """FLOPs per token (the matmuls)."""
    quadratic: float
    """FLOPs per squared token (attention's s x s products)."""

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"FlopCost.{name} must be finite and >= 0, got {value}")

    @classmethod
    def from_model(cls, *, hidden_size: int, num_layers: int, intermediate_size: int,
                   vocab_size: int, num_heads: int | None = None,
                   num_kv_heads: int | None = None, gated_mlp: bool = True) -> FlopCost:
        """The two terms of a decoder-only transformer's training step (forward + backward).

        Convention (h = hidden_size, L = num_layers, i = intermediate_size, V = vocab_size):

        - Matmul parameters per layer: attention projections q and o (h·h each) plus k and v
          (h·h_kv each, h_kv = h·num_kv_heads/num_heads, so h_kv = h without grouped-query
          attention), and the MLP (3·h·i gated as in Llama's SwiGLU, 2·h·i otherwise). The LM
          head adds h·V once. Embedding lookups are not matmuls and are not counted.
        - A forward pass spends 2 FLOPs per parameter per token; backward costs twice the
          forward, so training is 3 x forward: linear = 6·P.
        - Attention's QKᵀ and AV each cost 2·h·s² FLOPs per layer forward, 4·L·h·s² in all,
          counting the full s x s matrix (a causal kernel skips about half; this choice only
          moves the ratio, and it is the one that reproduces verl's calibrated constant):
          quadratic = 3 · 4·L·h = 12·L·h.

        For a 7B Llama-like config (h=4096, L=32, i=11008, V=32000, no GQA):
        P = 32·(4·4096² + 3·4096·11008) + 4096·32000 ≈ 6.61e9, so linear ≈ 3.97e10 and
        quadratic = 12·32·4096 ≈ 1.57e6, and linear / quadratic = 2h + 1.5i + V/(2L)
        = 8192 + 16512 + 500 = 25204 ≈ 6·h = 24576 — the constant of verl's workload
        estimate ``24576·s + s²``. So, up to scale, this is verl's cost model, derived
        instead of hard-coded.

        Raises:
            ValueError: a dimension below 1, or num_heads not divisible by num_kv_heads.
        """
        dims = {"hidden_size": hidden_size, "num_layers": num_layers,
                "intermediate_size": intermediate_size, "vocab_size": vocab_size}
        dims |= {k: v for k, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads))
                 if v is not None}
        for name, value in dims.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FlopCost.from_model: {name} must be an integer >= 1, "
                                 f"got {value!r}")
        h, layers = hidden_size, num_layers
        kv = h
        if num_kv_heads is not None:
            if num_heads is None or num_heads % num_kv_heads:
                raise ValueError(f"FlopCost.from_model: num_kv_heads={num_kv_heads} needs "
                                 f"num_heads divisible by it, got num_heads={num_heads}")
            kv = h * num_kv_heads // num_heads
        attention = 2 * h * h + 2 * h * kv
        mlp = (3 if gated_mlp else 2) * h * intermediate_size
        params = layers * (attention + mlp) + h * vocab_size
        return cls(linear=6.0 * params, quadratic=12.0 * layers * h)

    def __call__(self, prompt_lens: np.ndarray, response_lens: np.ndarray) -> np.ndarray:
        """Per-sequence FLOPs as float64."""
        s = sequence_lengths(prompt_lens, response_lens)
        return check_costs(s * (self.linear + self.quadratic * s))


@dataclass(frozen=True, slots=True, kw_only=True)
class FunctionCost:
    """Your own cost: ``fn(prompt_len, response_len) -> float`` applied to each sequence.

    With ``vectorized=True``, `fn` is called once with the two whole arrays and must return
    one cost per sequence (faster for large batches). The lengths `fn` sees are float64.

    Example:
        >>> cost = FunctionCost(fn=lambda p, r: p + 2 * r)   # responses cost double
        >>> cost(np.array([10]), np.array([5])).tolist()
        [20.0]
    """

    fn: Callable[..., float | np.ndarray]
    """The cost of one sequence, or of all of them when `vectorized`."""
    vectorized: bool = False
    """Call `fn` once on the arrays instead of once per sequence."""

    def __call__(self, prompt_lens: np.ndarray, response_lens: np.ndarray) -> np.ndarray:
        """Per-sequence costs from `fn`, *not yet checked*: `make_plan` checks them and names
        the sample id of a NaN or negative cost (`partition` names its position)."""
        sequence_lengths(prompt_lens, response_lens)  # validate before calling user code
        p = np.asarray(prompt_lens, dtype=np.float64)
        r = np.asarray(response_lens, dtype=np.float64)
        if self.vectorized:
            out = np.asarray(self.fn(p, r), dtype=np.float64)
            if out.shape != p.shape:
                raise ValueError(f"the vectorized cost function returned shape {out.shape} "
                                 f"for {len(p)} sequences; it must return one cost each")
        else:
            out = np.fromiter((self.fn(a, b) for a, b in zip(p.tolist(), r.tolist(),
                                                             strict=True)),
                              dtype=np.float64, count=len(p))
        return out
