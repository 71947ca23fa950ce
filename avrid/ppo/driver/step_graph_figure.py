"""Chapter 5 — the step's graph drawn: left to right, one lane per worker group.

A phase is a box at column = its depth in the graph (`StepGraph.depths`: boxes in one column
wait for nothing of each other and could run at once) and row = the group it runs on
(`step_graph.GROUPS`, top to bottom). An arrow is an edge: solid when the later phase reads
a column the earlier one wrote, dashed when only the group's order chains them. What
``avrid ppo --print-graph FILE.png`` writes; `print_graph` is that command's whole output.
Not here: the graph itself (`step_graph.py`). matplotlib is imported when a figure is drawn,
not before.
"""

from __future__ import annotations

from pathlib import Path

from avrid.ppo.driver.step_graph import GROUPS, StepGraph, step_graph
from avrid.ppo.setup.config import PPOConfig

FORMATS = (".png", ".pdf", ".svg")
"""The figure formats `draw` writes, by the file name's suffix."""


def print_graph(config: PPOConfig, figure: str | None = None) -> str:
    """What ``avrid ppo --print-graph [FILE]`` prints: the step's graph as text
    (`StepGraph.text`); with `figure`, the graph is drawn to that file too (`draw`)."""
    graph = step_graph(config)
    if figure is None:
        return graph.text()
    draw(graph, figure)
    return graph.text() + f"figure: {figure}\n"


def draw(graph: StepGraph, path: str | Path) -> Path:
    """Draw `graph` to `path` (its suffix picks the format: .png, .pdf, .svg); returns it."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"cannot draw the step graph to {str(path)!r}: the file name must end "
                         f"in one of {', '.join(FORMATS)}")
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window (the command may run on a headless node)
    import matplotlib.pyplot as plt

    depths = graph.depths()
    lanes = [g for g in GROUPS if any(p.group == g for p in graph.phases)]
    row = {g: len(lanes) - 1 - i for i, g in enumerate(lanes)}  # the first group on top
    place: dict[str, tuple[float, float]] = {}
    taken: dict[tuple[int, str], int] = {}  # (depth, group) -> boxes already there
    for p in graph.phases:
        k = taken.get((depths[p.name], p.group), 0)  # driver phases may share a cell
        taken[(depths[p.name], p.group)] = k + 1
        place[p.name] = (depths[p.name] * 2.2, row[p.group] - 0.3 * k)
    width = max(depths.values(), default=0) * 2.2 + 2.5
    fig, ax = plt.subplots(figsize=(min(2 + width * 1.1, 24), 1.2 + 1.1 * len(lanes)))
    for g in lanes:
        ax.axhline(row[g], color="#dddddd", lw=14, zorder=0)
        ax.text(-1.3, row[g], g, ha="right", va="center", fontsize=10, weight="bold")
    boxes = {}
    for p in graph.phases:
        label = p.name + ("\n+ " + ", ".join(p.also_on) if p.also_on else "")
        boxes[p.name] = ax.text(*place[p.name], label, ha="center", va="center", fontsize=8,
                                zorder=2, bbox={"boxstyle": "round,pad=0.35", "fc": "white",
                                                "ec": "#7f7f7f" if p.group == "driver"
                                                else "#1f77b4"})
    for e in graph.edges:  # from box edge to box edge: the arrows are clipped to the boxes
        ax.annotate("", xy=place[e.after], xytext=place[e.before], zorder=1,
                    arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 1,
                                "linestyle": "-" if e.columns else "--",
                                "patchA": boxes[e.before].get_bbox_patch(),
                                "patchB": boxes[e.after].get_bbox_patch(),
                                "connectionstyle": "arc3,rad=0.08"})
    ax.set_xlim(-2.6, width)
    ax.set_ylim(-0.8 - 0.3 * max(taken.values(), default=1), len(lanes) - 0.4)
    ax.axis("off")
    ax.set_title("one step: solid = reads what the other wrote, dashed = same group's order",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
