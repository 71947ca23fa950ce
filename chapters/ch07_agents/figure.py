"""Chapter 7 — the picture of the chapter: when the engine works, and what the trainer learns.

`agents_figure(schedules, trajectories)` draws two panels:

- top: one row per schedule ("per_trajectory", "turn_sync"), a bar for every engine call
  from its start to its end, grey where the engine waits (for tools, in turn_sync for the
  slowest tool of each turn). The busy share is in the row's label;
- bottom: the trajectories' tokens as a mask picture, one row per episode, one cell per
  response token: the policy's tokens coloured by the weight version that generated them
  (several colours in one turn: a partial rollout), observation tokens grey (context
  only: no gradient, no advantage), white past the episode's end; given a `glyph` per token
  id, each cell shows its token ("$" for EOS) and each row its prompt.

`save_agents_figure` writes it atomically. matplotlib is imported inside the functions and
pyplot is never used, so the global backend is untouched (a notebook shows the returned
figure inline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from avrid.agents.trajectory import Trajectory
from avrid.results import atomic_write

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Calls = Sequence[tuple[float, float]]
"""An engine's calls: (start, end) seconds from the rollout's start."""


def agents_figure(schedules: dict[str, tuple[Calls, float]],
                  trajectories: Sequence[Trajectory], *,
                  glyph: Callable[[int], str] | None = None,
                  title: str | None = None) -> Figure:
    """The two panels of the module docstring. `schedules`: label -> (calls, wall seconds);
    `glyph` (token id -> one character, `workloads.glyphs`): each token written in its cell,
    each prompt beside its row."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(11, 2.2 + 0.28 * len(trajectories)), layout="constrained")
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1.1, 0.12 + 0.1 *
                                                                     len(trajectories)]})
    width = max(wall for _, wall in schedules.values())
    for row, (calls, wall) in enumerate(schedules.values()):
        busy = sum(end - start for start, end in calls)
        top.barh(row, wall, height=0.7, color="0.92")
        top.broken_barh([(s, e - s) for s, e in calls], (row - 0.35, 0.7), color="tab:blue",
                        edgecolor="white", linewidth=0.6)  # a white line between two calls
        top.text(wall, row, f"  {busy / wall:.0%} busy", va="center", fontsize=9)
    top.set_yticks(range(len(schedules)), list(schedules))
    top.invert_yaxis()
    top.set_xlim(0, width * 1.12)
    top.set_xlabel("seconds from the rollout's start (blue: the engine generates; "
                   "grey: it waits for tools)")
    top.set_title("the same episodes, two schedules", loc="left", fontsize=10)

    length = max(len(t.ids) for t in trajectories)
    top_version = max([v for t in trajectories for v in t.version] + [0])
    grid = np.full((len(trajectories), length), -2.0)  # -2 past the end, -1 observation
    for i, t in enumerate(trajectories):
        grid[i, :len(t.ids)] = t.version
    versions = [f"C{v % 10}" for v in range(top_version + 1)]
    cmap = ListedColormap(["white", "0.75", *versions])
    bottom.imshow(grid + 2, cmap=cmap, vmin=0, vmax=top_version + 3, aspect="auto",
                  interpolation="nearest")
    names = ["".join(map(glyph, t.prompt)) if glyph else f"episode {i}"
             for i, t in enumerate(trajectories)]
    bottom.set_yticks(range(len(trajectories)), names, fontsize=8)
    for i, t in enumerate(trajectories if glyph else ()):
        for j, token in enumerate(t.ids):
            bottom.text(j, i, glyph(token), ha="center", va="center", fontsize=7,
                        color="white" if t.action[j] else "black")
    bottom.set_xlabel("response token (after the prompt)")
    bottom.set_title("what trains: policy tokens by weight version; grey observations are "
                     "masked out", loc="left", fontsize=10)
    bottom.legend(handles=[Patch(color="0.75", label="observation (mask 0)")] +
                  [Patch(color=c, label=f"policy, version {v}") for v, c in
                   enumerate(versions)], loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    return fig


def save_agents_figure(schedules: dict[str, tuple[Calls, float]],
                       trajectories: Sequence[Trajectory], path: str | Path, *,
                       glyph: Callable[[int], str] | None = None,
                       title: str | None = None) -> Path:
    """`agents_figure` as a PNG at `path`, written atomically; returns the path."""
    fig = agents_figure(schedules, trajectories, glyph=glyph, title=title)
    return atomic_write(Path(path), lambda f: fig.savefig(f, format="png", dpi=110))
