"""Chapter 1 — the device mesh: named parallel axes over the ranks of a worker group.

A mesh such as dp=2 x tp=2 says how the 4 ranks of a group are arranged: which data-parallel
shard a rank serves (its `dp` coordinate) and which tensor-parallel slice it holds (its `tp`
coordinate). Ranks are laid out row-major, the last axis fastest, so tensor-parallel peers are
neighbours (ranks 0,1 form one tp group) — the convention of Megatron and vLLM.

The mesh answers the questions the layers above ask: the coordinates of a rank, the ranks that
share a coordinate, the groups along an axis (for sub process groups), and the "collect" ranks
that return data (one per data-parallel shard). It is pure arithmetic: it does not create
process groups (torch's `DeviceMesh` does that inside workers) and imports nothing heavy.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from avrid.workers.errors import MeshError


@dataclass(frozen=True, slots=True)
class Mesh:
    """Named axes with sizes, e.g. ``Mesh.of(dp=2, tp=2)``.

    Example:
        >>> mesh = Mesh.of(dp=2, tp=2)
        >>> mesh.coords(3)
        {'dp': 1, 'tp': 1}
        >>> mesh.groups("tp")
        [[0, 1], [2, 3]]
        >>> mesh.collect_ranks()
        [0, 2]
    """

    names: tuple[str, ...]
    """Axis names, outermost first (e.g. ("dp", "tp"))."""
    sizes: tuple[int, ...]
    """Axis sizes in the same order; their product is the group's world size."""

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes) or not self.names:
            raise MeshError(f"a mesh needs one size per axis name, got {self.names} / {self.sizes}")
        if len(set(self.names)) != len(self.names):
            raise MeshError(f"mesh axis names must be unique, got {self.names}")
        for name, size in zip(self.names, self.sizes, strict=True):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshError(f"mesh axis {name!r} must have an integer size >= 1, got {size!r}")

    @classmethod
    def of(cls, **axes: int) -> Mesh:
        """Build a mesh from keyword axes in order: ``Mesh.of(dp=4)``, ``Mesh.of(dp=2, tp=2)``."""
        return cls(tuple(axes), tuple(axes.values()))

    @property
    def size(self) -> int:
        """Number of ranks the mesh covers (the product of the axis sizes)."""
        return math.prod(self.sizes)

    def axis_size(self, axis: str) -> int:
        """Size of one axis; a `MeshError` names the axes that exist if `axis` is unknown."""
        return self.sizes[self._index(axis)]

    def check_world_size(self, world_size: int) -> None:
        """Fail at once if this mesh does not describe exactly `world_size` ranks."""
        if self.size != world_size:
            shape = " x ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))
            raise MeshError(
                f"mesh {shape} covers {self.size} ranks but the group has {world_size} workers"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of `rank`, e.g. ``{"dp": 1, "tp": 0}``."""
        if not 0 <= rank < self.size:
            raise MeshError(f"rank {rank} is outside the mesh (0 <= rank < {self.size})")
        out: dict[str, int] = {}
        # Row-major: peel off the last (fastest) axis first.
        for name, size in zip(reversed(self.names), reversed(self.sizes), strict=True):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in self.names}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates; every axis must be given."""
        if set(coords) != set(self.names):
            raise MeshError(f"rank_of needs exactly the axes {self.names}, got {tuple(coords)}")
        rank = 0
        for name, size in zip(self.names, self.sizes, strict=True):
            c = coords[name]
            if not 0 <= c < size:
                raise MeshError(f"coordinate {name}={c} is outside 0..{size - 1}")
            rank = rank * size + c
        return rank

    def ranks_where(self, **fixed: int) -> list[int]:
        """All ranks whose coordinates match `fixed`, e.g. ``ranks_where(dp=1)`` -> [2, 3]."""
        for name in fixed:
            self._index(name)
        return [r for r, c in enumerate(map(self.coords, range(self.size)))
                if all(c[k] == v for k, v in fixed.items())]

    def ranks_along(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from `rank` only along `axis` (its group on that axis)."""
        here = self.coords(rank)
        return self.ranks_where(**{k: v for k, v in here.items() if k != axis})

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: the rank lists for which one sub process group is made.

        ``Mesh.of(dp=2, tp=2).groups("dp")`` is ``[[0, 2], [1, 3]]``.
        """
        i = self._index(axis)
        others = [range(s) for j, s in enumerate(self.sizes) if j != i]
        out = []
        for fixed in itertools.product(*others):
            names = [n for j, n in enumerate(self.names) if j != i]
            out.append(self.ranks_where(**dict(zip(names, fixed, strict=True))))
        return out

    def collect_ranks(self, data_axis: str | None = None) -> list[int]:
        """Ranks that return data: coordinate 0 on every axis except the data axis.

        In a dp x tp mesh every tp replica of a dp shard computes the same result, so only
        tp=0 needs to send it back (verl's "collect" ranks). `data_axis` defaults to the first
        axis.
        """
        data_axis = self.names[0] if data_axis is None else data_axis
        self._index(data_axis)
        return self.ranks_where(**{n: 0 for n in self.names if n != data_axis})

    def _index(self, axis: str) -> int:
        try:
            return self.names.index(axis)
        except ValueError:
            raise MeshError(f"unknown mesh axis {axis!r}; this mesh has {self.names}") from None

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))
