"""Chapter 4 — weight fingerprints: prove the rollout engine holds the weights just trained.

Silently stale rollout weights are a bug class every RL framework has shipped (TRL, SkyRL, verl
issues): a sync that quietly did nothing, or a reload that overwrote it, and training goes on
with a generator that is one or many steps behind. So after every sync both sides compute a
fingerprint and the driver compares them; a mismatch is an error naming the tensors.

The trick that makes this cheap across layouts: a *region-additive* checksum. Each element
contributes ``mix(global_index, bits)`` and contributions are summed modulo 2**64, so

    checksum(whole tensor) = sum over any non-overlapping cover of checksum(piece)

— the trainer's FSDP shards and the engine's tensor-parallel slices add up to the same number
without ever gathering a full tensor. It is bit-exact (it hashes the raw bits, so -0.0 != 0.0
and one flipped bit shows) and runs where the tensor lives (CPU or GPU), in chunks of
`CHUNK_ELEMENTS` (the same additivity makes the chunks' sums add up to the one-shot value), so
its temporaries stay ~40 MiB beside a rollout engine however big the tensor.

This file does not move weights (`executor.py`) or decide who holds what (`layout.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

_MASK = (1 << 64) - 1
# Odd 64-bit constants (from splitmix64): multiplying by an odd number is a bijection mod 2**64,
# so neither the index nor the bits can cancel out trivially.
_A, _B = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

CHUNK_ELEMENTS = 1 << 20
"""Elements checksummed at a time. Each element costs ~40 bytes of int64 temporaries (its bits,
its global index, the products), so a chunk is ~40 MiB wherever the tensor lives: hashing a
152k x 896 embedding in one go would take ~5 GiB beside an awake rollout engine."""


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def region_checksum(local: torch.Tensor, global_shape: Sequence[int],
                    bounds: Sequence[tuple[int, int]] | None = None, *,
                    chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Checksum of `local`, the part of a tensor of `global_shape` at `bounds` (per-dim
    (start, stop); None means `local` is the whole tensor). Sum the results of pieces that
    cover a tensor once (mod 2**64) to get the checksum of the whole.

    Computed `chunk_elements` elements at a time (see `CHUNK_ELEMENTS`); the chunk size
    changes the memory it takes, never the value."""
    if bounds is None:
        bounds = [(0, n) for n in global_shape]
    if tuple(local.shape) != tuple(b - a for a, b in bounds):
        raise ValueError(f"a local tensor of shape {tuple(local.shape)} cannot be the region "
                         f"{list(bounds)} of a tensor of shape {tuple(global_shape)}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    if local.numel() == 0:
        return 0
    total = _chunked_sum(local.detach(), list(bounds), list(global_shape), 0, chunk_elements)
    return int(total) & _MASK  # the one device-to-host copy


def _chunked_sum(local: torch.Tensor, bounds: list[tuple[int, int]], global_shape: list[int],
                 prefix: int, chunk: int) -> torch.Tensor:
    """The (wrapped int64) sum of `_piece_sum` over slices of `local` of at most `chunk`
    elements: runs of whole slices along dim 0, or, where one slice along dim 0 is already
    too big, each such slice on its own, cut the same way one dim deeper. `prefix` is the
    global flat index of the dims already fixed above `local` (Horner form, see
    `_piece_sum`)."""
    if local.numel() <= chunk:
        return _piece_sum(local, bounds, global_shape, prefix)
    (start, stop), size = bounds[0], global_shape[0]
    per_slice = local[0].numel()  # elements in one step along dim 0 (a view: no copy)
    total = torch.zeros((), dtype=torch.int64, device=local.device)
    if per_slice > chunk:
        for i in range(stop - start):
            total += _chunked_sum(local[i], bounds[1:], global_shape[1:],
                                  prefix * size + start + i, chunk)
        return total
    step = chunk // per_slice
    for i in range(0, stop - start, step):
        k = min(step, stop - start - i)
        total += _piece_sum(local[i:i + k], [(start + i, start + i + k), *bounds[1:]],
                            global_shape, prefix)
    return total


def _piece_sum(piece: torch.Tensor, bounds: list[tuple[int, int]], global_shape: list[int],
               prefix: int) -> torch.Tensor:
    """Sum of ``mix(global_index, bits)`` over one piece, on its device, as an int64 scalar.
    Its temporaries (int64 bits, index, products) are a few times the piece's size."""
    device = piece.device
    bits = piece.contiguous().view(_INT_OF_SIZE[piece.element_size()])
    bits = bits.to(torch.int64).reshape(-1)
    # Global flat index of every element, row-major over the global shape, in Horner form:
    # index = ((prefix * n_d + i_d) * n_{d+1} + i_{d+1}) ...; `prefix` is the part of the
    # index that the dims above this piece contribute (0 for a whole region).
    index = torch.full((), prefix, dtype=torch.int64, device=device)
    for (start, stop), size in zip(bounds, global_shape, strict=True):
        axis = torch.arange(start, stop, dtype=torch.int64, device=device)
        index = index.unsqueeze(-1) * size + axis  # shape grows by this dim
    index = index.reshape(-1)
    # int64 arithmetic wraps around modulo 2**64 on CPU and GPU: exactly the ring we want,
    # and a sum of partial sums mod 2**64 is the sum of the whole, bit for bit.
    mixed = (index * _signed(_A) + 1) * (bits * _signed(_B) + _signed(_A))
    return mixed.sum()


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint:
    """Per-tensor checksums (plus shape and dtype) of a set of weights.

    Example:
        >>> w = {"w": torch.arange(6.0).reshape(2, 3)}
        >>> a = fingerprint(w)
        >>> halves = [region_checksum(w["w"][i:i + 1], (2, 3), [(i, i + 1), (0, 3)])
        ...           for i in range(2)]
        >>> a.checksums["w"] == sum(halves) % 2**64
        True
    """

    checksums: Mapping[str, int]
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> Fingerprint:
    """The fingerprint of whole tensors (e.g. an engine's state dict)."""
    return Fingerprint(checksums={k: region_checksum(v, v.shape) for k, v in tensors.items()},
                       shapes={k: tuple(v.shape) for k, v in tensors.items()},
                       dtypes={k: str(v.dtype).removeprefix("torch.")
                               for k, v in tensors.items()})


def combine(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Add per-tensor partial checksums from pieces that cover each tensor once."""
    out: dict[str, int] = {}
    for part in parts:
        for name, value in part.items():
            out[name] = (out.get(name, 0) + value) & _MASK
    return out


class StaleWeightsError(RuntimeError):
    """The rollout side's weights differ from the trainer's after a sync."""


def check_same(expected: Mapping[str, int], actual: Mapping[str, int], *,
               where: str = "rollout engine") -> None:
    """Raise `StaleWeightsError` naming every tensor whose checksum differs or is missing."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    wrong = sorted(k for k in set(expected) & set(actual) if expected[k] != actual[k])
    if missing or extra or wrong:
        parts = [f"{label}: {names[:10]}{' ...' * (len(names) > 10)}"
                 for label, names in (("differ", wrong), ("missing", missing),
                                      ("unexpected", extra)) if names]
        raise StaleWeightsError(f"weights of the {where} do not match the trainer's after the "
                                f"sync ({len(wrong) + len(missing) + len(extra)} tensors): "
                                + "; ".join(parts))
