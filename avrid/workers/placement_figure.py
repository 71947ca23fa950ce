"""Chapter 1 — a placement drawn: bundles as columns, the roles sitting in each with their share.

`placement_figure` draws one or more `PlacementPlan`s, one row each. In a row every bundle of
every pool is a column (a pool's bundles side by side under its name, a gap between pools); the
workers placed in a bundle are stacked boxes inside it, each as tall as its share of the
bundle's GPU (of its CPUs, for a CPU-only bundle) and labelled ``role[rank]`` with the CPUs and
GPUs it reserves. What is left white in a column is reserved and unused. Colocated roles share a
column; a disaggregated role has columns of its own.

A role keeps one colour in every row of a figure (by name, in order of first appearance), so
the same layouts drawn side by side read at a glance: where the actor is alone, where it
shares.

Not here: planning or checking a placement (`placement.py`: this file draws a plan that is
already checked), starting anything. matplotlib is imported when a figure is drawn (it is a
dev/notebook dependency); the figure is built without pyplot, so a notebook shows it inline and
the global backend is untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from avrid.workers.placement import Bundle, PlacementPlan, Slot

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

BUNDLE_GID = "bundle"
"""`gid` prefix of a bundle's outline (``bundle policy[0]``): lets a test count the boxes."""
SLOT_GID = "slot"
"""`gid` prefix of a worker's box in a bundle (``slot actor[0]``)."""
_MIN_HEIGHT = 0.08  # a worker reserving none of the measured resource is still drawn, thin
_POOL_GAP = 0.5  # horizontal space between two pools, in bundle widths


def placement_figure(plans: PlacementPlan | Mapping[str, PlacementPlan]) -> Figure:
    """A figure of `plans`, one row per plan titled by its key (a single plan: one row,
    untitled): bundles as columns, each holding its workers' boxes.

    Example:
        >>> from avrid.workers import Mesh, ResourcePool, RoleSpec, plan_placement
        >>> plan = plan_placement([ResourcePool.uniform("gpus", 2, cpus=2, gpus=1)], [
        ...     RoleSpec(role="actor", worker=object, mesh=Mesh.of(dp=2), pool="gpus",
        ...              cpus=1, gpus=0.5),
        ...     RoleSpec(role="critic", worker=object, mesh=Mesh.of(dp=2), pool="gpus",
        ...              cpus=1, gpus=0.5)])
        >>> fig = placement_figure({"colocated": plan})
        >>> [p.get_gid() for p in fig.axes[0].patches if p.get_gid().startswith("bundle")]
        ['bundle gpus[0]', 'bundle gpus[1]']
    """
    from matplotlib.figure import Figure

    named = {"": plans} if isinstance(plans, PlacementPlan) else dict(plans)
    if not named:
        raise ValueError("placement_figure needs at least one PlacementPlan to draw")
    colors = _role_colors(named.values())
    widest = max(_width(plan) for plan in named.values())
    fig = Figure(figsize=(1.2 + 1.45 * widest, 2.6 * len(named)), layout="constrained")
    for ax, (title, plan) in zip(fig.subplots(len(named), 1, squeeze=False)[:, 0],
                                 named.items(), strict=True):
        _draw(ax, plan, colors, widest)
        if title:
            ax.set_title(title, loc="left", fontsize=10, weight="bold")
    return fig


def _draw(ax: Axes, plan: PlacementPlan, colors: Mapping[str, Any], widest: float) -> None:
    """One plan on `ax`: every pool's bundles left to right, the workers stacked in each."""
    from matplotlib.patches import Rectangle

    x = 0.0
    top = 1.0
    for pool in plan.pools:
        first = x
        for b, bundle in enumerate(pool.bundles):
            here = [s for s in plan.slots if s.pool == pool.name and s.bundle == b]
            y = 0.0
            for slot in here:
                h = max(_share(slot, bundle), _MIN_HEIGHT)
                ax.add_patch(Rectangle((x, y), 0.9, h, facecolor=colors[slot.role],
                                       edgecolor="white", linewidth=1.5,
                                       gid=f"{SLOT_GID} {slot.role}[{slot.rank}]"))
                ax.text(x + 0.45, y + h / 2, f"{slot.role}[{slot.rank}]\n{_reserves(slot)}",
                        ha="center", va="center", fontsize=7 if h >= 0.2 else 6)
                y += h
            top = max(top, y)
            # The outline on top: the bundle's whole reservation, used or not.
            ax.add_patch(Rectangle((x, 0.0), 0.9, max(y, 1.0), fill=False, edgecolor="0.25",
                                   linewidth=1.2, gid=f"{BUNDLE_GID} {pool.name}[{b}]"))
            ax.text(x + 0.45, -0.04, f"bundle {b}\n{_reserves(bundle)}", ha="center",
                    va="top", fontsize=7, color="0.3")
            x += 1.0
        ax.text((first + x - 0.1) / 2, top + 0.06,
                f"pool {pool.name!r} ({pool.strategy})", ha="center", va="bottom", fontsize=8)
        x += _POOL_GAP
    ax.set_xlim(-0.1, widest)
    ax.set_ylim(-0.32, top + 0.25)
    ax.axis("off")


def _share(slot: Slot, bundle: Bundle) -> float:
    """The height of a worker's box: its share of the bundle's GPUs, or of its CPUs when the
    bundle has no GPU (the resource the roles compete for)."""
    if bundle.gpus > 0:
        return slot.gpus / bundle.gpus
    return slot.cpus / bundle.cpus


def _reserves(what: Slot | Bundle) -> str:
    """``0.5 GPU, 1 CPU`` (GPUs first, left out when none)."""
    cpu = f"{what.cpus:g} CPU"
    return f"{what.gpus:g} GPU, {cpu}" if what.gpus > 0 else cpu


def _width(plan: PlacementPlan) -> float:
    """How many bundle widths one plan's row needs, the gaps between pools included."""
    return sum(len(p.bundles) for p in plan.pools) + _POOL_GAP * (len(plan.pools) - 1)


def _role_colors(plans: Iterable[PlacementPlan]) -> dict[str, Any]:
    """One colour per role name, by first appearance over `plans` (tab10, then tab20)."""
    from matplotlib import colormaps

    names: list[str] = []
    for plan in plans:
        names += [r.role for r in plan.roles if r.role not in names]
    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    # Light tints: the black labels stay readable on every colour.
    return {n: (*cmap(i % cmap.N)[:3], 0.55) for i, n in enumerate(names)}
