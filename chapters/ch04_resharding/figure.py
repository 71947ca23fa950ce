"""Chapter 4 — the picture of a transfer plan: who sends which slice of a tensor to whom, and
what it costs next to verl's all-gather.

`transfer_figure(plan)` draws two rows:

- top: one parameter (by default the first row-parallel one, e.g. ``o_proj``, the case where a
  TP slice cuts across *every* FSDP shard). Left, the trainer's layout: each row block of the
  tensor coloured by the FSDP rank that holds it. Then one panel per target (TP) rank: the box
  that rank needs, each piece coloured by the source rank that sends it under the plan; hatched
  pieces are local copies (the target's own process already holds them: no network). Grey is
  what that rank does not need;
- bottom: bytes per (source rank, target rank) pair over the whole model, as two heatmaps on
  one colour scale: the plan's transfers, and the all-gather-then-slice baseline, where every
  target rank receives every source rank's whole shard of each tensor it touches.

`save_transfer_figure` writes it atomically (`avrid.results.atomic_write`, as every avrid
output). The demo saves one per plan; the test draws a small plan. matplotlib is
imported only inside the functions (a dev/notebook dependency), and no pyplot: the global
backend is never touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from avrid.reshard import TransferPlan
from avrid.results import atomic_write, palette

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NOT_NEEDED = "0.93"  # the same light grey as an idle stretch of a Gantt chart


def naive_matrix(plan: TransferPlan) -> np.ndarray:
    """Bytes [source rank, target rank] of all-gather-then-slice: every target rank that
    holds any part of a parameter receives each source rank's whole shard of it. Sums to
    `plan.bytes_naive` when the source shards do not overlap (FSDP)."""
    out = np.zeros((plan.source_world, plan.target_world), dtype=np.int64)
    src = dict(plan.source.params)
    for name, dst in plan.target.params:
        for t, need in enumerate(dst.regions):
            if need is not None:
                out[:, t] += [src[name].bytes_on(s) for s in range(plan.source_world)]
    return out


def planned_matrix(plan: TransferPlan, *, local: bool = False) -> np.ndarray:
    """Bytes [source rank, target rank] the plan sends between processes (with `local`: the
    bytes it copies inside a process instead)."""
    out = np.zeros((plan.source_world, plan.target_world), dtype=np.int64)
    for x in plan.local if local else plan.transfers:
        out[x.src_rank, x.dst_rank] += x.nbytes
    return out


def default_param(plan: TransferPlan) -> str:
    """The first row-parallel 2-D parameter (the most instructive), else the first 2-D one."""
    two_d = [(n, p) for n, p in plan.target.params if len(p.shape) == 2]
    if not two_d:
        raise ValueError("transfer_figure draws a 2-D parameter; this plan has none")
    return next((n for n, p in two_d if p.kind == "row"), two_d[0][0])


def transfer_figure(plan: TransferPlan, param: str | None = None) -> Figure:
    """The plan as a `Figure`: `param`'s slices by sender (top), bytes per rank pair against
    the all-gather baseline (bottom); see the module docstring. Axes, in order: the source
    layout, one per target rank, the planned heatmap, the all-gather heatmap."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    name = param or default_param(plan)
    S, T = plan.source_world, plan.target_world
    rank_colors = palette(S)
    cmap = ListedColormap(rank_colors).with_extremes(bad=NOT_NEEDED)
    fig = Figure(figsize=(3.0 * (T + 1) + 1.5, 7.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1.1, 1.0])
    axes = top.subplots(1, T + 1, sharey=True)
    shape = dict(plan.source.params)[name].shape

    owner = np.full(shape, np.nan)
    for s, region in enumerate(dict(plan.source.params)[name].regions):
        if region is not None:
            owner[region.to_slices()] = s
    _tensor(axes[0], owner, cmap, S, f"source: FSDP over {S}\nrows by the rank that holds them")
    for t in range(T):
        sender = np.full(shape, np.nan)
        mine = [x for x in (*plan.transfers, *plan.local) if x.param == name and x.dst_rank == t]
        for x in mine:
            sender[x.region.to_slices()] = x.src_rank
        need = dict(plan.target.params)[name].regions[t]
        _tensor(axes[t + 1], sender, cmap, S, f"target t{t} needs {need}\ncoloured by sender")
        for x in (x for x in plan.local if x.param == name and x.dst_rank == t):
            _hatch(axes[t + 1], x.region.bounds)
    top.suptitle(f"{name} {tuple(shape)}: who sends which slice to whom")
    home = {s: t for t, s in plan.same_process}  # the target rank sharing s's process
    top.legend(handles=[Patch(color=c, label=f"s{s}" + (f" (t{home[s]}'s process)"
                                                        if s in home else ""))
                        for s, c in enumerate(rank_colors)]
               + [Patch(facecolor="white", edgecolor="0.3", hatch="//",
                        label="local copy, no network")] * bool(plan.local)
               + [Patch(color=NOT_NEEDED, label="not needed here")],
               loc="outside lower center", ncols=S + 2, frameon=False, fontsize=9)

    planned, naive = planned_matrix(plan), naive_matrix(plan)
    vmax = max(int(naive.max()), int(planned.max()), 1)
    left, right = bottom.subplots(1, 2)
    local = f" (+ {_mib(plan.bytes_local)} local copies)" if plan.local else ", nothing local"
    _heatmap(left, planned, vmax, planned_matrix(plan, local=True),
             f"planned: {_mib(plan.bytes_moved)} moved{local}")
    _heatmap(right, naive, vmax, None, f"all-gather then slice: {_mib(int(naive.sum()))} "
             f"({naive.sum() / max(plan.bytes_moved, 1):.1f}x)")
    bottom.suptitle("bytes sent per rank pair, whole model (one colour scale)")
    return fig


def save_transfer_figure(plan: TransferPlan, path: Path, param: str | None = None) -> Path:
    """`transfer_figure` as a PNG at `path`, written atomically; returns `path`."""
    fig = transfer_figure(plan, param)
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))


def _tensor(ax: Axes, ranks: np.ndarray, cmap: object, n: int, title: str) -> None:
    """A 2-D tensor as an image: each element coloured by a rank, NaN (not needed) grey."""
    ax.imshow(np.ma.masked_invalid(ranks), cmap=cmap, vmin=-0.5, vmax=n - 0.5,
              aspect="auto", interpolation="nearest")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("dim 1")
    ax.set_ylabel("dim 0")


def _hatch(ax: Axes, bounds: tuple[tuple[int, int], ...]) -> None:
    """Hatch a box (local copy) over the image; pixel centres sit on integers."""
    from matplotlib.patches import Rectangle

    (r0, r1), (c0, c1) = bounds
    ax.add_patch(Rectangle((c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0, fill=False,
                           hatch="//", edgecolor="white", linewidth=0))


def _heatmap(ax: Axes, m: np.ndarray, vmax: int, local: np.ndarray | None,
             title: str) -> None:
    """Source rank down, target rank across, each cell labelled in MiB (and the bytes copied
    locally instead, where there are some)."""
    ax.imshow(m, cmap="Blues", vmin=0, vmax=vmax, aspect="auto")
    for (s, t), v in np.ndenumerate(m):
        text = _mib(int(v)) if v else "-"
        if local is not None and local[s, t]:
            text += f"\n(+ {_mib(int(local[s, t]))} local)"
        ax.text(t, s, text, ha="center", va="center", fontsize=9,
                color="white" if v > 0.6 * vmax else "black")
    ax.set_xticks(range(m.shape[1]), [f"t{t}" for t in range(m.shape[1])])
    ax.set_yticks(range(m.shape[0]), [f"s{s}" for s in range(m.shape[0])])
    ax.set_xlabel("target rank (TP)")
    ax.set_ylabel("source rank (FSDP)")
    ax.set_title(title, fontsize=9)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
