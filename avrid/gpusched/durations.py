"""Test tooling — how long each test is expected to take: declared, learnt, or a default.

The policy orders and backfills by expected durations, so they come from the best source there
is, in this order:

1. the test's own ``gpu(duration_s=...)``, plus the per-test start-up overhead (a fresh
   interpreter, pytest, the conftest: what the declaration leaves out), learnt like the rest;
2. what the test took last time, from a small JSON cache in the rootdir
   (``.pytest-gpu-durations.json`` by default, ``--gpu-durations`` to move it into another
   folder that exists): the whole run of its process, start-up included, as the scheduler
   lived it;
3. `DEFAULT_DURATION_S` for a test never seen.

The cache is rewritten after every scheduled run, atomically (a temp file in the same folder,
then ``os.replace``): a run killed half-way leaves the old file whole, never a torn one. A
cache that cannot be read (hand-edited, another version) is ignored with a warning, never an
error: it only makes the plan worse for one run.

Not here: measuring (the plugin times each test's process) or scheduling.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

DEFAULT_PATH = ".pytest-gpu-durations.json"
"""Where the cache lives, relative to the rootdir."""
DEFAULT_DURATION_S = 60.0
"""Expected duration of a test that declares none and was never run."""
DEFAULT_OVERHEAD_S = 1.0
"""Start-up overhead added to a declared duration until one is measured."""
VERSION = 1

Source = Literal["marker", "cache", "default"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Durations:
    """What earlier runs measured."""

    seconds: Mapping[str, float] = field(default_factory=dict)
    """Node id -> the wall time of its process the last time it ran."""
    overhead_s: float | None = None
    """Median start-up overhead of a test's process (its wall time minus the test's own
    setup, call and teardown), from the last run; None: never measured."""

    def estimate(self, nodeid: str, declared: float | None) -> tuple[float, Source]:
        """Expected duration of `nodeid` and where it came from.

        >>> d = Durations(seconds={"t.py::a": 12.5}, overhead_s=0.5)
        >>> d.estimate("t.py::a", None), d.estimate("t.py::a", 30.0), d.estimate("b", None)
        ((12.5, 'cache'), (30.5, 'marker'), (60.0, 'default'))
        """
        if declared is not None:
            overhead = DEFAULT_OVERHEAD_S if self.overhead_s is None else self.overhead_s
            return declared + overhead, "marker"
        if nodeid in self.seconds:
            return self.seconds[nodeid], "cache"
        return DEFAULT_DURATION_S, "default"

    def updated(self, measured: Mapping[str, float],
                overhead_s: float | None = None) -> Durations:
        """These durations with `measured` ones replacing theirs (the latest run is the best
        guess of the next), tests not run this time kept."""
        seconds = {**self.seconds, **{k: float(v) for k, v in measured.items()}}
        return Durations(seconds=seconds,
                         overhead_s=self.overhead_s if overhead_s is None else overhead_s)


def _valid(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def load_durations(path: Path) -> tuple[Durations, str]:
    """The cache at `path` and a warning ("" when none): a missing file is an empty cache,
    an unreadable one is ignored with the reason."""
    if not path.exists():
        return Durations(), ""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} durations file")
        tests = data.get("tests", {})
        overhead = data.get("overhead_s")
        if not isinstance(tests, dict) or not all(_valid(v) for v in tests.values()):
            raise ValueError("'tests' must map node ids to seconds >= 0")
        if overhead is not None and not _valid(overhead):
            raise ValueError("'overhead_s' must be seconds >= 0")
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        return Durations(), f"ignored the durations cache {path}: {err}"
    return Durations(seconds={str(k): float(v) for k, v in tests.items()},
                     overhead_s=None if overhead is None else float(overhead)), ""


def save_durations(path: Path, durations: Durations) -> None:
    """Write the cache atomically: a temp file beside it, flushed, then renamed over it.

    The folder must exist (an OSError otherwise): the cache is the one thing written, and a
    folder nobody asked for is never made."""
    data = {"version": VERSION, "overhead_s": durations.overhead_s,
            "tests": dict(sorted(durations.seconds.items()))}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
