"""Chapter 6 — the picture of the chapter: the same workload's timelines, one above the other.

`timelines_figure({"sync": tl_a, "one_step_off": tl_b})` draws one panel per timeline on one
time scale (seconds from each timeline's start), one row per worker — and the driver's phases
on top — each span coloured by its name with the colours every avrid chart uses
(`avrid.results.colors`). Grey is idle: in the synchronous panel the policy row is grey while
the engines generate and the engines are grey while it trains; in the pipelined panel the
rollout row's "generate" sits under the policy row's training.

`save_timelines_figure` writes it atomically. matplotlib is imported inside the functions and
pyplot is never used, so the global backend is untouched (a notebook shows the returned
figure inline).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from avrid.results import HANDLING_SPANS, Timeline, atomic_write
from avrid.results.colors import legend_order, span_color
from avrid.results.timeline import DRIVER

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DRIVER_CALL_SPANS = ("plan", "split", "submit", "wait", "receive", "merge")
"""The driver's per-call spans (chapter 3's `run_shards`): left out, only its phases drawn."""


def timelines_figure(timelines: dict[str, Timeline], *, title: str | None = None) -> Figure:
    """One Gantt panel per (label, timeline), stacked, sharing the time axis."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [(label, _rows(tl), tl.start) for label, tl in timelines.items()]
    width = max(tl.end - tl.start for tl in timelines.values())
    names = legend_order(s.name for _, rows, _ in panels for _, spans in rows for s in spans)
    heights = [len(rows) for _, rows, _ in panels]
    fig = Figure(figsize=(11, 1.4 + 0.45 * sum(heights)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (label, rows, origin) in zip(axes, panels, strict=True):
        for row, (_, spans) in enumerate(rows):
            ax.barh(row, width, left=0.0, height=0.8, color="0.93", edgecolor="none")
            for s in spans:
                ax.barh(row, s.end - s.start, left=s.start - origin, height=0.8,
                        color=span_color(s.name), edgecolor="white", linewidth=0.4)
        ax.set_yticks(range(len(rows)), [name for name, _ in rows])
        ax.invert_yaxis()
        ax.set_title(label, loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    axes[-1].set_xlim(0.0, width if width > 0 else 1.0)
    axes[-1].set_xlabel("seconds from the first step's start")
    if title:
        fig.suptitle(title)
    fig.legend(handles=[Patch(color=span_color(n), label=n) for n in names],
               loc="outside right upper", title="span", frameon=False)
    return fig


def save_timelines_figure(timelines: dict[str, Timeline], path: str | Path, *,
                          title: str | None = None) -> Path:
    """`timelines_figure` as a PNG at `path`, written atomically; returns the path."""
    fig = timelines_figure(timelines, title=title)
    return atomic_write(Path(path), lambda f: fig.savefig(f, format="png", dpi=110))


def _rows(tl: Timeline) -> list[tuple[str, list]]:
    """(row label, spans): the driver's phases first, then every worker lane."""
    rows = []
    for lane in tl.lanes:
        if lane.group == DRIVER:
            spans = [s for s in lane.spans if s.name not in DRIVER_CALL_SPANS]
            rows.insert(0, ("driver (phases)", spans))
        else:  # the workers' compute; their unpack / pack slivers are chapter 3's story
            rows.append((lane.label, [s for s in lane.spans if s.name not in HANDLING_SPANS]))
    return rows
