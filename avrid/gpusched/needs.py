"""Test tooling — what one test needs, read from its markers at collection.

A test says what it needs with the markers the suite already has:

- ``@pytest.mark.gpu`` or ``gpu(count=N)`` (also ``gpu(N)``): N whole GPUs (1 by default),
  with optional keyword arguments ``memory_gb=`` (free GiB it needs on each of them),
  ``duration_s=`` (how long it is expected to run) and ``timeout_s=`` (its own limit,
  instead of ``--gpu-timeout``);
- ``@pytest.mark.vllm`` alone: one GPU (vLLM's engine takes a device of its own).

A test with neither marker is not scheduled: it runs in the pytest process, as without the
plugin. Values are checked here, so a typo (``memory=``) or a nonsense value (``count=0``) is an
error naming the test, not a test that silently waits for a GPU. So are two ``gpu`` markers
at one level (two stacked decorators, or a module's ``pytestmark`` listing two): pytest would
quietly use one of them (the lower decorator), and which one the author meant is a guess. A
function's marker over its class's or module's is no conflict: the closest one wins, as
everywhere in pytest.

Not here: CUDA or torch (a marker is read, nothing is probed), and durations learnt from
earlier runs (`durations.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

KWARGS = ("count", "memory_gb", "duration_s", "timeout_s")
"""The keyword arguments a ``gpu`` marker may carry."""


class MarkerError(ValueError):
    """A ``gpu`` marker whose arguments cannot be scheduled; the message names the test."""


class _Mark(Protocol):
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Node(Protocol):
    nodeid: str


class _Item(Protocol):  # what is read from a pytest Item (kept structural: no pytest import)
    nodeid: str

    def get_closest_marker(self, name: str) -> _Mark | None: ...

    def iter_markers_with_node(self, name: str) -> Iterator[tuple[_Node, _Mark]]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuNeeds:
    """What one test needs from the inventory, as its markers declare it.

    >>> GpuNeeds(gpus=2, memory_gb=40)
    GpuNeeds(gpus=2, memory_gb=40, duration_s=None, timeout_s=None)
    """

    gpus: int = 1
    """Whole GPUs, all given at once (never some now and the rest later)."""
    memory_gb: float | None = None
    """Free GiB needed on each of them; None: any GPU will do."""
    duration_s: float | None = None
    """Declared expected run time; None: learnt from earlier runs, or a default."""
    timeout_s: float | None = None
    """Its own time limit; None: the run's ``--gpu-timeout``."""

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise MarkerError(f"count must be a whole number of GPUs >= 1, got {self.gpus!r}")
        for name in ("memory_gb", "duration_s", "timeout_s"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise MarkerError(f"{name} must be a number > 0, got {value!r}")


def _positive(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def needs_of(item: _Item) -> GpuNeeds | None:
    """What `item` needs, or None if it carries neither a ``gpu`` nor a ``vllm`` marker.

    The closest ``gpu`` marker wins (a function's over its module's ``pytestmark``), as in
    the suite's own skip logic. Raises `MarkerError` naming the test for bad arguments, or
    for two ``gpu`` markers at one level.
    """
    levels: dict[str, list[_Mark]] = {}  # node id -> its gpu markers, the closest node first
    for node, mark in item.iter_markers_with_node("gpu"):
        levels.setdefault(node.nodeid, []).append(mark)
    if not levels:
        return GpuNeeds() if item.get_closest_marker("vllm") is not None else None
    gpu = next(iter(levels.values()))[0]
    doubled = next(((node, marks) for node, marks in levels.items() if len(marks) > 1), None)
    unknown = sorted(set(gpu.kwargs) - set(KWARGS))
    try:
        if doubled is not None:
            node, marks = doubled
            on = "the test" if node == item.nodeid else node  # or its class, its module
            raise MarkerError(f"given {len(marks)} times on {on} "
                              f"({' and '.join(map(_spelled, marks))}); keep one")
        if unknown:
            raise MarkerError(f"unknown keyword {unknown[0]!r} (allowed: {', '.join(KWARGS)})")
        if len(gpu.args) > 1 or (gpu.args and "count" in gpu.kwargs):
            raise MarkerError(f"takes at most one positional argument, the count, got "
                              f"{gpu.args!r} and {gpu.kwargs!r}")
        count = gpu.kwargs.get("count", gpu.args[0] if gpu.args else 1)
        return GpuNeeds(gpus=count, memory_gb=gpu.kwargs.get("memory_gb"),
                        duration_s=gpu.kwargs.get("duration_s"),
                        timeout_s=gpu.kwargs.get("timeout_s"))
    except MarkerError as err:
        raise MarkerError(f"{item.nodeid}: gpu marker: {err}") from None


def _spelled(mark: _Mark) -> str:
    """A marker as it was written: ``gpu(2, memory_gb=40)``."""
    args = [repr(a) for a in mark.args] + [f"{k}={v!r}" for k, v in mark.kwargs.items()]
    return f"gpu({', '.join(args)})"
