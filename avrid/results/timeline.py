"""Chapter 3 — the timeline: who did what when, as a Perfetto trace and a Gantt chart.

Every `WorkerResult` carries timing `Span`s, and the driver records its own. A `Timeline` puts
them side by side, one `Lane` per worker (plus one for the driver), on one shared clock. From
it come three views of the same facts:

- `to_chrome_trace(path)`: Chrome trace-event JSON (``traceEvents``) that ui.perfetto.dev and
  chrome://tracing open, one process per role, one thread per worker;
- `gantt(path)`: a matplotlib Gantt chart, one row per worker, spans coloured by name
  (`avrid.results.colors`: one name, one colour, in every picture);
- `utilization()` / `describe()`: each lane's busy and idle seconds and busy share.

The busy share is measured against the *whole* timeline window (first start to last end over
every lane), not the lane's own span: a worker that finishes early and waits for the slowest
shard shows that wait as idle time. That idle time is the pipeline bubble this chapter is about.

The driver is different: its spans cover almost the whole step, yet most of that time it sits
in `run_shards`'s ``wait`` span. "Busy 100 %" would hide that, so the chart and the table split
the driver's time into *own work* (plan, split, submit, receive, merge, advantages, ...:
every span but the waits) and *waiting on workers* (`WAIT_SPANS`).

This file does not record spans (workers do, through `ResultBuilder`), does not import Ray, and
imports matplotlib only when a chart is asked for (it is a dev/notebook dependency). Span times
are wall-clock seconds; spans from different machines are only as aligned as their clocks.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from avrid.results.colors import legend_order, span_color
from avrid.results.result import Span, WorkerResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DRIVER = "driver"
"""Label and group of the driver's lane."""

WAIT_SPANS = frozenset({"wait"})
"""Span names that mean "waiting on others", not own work: `run_shards`'s ``wait`` (from the
end of ``submit`` until every rank has answered; fetching the results, ``receive``, is own
work). A driver call made without `run_shards` (a
plain `WorkerGroup.call`) records no such span, so its wait counts as the driver's own work."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Lane:
    """One row of the timeline: the spans of one worker (or of the driver).

    Example:
        >>> lane = Lane(label="actor[1]", group="actor", rank=1, spans=(
        ...     Span(name="update", start=0.0, end=4.0), Span(name="fwd", start=1.0, end=2.0)))
        >>> lane.busy_seconds     # the union: the nested "fwd" is not counted twice
        4.0
    """

    label: str
    """What the row is called, e.g. ``actor[1]`` (`WorkerIdentity.name`) or ``driver``."""
    group: str
    """The role it belongs to (one trace process per group); ``driver`` for the driver."""
    rank: int = 0
    """Rank inside its group; orders the lanes of one group."""
    spans: tuple[Span, ...] = ()
    """Its spans, kept sorted by start (longest first on ties) so equal lanes compare equal."""

    def __post_init__(self) -> None:
        # Canonical order: makes merging order-independent and puts parents before children.
        object.__setattr__(self, "spans",
                           tuple(sorted(self.spans, key=lambda s: (s.start, -s.end, s.name))))

    @property
    def busy_seconds(self) -> float:
        """Seconds covered by at least one span (nested or overlapping spans count once)."""
        return _covered(self.spans)

    @property
    def waiting_seconds(self) -> float:
        """Seconds covered by `WAIT_SPANS` spans (part of `busy_seconds`)."""
        return _covered(s for s in self.spans if s.name in WAIT_SPANS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Utilization:
    """How one lane spent the timeline window."""

    label: str
    busy: float
    """Seconds covered by the lane's spans (their union)."""
    idle: float
    """Seconds of the window not covered: waiting for others, the bubble."""
    window: float
    """Length of the shared timeline window in seconds."""
    waiting: float = 0.0
    """Seconds of `busy` in `WAIT_SPANS` spans (the driver waiting for workers); 0 for a worker."""

    @property
    def share(self) -> float:
        """Busy fraction of the window, in [0, 1] (0 for a zero-length window)."""
        return self.busy / self.window if self.window > 0 else 0.0

    @property
    def own(self) -> float:
        """Seconds of own work: busy, but not waiting."""
        return max(self.busy - self.waiting, 0.0)

    @property
    def own_share(self) -> float:
        """Own-work fraction of the window (the driver's honest "busy")."""
        return self.own / self.window if self.window > 0 else 0.0

    @property
    def wait_share(self) -> float:
        """Waiting fraction of the window."""
        return self.waiting / self.window if self.window > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """The spans of many workers and the driver on one clock; build with `from_results`.

    Example:
        tl = Timeline.from_results(results, driver_spans=[Span(name="step", ...)])
        tl.to_chrome_trace("step.trace.json")   # open in ui.perfetto.dev
        tl.gantt("step.png")
        print(tl.describe())
    """

    lanes: tuple[Lane, ...] = ()
    """Driver first, then workers by role, then rank."""

    def __post_init__(self) -> None:
        lanes = tuple(sorted(self.lanes, key=_lane_order))
        keys = [(lane.group, lane.label) for lane in lanes]
        if len(set(keys)) != len(keys):
            raise ValueError(f"timeline has duplicate lanes {keys}; use Timeline.merge to "
                             "combine the spans of one worker")
        object.__setattr__(self, "lanes", lanes)

    @classmethod
    def from_results(cls, results: Sequence[WorkerResult],
                     driver_spans: Sequence[Span] = ()) -> Timeline:
        """One lane per worker identity (results of one worker are joined), plus the driver's
        lane when it recorded spans. Every worker gets a lane, even one without spans, since a
        worker that did nothing is all bubble."""
        spans: dict[tuple[str, int, str], list[Span]] = {}
        for r in results:
            key = (r.identity.role, r.identity.rank, r.identity.name)
            spans.setdefault(key, []).extend(r.spans)
        lanes = [Lane(label=name, group=role, rank=rank, spans=tuple(s))
                 for (role, rank, name), s in spans.items()]
        if driver_spans:
            lanes.append(Lane(label=DRIVER, group=DRIVER, spans=tuple(driver_spans)))
        return cls(lanes=tuple(lanes))

    @classmethod
    def merge(cls, *timelines: Timeline) -> Timeline:
        """One timeline holding all spans of `timelines` (e.g. several training steps); lanes
        with the same group and label are joined."""
        joined: dict[tuple[str, str], Lane] = {}
        for tl in timelines:
            for lane in tl.lanes:
                key = (lane.group, lane.label)
                old = joined.get(key)
                joined[key] = lane if old is None else Lane(
                    label=lane.label, group=lane.group, rank=lane.rank,
                    spans=old.spans + lane.spans)
        return cls(lanes=tuple(joined.values()))

    @property
    def spans(self) -> tuple[Span, ...]:
        """Every span of every lane."""
        return tuple(s for lane in self.lanes for s in lane.spans)

    @property
    def start(self) -> float:
        """Earliest span start (wall-clock seconds). Raises ValueError if there are no spans."""
        return min(s.start for s in self._nonempty_spans())

    @property
    def end(self) -> float:
        """Latest span end (wall-clock seconds). Raises ValueError if there are no spans."""
        return max(s.end for s in self._nonempty_spans())

    def _nonempty_spans(self) -> tuple[Span, ...]:
        spans = self.spans
        if not spans:
            labels = [lane.label for lane in self.lanes]
            raise ValueError(f"timeline has no spans (lanes: {labels or 'none'}); record spans "
                             "with ResultBuilder.span or pass driver_spans")
        return spans

    def utilization(self) -> dict[str, Utilization]:
        """Busy and idle seconds of each lane over the shared window, by lane label."""
        window = self.end - self.start
        out: dict[str, Utilization] = {}
        for lane in self.lanes:
            busy = lane.busy_seconds
            out[lane.label] = Utilization(label=lane.label, busy=busy,
                                          idle=max(window - busy, 0.0), window=window,
                                          waiting=lane.waiting_seconds)
        return out

    def chrome_trace(self) -> dict[str, Any]:
        """The Chrome trace-event object: a complete ("X") event per span, times in
        microseconds from the timeline start, plus name metadata ("M") events."""
        origin = self.start
        events: list[dict[str, Any]] = []
        pids: dict[str, int] = {}
        for tid, lane in enumerate(self.lanes, start=1):
            # Integer ids with name metadata: Perfetto's JSON importer wants numbers, and
            # the metadata turns them back into readable names.
            if lane.group not in pids:
                pid = pids[lane.group] = len(pids) + 1
                events += [_meta("process_name", pid, 0, {"name": lane.group}),
                           _meta("process_sort_index", pid, 0, {"sort_index": pid})]
            pid = pids[lane.group]
            events += [_meta("thread_name", pid, tid, {"name": lane.label}),
                       _meta("thread_sort_index", pid, tid, {"sort_index": tid})]
            events += [{"name": s.name, "cat": lane.group, "ph": "X",
                        "ts": _us(s.start - origin), "dur": _us(s.duration),
                        "pid": pid, "tid": tid} for s in lane.spans]
        # The absolute origin lets a reader line up two trace files of the same run.
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"origin_unix_s": origin}}

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write `chrome_trace()` as JSON to `path`, atomically; returns the path."""
        trace = self.chrome_trace()  # built first: an empty timeline fails before any I/O
        return atomic_write(Path(path), lambda f: f.write(json.dumps(trace).encode()))

    def gantt_figure(self, *, title: str | None = None) -> Figure:
        """A Gantt chart as a matplotlib `Figure` (no pyplot: the global backend is untouched,
        and a notebook shows the returned figure inline). Each span is coloured by its name
        (`span_color`: the same colour as in every other chart); a worker's row label gives
        its busy share, the driver's its own work and waiting shares."""
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        origin, util = self.start, self.utilization()
        window = self.end - origin
        names = legend_order(s.name for s in self.spans)
        color = {n: span_color(n) for n in names}
        height = 1.2 + 0.5 * len(self.lanes)
        fig = Figure(figsize=(10, height), layout="constrained")
        ax = fig.add_subplot()
        for row, lane in enumerate(self.lanes):
            # Grey underlay = the whole window, so idle gaps (bubbles) read as grey.
            ax.barh(row, window, left=0.0, height=0.8, color="0.93", edgecolor="none")
            for span, depth in zip(lane.spans, _depths(lane.spans), strict=True):
                # Nested or overlapping spans are drawn thinner on top, so both stay visible.
                ax.barh(row, span.duration, left=span.start - origin,
                        height=0.8 * 0.7 ** depth, color=color[span.name],
                        edgecolor="white", linewidth=0.5)
        ax.set_yticks(range(len(self.lanes)),
                      [_row_label(lane, util[lane.label]) for lane in self.lanes])
        ax.invert_yaxis()  # driver on top, like the trace viewer
        ax.set_xlim(0.0, window if window > 0 else 1.0)
        ax.set_xlabel("seconds from timeline start")
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        if title:
            ax.set_title(title)
        per_column = max(1, int((height - 0.6) / 0.25))  # legend entries that fit in height
        fig.legend(handles=[Patch(color=color[n], label=n) for n in names],
                   loc="outside right upper", title="span", frameon=False,
                   ncols=-(-len(names) // per_column))
        return fig

    def gantt(self, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
        """Save `gantt_figure()` to `path` (format from its suffix, PNG by default),
        atomically; returns the path."""
        out = Path(path)
        fig = self.gantt_figure(title=title)
        fmt = out.suffix.lstrip(".").lower() or "png"
        return atomic_write(out, lambda f: fig.savefig(f, format=fmt, dpi=120))

    def describe(self) -> str:
        """Text tables: for the driver, its own work, waiting and idle seconds and the shares
        of the first two; for every worker, busy and idle seconds and busy share.

        Example (the driver worked 1 s of a 4 s window and waited 3 s for one worker):
            >>> tl = Timeline(lanes=(
            ...     Lane(label=DRIVER, group=DRIVER, spans=(Span(name="send", start=0, end=1),
            ...                                             Span(name="wait", start=1, end=4))),
            ...     Lane(label="actor[0]", group="actor", spans=(
            ...         Span(name="forward", start=1, end=3),))))
            >>> print(tl.describe())
            timeline: 2 lanes, 3 spans, window 4.000 s
            lane      own work s  waiting s     idle s  own work %  waiting %
            driver         1.000      3.000      0.000       25.0%      75.0%
            lane          busy s     idle s     busy %
            actor[0]       2.000      2.000      50.0%
        """
        util = self.utilization()
        w = max(len("lane"), *(len(lane.label) for lane in self.lanes))
        window = self.end - self.start
        lines = [f"timeline: {len(self.lanes)} lanes, {len(self.spans)} spans, "
                 f"window {window:.3f} s"]
        drivers = [util[lane.label] for lane in self.lanes if lane.group == DRIVER]
        workers = [util[lane.label] for lane in self.lanes if lane.group != DRIVER]
        if drivers:  # idle: between the driver's spans (work it did not record)
            lines.append(f"{'lane':<{w}}  {'own work s':>10}  {'waiting s':>9}  {'idle s':>9}"
                         f"  {'own work %':>10}  {'waiting %':>9}")
            lines += [f"{u.label:<{w}}  {u.own:>10.3f}  {u.waiting:>9.3f}  {u.idle:>9.3f}  "
                      f"{u.own_share:>10.1%}  {u.wait_share:>9.1%}" for u in drivers]
        if workers:
            lines.append(f"{'lane':<{w}}  {'busy s':>10}  {'idle s':>9}  {'busy %':>9}")
            lines += [f"{u.label:<{w}}  {u.busy:>10.3f}  {u.idle:>9.3f}  {u.share:>9.1%}"
                      for u in workers]
        return "\n".join(lines)


def _row_label(lane: Lane, u: Utilization) -> str:
    """``actor[1]  busy 30%``; ``driver  own work 18%, waiting 75%``."""
    if lane.group == DRIVER:
        return f"{lane.label}  own work {u.own_share:.0%}, waiting {u.wait_share:.0%}"
    return f"{lane.label}  busy {u.share:.0%}"


def _lane_order(lane: Lane) -> tuple[bool, str, int, str]:
    return (lane.group != DRIVER, lane.group, lane.rank, lane.label)


def _us(seconds: float) -> float:
    # Microseconds, the trace format's unit; rounded to nanoseconds to keep the file readable.
    return round(seconds * 1e6, 3)


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _covered(spans: Iterable[Span]) -> float:
    """Seconds covered by at least one of `spans` (sorted by start): overlaps count once."""
    total, cur_start, cur_end = 0.0, 0.0, None
    for s in spans:  # sorted by start: sweep and merge overlapping intervals
        if cur_end is None or s.start > cur_end:
            total += 0.0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = s.start, s.end
        else:
            cur_end = max(cur_end, s.end)
    return total + (0.0 if cur_end is None else cur_end - cur_start)


def _depths(spans: Iterable[Span]) -> list[int]:
    """Drawing depth of each span among spans sorted by start: how many earlier spans are
    still open when it starts (nested or merely overlapping, either would hide it)."""
    open_ends: list[float] = []
    depths = []
    for s in spans:
        open_ends = [e for e in open_ends if e > s.start]
        depths.append(len(open_ends))
        open_ends.append(s.end)
    return depths


def palette(n: int) -> list[Any]:
    """`n` distinguishable matplotlib colours (tab10, or tab20 beyond ten), by position: for
    series that have no fixed meaning, such as ranks. Span and phase names take their colour
    from `span_color` instead, so a phase keeps its colour from one chart to the next."""
    from matplotlib import colormaps

    # tab10 is the most distinguishable; tab20 beyond ten names (colours then repeat).
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write `path` through a temporary file in the same directory and `os.replace` it into
    place, so a reader (or a crash) never sees a half-written file. `write` gets the open
    binary file. Every output avrid writes (traces, charts, metrics, checkpoint pointers)
    goes through here; returns `path`.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> atomic_write(d / "note.txt", lambda f: f.write(b"whole or not at all")).read_text()
        'whole or not at all'
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a trace or chart is for sharing
        os.replace(tmp, path)  # atomic on POSIX and Windows when on the same filesystem
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
