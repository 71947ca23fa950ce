"""Chapter 5 — the run's pictures: reward curves, where each step's time went, the timeline.

Input is the rows of ``metrics.jsonl`` (`avrid.ppo.outputs.metrics.read_metrics`), named the way the
trainer names them:

- ``train/reward`` and ``val/reward`` (validation runs only every few steps, so most rows have
  no ``val/reward``);
- ``time/<phase>``: seconds spent in one phase of the step (generate, reward, old_logp,
  ref_logp, values, advantages, critic_update, actor_update, weight_sync), and ``time/step``,
  the step's whole wall time.

`reward_figure` and `phase_figure` return matplotlib `Figure`s built without pyplot, so the
global backend is never touched and a notebook shows them inline; saving them to PNG renders
with Agg. `write_plots` writes them (and, given one, the step's `Timeline` as a Gantt chart and
a Perfetto trace) atomically, reusing chapter 3's writer.

A phase has one colour in every picture: chapter 3's `span_color` by name, so ``generate`` is
the same blue in ``phases.png`` and ``timeline.png``, in a PPO run and in a GRPO run (which has
no ``ref_logp``, ``values`` or ``critic_update`` and would shift a palette handed out by
position).

This file only draws what was logged; it computes no metrics and does not import Ray.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from avrid.results.colors import span_color
from avrid.results.timeline import Timeline, atomic_write

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PHASES = ("generate", "reward", "reward_model", "old_logp", "ref_logp", "values",
          "advantages", "critic_update", "actor_update", "weight_sync")
"""The trainer's phases in the order a step runs them (the stacking order of the bars);
"reward_model" only with a reward model (`reward_model.path`)."""

NOT_PHASES = ("time/step", "time/compute", "time/overhead")
"""time/* keys that are not phases: the step total, worker compute (overlaps the phases) and
the overhead share (a fraction, not seconds)."""

Rows = Sequence[Mapping[str, Any]]


def reward_figure(rows: Rows, *, title: str | None = None) -> Figure:
    """Train reward (a line over every step) and validation reward (points joined by a line,
    only at the steps that have one) against the step.

    Example:
        >>> fig = reward_figure([{"step": 1, "train/reward": 0.1},
        ...                      {"step": 2, "train/reward": 0.3, "val/reward": 0.25}])
        >>> [line.get_label() for line in fig.axes[0].get_lines()]
        ['train/reward', 'val/reward']
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    for key, style in (("train/reward", {"linewidth": 1.2}),
                       ("val/reward", {"marker": "o", "markersize": 4, "linewidth": 1.2})):
        steps, values = _series(rows, key)
        if steps:
            ax.plot(steps, values, label=key, **style)
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.set_title(title or "reward")
    if drawn:
        ax.legend(frameon=False)
    else:
        _no_data(ax, "no train/reward or val/reward logged")
    return fig


def phase_figure(rows: Rows, *, title: str | None = None) -> Figure:
    """Stacked bars of seconds per phase for every step, with ``time/step`` drawn over them
    as a line (the gap between the two is time no phase accounts for: driver overhead). The
    legend gives each phase's share of the total step time.

    Example:
        >>> fig = phase_figure([{"step": 1, "time/generate": 3.0, "time/actor_update": 1.0,
        ...                      "time/step": 4.0}])
        >>> fig.legends[0].get_texts()[0].get_text()
        'generate  75%'
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title or "time per step, by phase")
    names = _phase_names(rows)
    if not names:
        _no_data(ax, "no time/<phase> metrics logged")
        return fig
    steps = [r["step"] for r in rows]
    totals = {p: sum(_num(r.get(f"time/{p}")) for r in rows) for p in names}
    step_total = sum(_num(r.get("time/step")) for r in rows) or sum(totals.values())
    colors = {p: span_color(p) for p in names}  # by name, never by position
    bottom = [0.0] * len(rows)
    # Bars touching (width 1) read as an area over many steps and as bars over a few.
    for p in names:
        height = [_num(r.get(f"time/{p}")) for r in rows]
        ax.bar(steps, height, bottom=bottom, width=1.0, color=colors[p], edgecolor="none",
               align="center")
        bottom = [b + h for b, h in zip(bottom, height, strict=True)]
    handles = [Patch(color=colors[p], label=f"{p}  {totals[p] / step_total:.0%}")
               for p in names]
    wall_steps, wall = _series(rows, "time/step")
    if wall_steps:
        (line,) = ax.plot(wall_steps, wall, color="black", linewidth=1.0, label="time/step",
                         drawstyle="steps-mid")  # flat across each bar
        handles.append(line)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.legend(handles=handles, loc="outside right upper", frameon=False,
               title="phase, share of step")
    return fig


def write_plots(rows: Rows, out_dir: str | os.PathLike[str], *,
                timeline: Timeline | None = None, timeline_step: int | None = None
                ) -> list[Path]:
    """Write ``reward.png`` and ``phases.png`` into `out_dir`, and with a `timeline` also
    ``timeline.png`` (Gantt chart) and ``timeline.json`` (open in ui.perfetto.dev); each file
    atomically. Returns the paths written, in that order.

    The Gantt chart's title names the step it shows: `timeline_step`, or by default the last
    step in `rows` that trained (has ``time/step``) — the trainer keeps the last step's
    timeline."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_save(reward_figure(rows), out / "reward.png"),
             _save(phase_figure(rows), out / "phases.png")]
    if timeline is not None:
        step = timeline_step if timeline_step is not None else max(
            (r["step"] for r in rows if "time/step" in r), default=None)
        title = "timeline of the last step" if step is None else f"timeline of step {step}"
        paths += [timeline.gantt(out / "timeline.png", title=title),
                  timeline.to_chrome_trace(out / "timeline.json")]
    return paths


def _save(fig: Figure, path: Path) -> Path:
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))


def _num(value: Any) -> float:
    """A logged number, 0 for missing or null (NaN/inf were logged as null)."""
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else 0.0


def _series(rows: Rows, key: str) -> tuple[list[Any], list[float]]:
    """(steps, values) of the rows where `key` holds a number."""
    pairs = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), int | float)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _phase_names(rows: Rows) -> list[str]:
    """Phases present in `rows`: the known ones in pipeline order, then others by name."""
    found = {k.removeprefix("time/") for r in rows for k in r
             if k.startswith("time/") and k not in NOT_PHASES}
    return [p for p in PHASES if p in found] + sorted(found - set(PHASES))


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
