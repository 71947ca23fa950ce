"""Chapter 2 — the atomic unit of dispatch: one sequence, and a packed batch of them.

A sample is one sequence (prompt + response) with a stable `sample_id` and its token counts.
A `Batch` holds n samples column-wise:

- per-sample scalar columns, shape (n, ...): rewards, values, advantages of a sequence;
- packed variable-length columns (`Packed`): all samples' rows laid end to end in one flat
  tensor plus n+1 offsets — token ids, log-probs, per-token masks. Nothing is padded to the
  longest sample, so a batch with one 8k-token outlier costs 8k tokens, not n x 8k.

Slicing by sample ids, by positions, or by a contiguous range, and concatenation, all keep the
ids with their rows, so any reordering can be undone. A batch may be empty (a shard that got no
samples is an empty batch with the same columns). A batch is checked when it is made:
columns that disagree in length, duplicate ids, impossible lengths or a "tokens" column whose
rows are not prompt + response long fail with a message naming the column (and the sample).
The checks are vectorised; and a batch cut from a checked one (`take` of distinct positions,
`slice`) is valid by construction, so it skips them (`_unchecked`): they would only repeat,
for every shard and micro-batch of every call. This file knows nothing about shards, costs
or workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

import torch

T = TypeVar("T")

TOKENS = "tokens"
"""The packed column of token ids: when a batch has it, row i is sample i's prompt and
response, so its length must be ``prompt_lens[i] + response_lens[i]`` (checked)."""


def _as_index(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64).reshape(-1)


def _unchecked(cls: type[T], **fields: object) -> T:
    """A `Packed` or `Batch` made without its `__post_init__` checks, for one derived from a
    checked value in a way that cannot break them (rows taken or sliced out of it): the
    checks would repeat work, not catch anything. Every field must be given."""
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)  # frozen: the only way in, as __post_init__ does
    return obj


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Packed:
    """A variable-length column: row i is ``values[offsets[i]:offsets[i + 1]]``.

    Example:
        >>> col = Packed.from_rows([torch.tensor([1, 2, 3]), torch.tensor([4])])
        >>> col.offsets.tolist(), col.row(1).tolist()
        ([0, 3, 4], [4])
    """

    values: torch.Tensor
    """(total_rows_length, *feature) — every row's elements, end to end."""
    offsets: torch.Tensor
    """(n + 1,) int64, starts at 0, non-decreasing, ends at ``len(values)``."""

    def __post_init__(self) -> None:
        off = self.offsets
        if off.dtype != torch.int64 or off.dim() != 1 or len(off) < 1:
            raise ValueError(f"offsets must be a 1-D int64 tensor of n + 1 entries, got "
                             f"dtype {off.dtype} and shape {tuple(off.shape)}")
        if off[0] != 0 or off[-1] != len(self.values) or bool((off[1:] < off[:-1]).any()):
            raise ValueError(f"offsets must start at 0, never decrease and end at the "
                             f"{len(self.values)} packed values; got {off.tolist()[:8]}...")

    @classmethod
    def from_rows(cls, rows: Sequence[torch.Tensor]) -> Packed:
        """Pack a list of tensors (same trailing shape, any first-dim length)."""
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        values = torch.cat(list(rows)) if rows else torch.zeros(0)
        return cls(values=values, offsets=offsets)

    @property
    def lengths(self) -> torch.Tensor:
        """(n,) length of each row."""
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> torch.Tensor:
        """Row `i` as a view (no copy)."""
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def take(self, positions: torch.Tensor) -> Packed:
        """Rows at `positions`, in that order, packed anew (one gather, no Python loop)."""
        offsets, index = self.gather_index(positions)
        return _unchecked(Packed, values=self.values[index], offsets=offsets)

    def gather_index(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new offsets and the element index that `take(positions)` uses. Columns with
        the same offsets (tokens, log-probs, masks of the same sequences) can share them."""
        lengths = self.lengths[positions]
        offsets = torch.zeros(len(positions) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        # Element j of the output comes from start[row(j)] + (j - offsets[row(j)]).
        shift = torch.repeat_interleave(self.offsets[:-1][positions] - offsets[:-1], lengths)
        return offsets, torch.arange(int(offsets[-1])) + shift

    def slice(self, start: int, stop: int) -> Packed:
        """Rows start..stop-1 as views of this column's memory (no copy)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"slice {start}:{stop} of a column of {len(self)} rows; "
                             f"need 0 <= start <= stop <= {len(self)}")
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return _unchecked(Packed, values=self.values[lo:hi],
                          offsets=self.offsets[start:stop + 1] - lo)

    @staticmethod
    def concat(parts: Sequence[Packed]) -> Packed:
        """Rows of every part, in order."""
        shifts = torch.tensor([0] + [len(p.values) for p in parts], dtype=torch.int64).cumsum(0)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64)]
                            + [p.offsets[1:] + s for p, s in zip(parts, shifts, strict=False)])
        return Packed(values=torch.cat([p.values for p in parts]), offsets=offsets)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Batch:
    """n samples: ids, token counts, packed per-token columns and per-sample columns.

    Example:
        >>> b = Batch.from_rows(sample_ids=[7, 3], prompt_lens=[2, 1], response_lens=[1, 2],
        ...     packed={"tokens": [torch.tensor([5, 6, 9]), torch.tensor([5, 8, 8])]},
        ...     scalars={"reward": torch.tensor([1.0, 0.0])})
        >>> b.select([3]).packed["tokens"].row(0).tolist()
        [5, 8, 8]
    """

    sample_ids: torch.Tensor
    """(n,) int64, unique: the stable identity of each sample across every reordering."""
    prompt_lens: torch.Tensor
    """(n,) int64 >= 1 — prompt tokens of each sequence."""
    response_lens: torch.Tensor
    """(n,) int64 >= 0 — response tokens of each sequence."""
    packed: Mapping[str, Packed] = field(default_factory=dict)
    """Variable-length columns, each with n rows (e.g. "tokens", "logprobs")."""
    scalars: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Per-sample columns, each of shape (n, ...) (e.g. "reward", "value")."""

    def __post_init__(self) -> None:
        n = len(self.sample_ids)
        for name in ("sample_ids", "prompt_lens", "response_lens"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.dim() != 1 or len(t) != n:
                raise ValueError(f"column {name!r} must be a 1-D int64 tensor of {n} entries "
                                 f"(one per sample), got dtype {t.dtype}, shape {tuple(t.shape)}")
        if len(torch.unique(self.sample_ids)) != n:
            ids, counts = torch.unique(self.sample_ids, return_counts=True)
            raise ValueError(f"sample ids must be unique; repeated: {ids[counts > 1].tolist()}")
        for name, lens, low in (("prompt_lens", self.prompt_lens, 1),
                                ("response_lens", self.response_lens, 0)):
            bad = (lens < low).nonzero().flatten()
            if len(bad):
                i = int(bad[0])
                raise ValueError(f"{name} must be >= {low}; sample {int(self.sample_ids[i])} "
                                 f"has {int(lens[i])} ({len(bad)} such samples)")
        for name, col in {**self.packed, **self.scalars}.items():
            if len(col) != n:
                raise ValueError(f"column {name!r} has {len(col)} rows but the batch has {n} "
                                 f"samples; every column needs one row per sample")
        tokens = self.packed.get(TOKENS)
        # One vectorised comparison (this runs for every micro-batch): the lengths are what
        # costs, partitions and masks are computed from, so they must describe the tokens.
        if tokens is not None and not torch.equal(tokens.lengths, self.total_lens):
            bad = (tokens.lengths != self.total_lens).nonzero().flatten()
            i = int(bad[0])
            raise ValueError(f"column {TOKENS!r} must hold prompt_lens + response_lens tokens "
                             f"per sample; sample {int(self.sample_ids[i])} has "
                             f"{int(tokens.lengths[i])} but its prompt_lens "
                             f"{int(self.prompt_lens[i])} + response_lens "
                             f"{int(self.response_lens[i])} = {int(self.total_lens[i])} "
                             f"({len(bad)} such samples)")
        # Frozen all the way down: copy the column maps read-only (Ray's cloudpickle carries them).
        object.__setattr__(self, "packed", MappingProxyType(dict(self.packed)))
        object.__setattr__(self, "scalars", MappingProxyType(dict(self.scalars)))

    @classmethod
    def from_rows(cls, *, sample_ids: Sequence[int], prompt_lens: Sequence[int],
                  response_lens: Sequence[int],
                  packed: Mapping[str, Sequence[torch.Tensor]] | None = None,
                  scalars: Mapping[str, Sequence[float] | torch.Tensor] | None = None) -> Batch:
        """Build a batch from per-sample Python values and per-sample tensors."""
        return cls(sample_ids=_as_index(sample_ids), prompt_lens=_as_index(prompt_lens),
                   response_lens=_as_index(response_lens),
                   packed={k: Packed.from_rows(v) for k, v in (packed or {}).items()},
                   scalars={k: torch.as_tensor(v) for k, v in (scalars or {}).items()})

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def total_lens(self) -> torch.Tensor:
        """(n,) prompt + response tokens of each sequence."""
        return self.prompt_lens + self.response_lens

    def take(self, positions: Sequence[int] | torch.Tensor) -> Batch:
        """The samples at `positions` (0..n-1), in that order."""
        pos = _as_index(positions)
        if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= len(self)):
            raise IndexError(f"positions must lie in 0..{len(self) - 1}")
        # Distinct positions of a checked batch make a checked batch; a repeated position
        # repeats an id, which the full checks below report.
        distinct = len(pos) < 2 or int(torch.bincount(pos).max()) == 1
        # Per-token columns of the same sequences share their offsets: build each distinct
        # gather index once, not once per column (it is as long as the tokens).
        indices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        packed = {}
        for name, col in self.packed.items():
            hit = next((i for i in indices if i[0] is col.offsets
                        or torch.equal(i[0], col.offsets)), None)
            if hit is None:
                hit = (col.offsets, *col.gather_index(pos))
                indices.append(hit)
            packed[name] = _unchecked(Packed, values=col.values[hit[2]], offsets=hit[1])
        fields = {"sample_ids": self.sample_ids[pos], "prompt_lens": self.prompt_lens[pos],
                  "response_lens": self.response_lens[pos], "packed": packed,
                  "scalars": {k: v[pos] for k, v in self.scalars.items()}}
        if not distinct:
            return Batch(**fields)  # type: ignore[arg-type]  # raises: repeated ids
        return _unchecked(Batch, **{**fields, "packed": MappingProxyType(packed),
                                    "scalars": MappingProxyType(fields["scalars"])})

    def positions_of(self, sample_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Positions of these ids in this batch, in the order given; unknown ids are an error."""
        want = _as_index(sample_ids)
        order = torch.argsort(self.sample_ids)
        where = torch.searchsorted(self.sample_ids[order], want).clamp(max=max(len(self) - 1, 0))
        found = (self.sample_ids[order][where] == want) if len(self) else want != want
        if not bool(found.all()):
            raise KeyError(f"sample ids not in this batch: {want[~found].tolist()}")
        return order[where]

    def select(self, sample_ids: Sequence[int] | torch.Tensor) -> Batch:
        """The samples with these ids, in the order given; unknown ids are an error."""
        return self.take(self.positions_of(sample_ids))

    def only(self, *names: str) -> Batch:
        """The same samples with only the named columns, packed or scalar (no copy): what a
        call reads, so that only that is sent. An unknown name is an error naming the
        columns there are."""
        unknown = [n for n in names if n not in self.packed and n not in self.scalars]
        if unknown:
            raise KeyError(f"no column {unknown} in this batch; it has packed "
                           f"{sorted(self.packed)} and scalar {sorted(self.scalars)}")
        return _unchecked(
            Batch, sample_ids=self.sample_ids, prompt_lens=self.prompt_lens,
            response_lens=self.response_lens,
            packed=MappingProxyType({k: v for k, v in self.packed.items() if k in names}),
            scalars=MappingProxyType({k: v for k, v in self.scalars.items() if k in names}))

    def slice(self, start: int, stop: int) -> Batch:
        """Samples start..stop-1 as views of this batch's memory (a micro-batch, no copy)."""
        if not 0 <= start <= stop <= len(self):  # the one thing that could make it invalid
            raise IndexError(f"slice {start}:{stop} of a batch of {len(self)} samples; "
                             f"need 0 <= start <= stop <= {len(self)}")
        return _unchecked(
            Batch, sample_ids=self.sample_ids[start:stop],
            prompt_lens=self.prompt_lens[start:stop],
            response_lens=self.response_lens[start:stop],
            packed=MappingProxyType({k: v.slice(start, stop) for k, v in self.packed.items()}),
            scalars=MappingProxyType({k: v[start:stop] for k, v in self.scalars.items()}))

    def to(self, device: torch.device | str) -> Batch:
        """The same samples with every tensor on `device` (a worker moves its micro-batch to
        its model's device). The batch itself when all its tensors are there already, so on
        the CPU this costs nothing."""
        device = torch.device(device)
        tensors = [self.sample_ids, self.prompt_lens, self.response_lens, *self.scalars.values(),
                   *(t for col in self.packed.values() for t in (col.values, col.offsets))]
        if all(t.device == device for t in tensors):
            return self

        def moved(col: Packed) -> Packed:
            return _unchecked(Packed, values=col.values.to(device),
                              offsets=col.offsets.to(device))

        return _unchecked(
            Batch, sample_ids=self.sample_ids.to(device),
            prompt_lens=self.prompt_lens.to(device), response_lens=self.response_lens.to(device),
            packed=MappingProxyType({k: moved(v) for k, v in self.packed.items()}),
            scalars=MappingProxyType({k: v.to(device) for k, v in self.scalars.items()}))

    @staticmethod
    def concat(parts: Sequence[Batch]) -> Batch:
        """All samples of `parts`, in order; the parts must have the same columns."""
        if not parts:
            raise ValueError("concat needs at least one batch")
        names = (set(parts[0].packed), set(parts[0].scalars))
        for p in parts[1:]:
            if (set(p.packed), set(p.scalars)) != names:
                raise ValueError(f"cannot concat batches with different columns: "
                                 f"{sorted(names[0] | names[1])} vs "
                                 f"{sorted(set(p.packed) | set(p.scalars))}")
        return Batch(sample_ids=torch.cat([p.sample_ids for p in parts]),
                     prompt_lens=torch.cat([p.prompt_lens for p in parts]),
                     response_lens=torch.cat([p.response_lens for p in parts]),
                     packed={k: Packed.concat([p.packed[k] for p in parts]) for k in names[0]},
                     scalars={k: torch.cat([p.scalars[k] for p in parts]) for k in names[1]})

    def equals(self, other: Batch) -> bool:
        """Same ids, lengths and column values, in the same order (tensors compared exactly)."""
        same = (torch.equal(self.sample_ids, other.sample_ids)
                and torch.equal(self.prompt_lens, other.prompt_lens)
                and torch.equal(self.response_lens, other.response_lens)
                and self.packed.keys() == other.packed.keys()
                and self.scalars.keys() == other.scalars.keys())
        return same and all(
            torch.equal(v.values, other.packed[k].values)
            and torch.equal(v.offsets, other.packed[k].offsets)
            for k, v in self.packed.items()) and all(
            torch.equal(v, other.scalars[k]) for k, v in self.scalars.items())
