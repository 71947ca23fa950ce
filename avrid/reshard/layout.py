"""Chapter 4 — parameter layouts: which region of every parameter each rank holds.

The resharding planner (`planner.py`) reads a layout on both sides of a weight sync: the
trainer's FSDP layout (dim-0 shards of torch.chunk sizes: 33 rows over 2 ranks are 17/16, 5 over
4 are 2/2/1/0) and the rollout engine's tensor-parallel one (column, row, vocab splits,
replicated norms), or any layout written by hand as boxes of global indices.

- `Region`: a box of a tensor, one (start, stop) per dim, with the set arithmetic the planner
  needs (intersect, subtract, relative_to) and `to_slices()` to index a real tensor.
- `ParamLayout`: one parameter's shape, dtype and every rank's region, checked to be a cover.
- `ModelLayout`: every parameter over one world size; `ModelLayout.fsdp`. How vLLM shards a
  Qwen2/Llama-family decoder is `tp_layout.decoder_tp_layout`.

Pure arithmetic on shapes: no tensors, Ray or torch.distributed (torch only sizes an unusual
dtype). It does not decide who sends what (`planner.py`) and moves no bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DType = Any  # a dtype name such as "bfloat16", or a torch.dtype (stored as its name)
Shapes = Mapping[str, tuple[Sequence[int], DType]]  # name -> (shape, dtype)

_DTYPE_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8,
                "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
                "float8_e4m3fn": 1, "float8_e5m2": 1}


class LayoutError(ValueError):
    """A layout does not describe its tensor: wrong dims, a gap, an overlap, a bad split."""


def dtype_name(dtype: DType) -> str:
    """The canonical name: ``torch.bfloat16``, ``"torch.bfloat16"`` -> ``"bfloat16"``."""
    return _lookup(dtype)[0]


def dtype_size(dtype: DType) -> int:
    """Bytes per element: ``dtype_size("bfloat16") == 2``."""
    return _lookup(dtype)[1]


def _lookup(dtype: DType) -> tuple[str, int]:
    name = str(dtype).removeprefix("torch.")
    if name in _DTYPE_SIZES:
        return name, _DTYPE_SIZES[name]
    import torch  # only for names outside the table: aliases ("half"), complex, other float8s

    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise LayoutError(f"unknown dtype {dtype!r}; use a torch dtype or its name, "
                          f"e.g. one of {sorted(_DTYPE_SIZES)}")
    return str(found).removeprefix("torch."), torch.empty((), dtype=found).element_size()


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """A box of a tensor in global indices: dim d spans ``bounds[d][0] <= i < bounds[d][1]``.

    Example:
        >>> a = Region(bounds=((0, 17), (0, 8)))
        >>> a.shape, a.numel, str(a.intersect(Region(bounds=((10, 33), (0, 8)))))
        ((17, 8), 136, '[10:17, 0:8]')
        >>> [str(r) for r in a.subtract(Region(bounds=((0, 10), (0, 4))))]
        ['[10:17, 0:8]', '[0:10, 4:8]']
        >>> Region(bounds=((10, 17), (0, 8))).relative_to(a).to_slices()
        (slice(10, 17, None), slice(0, 8, None))
    """

    bounds: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        b = tuple((int(lo), int(hi)) for lo, hi in self.bounds)
        for d, (lo, hi) in enumerate(b):
            if not 0 <= lo <= hi:
                raise LayoutError(f"region dim {d} needs 0 <= start <= stop, got ({lo}, {hi})")
        object.__setattr__(self, "bounds", b)

    @classmethod
    def full(cls, shape: Sequence[int]) -> Region:
        """The whole tensor of `shape`."""
        return cls(bounds=tuple((0, int(n)) for n in shape))

    @property
    def ndim(self) -> int:
        """Number of dims (0 for a scalar, whose one element is the whole region)."""
        return len(self.bounds)

    @property
    def shape(self) -> tuple[int, ...]:
        """Extent per dim: the shape of the slice this region cuts."""
        return tuple(hi - lo for lo, hi in self.bounds)

    @property
    def numel(self) -> int:
        """Number of elements inside."""
        return math.prod(hi - lo for lo, hi in self.bounds)

    @property
    def is_empty(self) -> bool:
        """True when some dim has zero extent."""
        return any(hi == lo for lo, hi in self.bounds)

    def intersect(self, other: Region) -> Region | None:
        """The common box, or None when they share no element."""
        self._same_ndim(other)
        out = []
        for (a, b), (c, d) in zip(self.bounds, other.bounds, strict=True):
            lo, hi = max(a, c), min(b, d)
            if hi <= lo:
                return None
            out.append((lo, hi))
        return Region(bounds=tuple(out))

    def contains(self, other: Region) -> bool:
        """True when every element of `other` is inside this region."""
        self._same_ndim(other)
        return all(a <= c and d <= b
                   for (a, b), (c, d) in zip(self.bounds, other.bounds, strict=True))

    def subtract(self, other: Region) -> tuple[Region, ...]:
        """This region minus `other` as at most 2 * ndim disjoint boxes.

        Dim by dim, the slabs of self below and above the overlap are cut off; the slabs of
        later dims are confined to the overlap on earlier dims, so no element is in two boxes.
        """
        common = self.intersect(other)
        if common is None:
            return () if self.is_empty else (self,)
        out = []
        for d, ((lo, hi), (clo, chi)) in enumerate(zip(self.bounds, common.bounds,
                                                       strict=True)):
            before, after = common.bounds[:d], self.bounds[d + 1:]
            if lo < clo:
                out.append(Region(bounds=(*before, (lo, clo), *after)))
            if chi < hi:
                out.append(Region(bounds=(*before, (chi, hi), *after)))
        return tuple(out)

    def relative_to(self, container: Region) -> Region:
        """This region in the local coordinates of a shard that holds `container`.

        A rank holding rows 17:33 keeps them at local rows 0:16, so global rows 20:25 are its
        local rows 3:8. Raises `LayoutError` if `container` does not hold all of this region.
        """
        if not container.contains(self):
            raise LayoutError(f"region {self} is not inside {container}")
        return Region(bounds=tuple((lo - c, hi - c) for (lo, hi), (c, _)
                                   in zip(self.bounds, container.bounds, strict=True)))

    def to_slices(self) -> tuple[slice, ...]:
        """Index a tensor with it: ``tensor[region.to_slices()]``."""
        return tuple(slice(lo, hi) for lo, hi in self.bounds)

    def _same_ndim(self, other: Region) -> None:
        if other.ndim != self.ndim:
            raise LayoutError(f"cannot combine a {self.ndim}-d region {self} with a "
                              f"{other.ndim}-d region {other}")

    def __str__(self) -> str:
        return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in self.bounds) + "]"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamLayout:
    """One parameter: its global shape and dtype, and the region each rank holds.

    Example:
        >>> p = ParamLayout.fsdp((33, 8), "float32", world=2)
        >>> [str(r) for r in p.regions], p.bytes_on(1)
        (['[0:17, 0:8]', '[17:33, 0:8]'], 512)
        >>> [str(r) for r in ParamLayout.split((8, 6), "bfloat16", world=2, dim=1).regions]
        ['[0:8, 0:3]', '[0:8, 3:6]']
    """

    shape: tuple[int, ...]
    dtype: str
    """A dtype name such as "bfloat16"; a torch.dtype given here is stored as its name."""
    regions: tuple[Region | None, ...]
    """One entry per rank; None for a rank holding nothing (empty regions become None)."""
    allow_overlap: bool = False
    """Ranks may hold the same elements (replication, or TP shards repeated over DP). Without
    it an overlap is an error: two ranks claiming one element is usually a bug."""
    kind: str = "custom"
    """A label for tables: "fsdp", "column", "row", "vocab", "replicated", ..."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if any(n < 0 for n in self.shape) or not self.regions:
            raise LayoutError(f"a ParamLayout needs sizes >= 0 and one region (or None) per "
                              f"rank, got shape {self.shape} and {len(self.regions)} regions")
        full = Region.full(self.shape)
        for rank, r in enumerate(self.regions):
            if r is not None and (r.ndim != len(self.shape) or not full.contains(r)):
                raise LayoutError(f"rank {rank}'s region {r} does not fit shape {self.shape}")
        object.__setattr__(self, "regions", tuple(
            None if r is None or r.is_empty else r for r in self.regions))

    @classmethod
    def fsdp(cls, shape: Sequence[int], dtype: DType, world: int) -> ParamLayout:
        """FSDP2's dim-0 shards: chunks of ceil(d0 / world) rows, as ``torch.chunk``; the last
        shard may be short and trailing ranks may hold nothing (5 rows over 4: 2/2/1/0)."""
        d0 = first_dim_size(shape, "FSDP", check_world_size(world))
        step = -(-d0 // world)
        rest = tuple((0, int(n)) for n in shape[1:])
        regions = [Region(bounds=((r * step, min((r + 1) * step, d0)), *rest))
                   if r * step < d0 else None for r in range(world)]
        return cls(shape=tuple(shape), dtype=dtype, regions=tuple(regions), kind="fsdp")

    @classmethod
    def split(cls, shape: Sequence[int], dtype: DType, world: int, dim: int, *,
              name: str = "<parameter>") -> ParamLayout:
        """Tensor-parallel split into `world` equal parts along `dim` (0: column-parallel
        weight [out, in] and its bias; 1: row-parallel weight). vLLM refuses uneven TP
        splits, so a dim that `world` does not divide is an error naming `name`."""
        check_world_size(world)
        if not 0 <= dim < len(shape):
            raise LayoutError(f"parameter {name!r} of shape {tuple(shape)} has no dim {dim}")
        if shape[dim] % world:
            raise LayoutError(f"parameter {name!r}: a tensor-parallel split needs dim {dim} "
                              f"(size {shape[dim]}) divisible by {world} ranks (vLLM "
                              f"requires an even split)")
        step, full = shape[dim] // world, Region.full(shape).bounds
        regions = tuple(Region(bounds=(*full[:dim], (r * step, (r + 1) * step), *full[dim + 1:]))
                        for r in range(world))
        label = "column" if dim == 0 else "row" if dim == 1 else f"split(dim={dim})"
        return cls(shape=tuple(shape), dtype=dtype, regions=regions, kind=label)

    @classmethod
    def replicated(cls, shape: Sequence[int], dtype: DType, world: int) -> ParamLayout:
        """Every rank holds the whole tensor (norms under TP, data-parallel replicas)."""
        return cls(shape=tuple(shape), dtype=dtype, allow_overlap=True, kind="replicated",
                   regions=(Region.full(shape),) * check_world_size(world))

    @property
    def world(self) -> int:
        """Number of ranks the layout spans."""
        return len(self.regions)

    @property
    def itemsize(self) -> int:
        """Bytes per element of `dtype`."""
        return dtype_size(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) tensor."""
        return math.prod(self.shape) * self.itemsize

    def bytes_on(self, rank: int) -> int:
        """Bytes `rank` holds of this parameter."""
        r = self.regions[rank]
        return 0 if r is None else r.numel * self.itemsize

    def check_covers(self, name: str) -> None:
        """Raise `LayoutError` unless the regions cover every element, and (unless
        `allow_overlap`) none twice. Messages name `name` and a gap, or the two ranks."""
        holes = [] if math.prod(self.shape) == 0 else [Region.full(self.shape)]
        for r in self.regions:
            if r is not None:
                holes = [piece for h in holes for piece in h.subtract(r)]
        if holes:
            raise LayoutError(f"layout of parameter {name!r} (shape {self.shape}) does not "
                              f"cover it: no rank holds {holes[0]}")
        held = sum(r.numel for r in self.regions if r is not None)
        if not self.allow_overlap and held > math.prod(self.shape):
            # Covered yet over-counted, so some pair overlaps; find it (error path only).
            for (i, a), (j, b) in itertools.combinations(enumerate(self.regions), 2):
                if a is not None and b is not None and (both := a.intersect(b)) is not None:
                    raise LayoutError(f"layout of parameter {name!r}: ranks {i} and {j} both "
                                      f"hold {both}; pass allow_overlap=True if intended")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLayout:
    """Every parameter of a model over one world size, in order; validated when made (each
    parameter fits the world size and passes `check_covers`).

    `params` accepts a mapping and is stored as (name, layout) pairs, so the value stays
    frozen and picklable (it travels to workers); ``layout["name"]`` looks one up.

    Example:
        >>> m = ModelLayout.fsdp({"w": ((33, 8), "float32"), "b": ((33,), "float32")}, 2)
        >>> m.names, m.bytes_on(0), m.bytes_on(1)
        (('w', 'b'), 612, 576)
    """

    world_size: int
    params: tuple[tuple[str, ParamLayout], ...]

    def __post_init__(self) -> None:
        check_world_size(self.world_size)
        pairs = tuple(self.params.items() if isinstance(self.params, Mapping) else self.params)
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise LayoutError(f"parameter names repeat: "
                              f"{sorted({n for n in names if names.count(n) > 1})}")
        for name, p in pairs:
            if p.world != self.world_size:
                raise LayoutError(f"parameter {name!r} has regions for {p.world} ranks but "
                                  f"the model layout has world_size {self.world_size}")
            p.check_covers(name)
        object.__setattr__(self, "params", pairs)

    @classmethod
    def fsdp(cls, shapes: Shapes, world: int) -> ModelLayout:
        """FSDP2 over `world` ranks: every parameter sharded on dim 0 (`ParamLayout.fsdp`).
        From a module: ``{n: (p.shape, p.dtype) for n, p in model.named_parameters()}``."""
        return cls(world_size=world, params=tuple(
            (n, ParamLayout.fsdp(s, d, world)) for n, (s, d) in shapes.items()))

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in order."""
        return tuple(n for n, _ in self.params)

    def __getitem__(self, name: str) -> ParamLayout:
        for n, p in self.params:
            if n == name:
                return p
        raise KeyError(f"no parameter {name!r} in this layout ({len(self.params)} params)")

    def bytes_on(self, rank: int) -> int:
        """Bytes `rank` holds over all parameters."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return sum(p.bytes_on(rank) for _, p in self.params)

    def describe(self) -> str:
        """A text table: one line per parameter with its kind and each rank's region."""
        w, total = self.world_size, sum(p.nbytes for _, p in self.params)
        lines = [f"model layout: {len(self.params)} params over {w} ranks, {total} bytes",
                 f"{'param':<40} {'shape':<14} {'dtype':<9} {'kind':<10} regions by rank"]
        for n, p in self.params:
            cells = " ".join(str(r) if r is not None else "-" for r in p.regions)
            lines.append(f"{n:<40} {str(p.shape):<14} {p.dtype:<9} {p.kind:<10} {cells}")
        lines.append("bytes per rank: " + ", ".join(str(self.bytes_on(r)) for r in range(w)))
        return "\n".join(lines)


def check_world_size(world: int) -> int:
    """`world` if it is a valid number of ranks (an int >= 1); else a `LayoutError`."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise LayoutError(f"the number of ranks must be an integer >= 1, got {world!r}")
    return world


def first_dim_size(shape: Sequence[int], what: str, world: int) -> int:
    """The size of dim 0, which `what` (e.g. "FSDP") splits; a 0-d tensor has none."""
    if not len(shape):
        raise LayoutError(f"a 0-d parameter has no dim to split for {what} over {world} "
                          f"ranks; use ParamLayout.replicated")
    return int(shape[0])
