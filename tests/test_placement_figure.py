"""The placement figure (chapter 1): one box per bundle, one labelled box per worker, and the
seed's three layouts as the chapter draws them. No pixels are compared: the boxes are found by
their gid, the labels by their text."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest

from avrid.workers import Mesh, ResourcePool, RoleSpec, plan_placement
from avrid.workers.placement_figure import BUNDLE_GID, SLOT_GID, placement_figure
from chapters.ch01_workers import layouts
from tests.helpers import EchoWorker

pytestmark = pytest.mark.chapter(1)


def role(name: str, pool: str, n: int, **kw: object) -> RoleSpec:
    return RoleSpec(role=name, worker=EchoWorker, mesh=Mesh.of(dp=n), pool=pool, **kw)


def boxes(ax: object, prefix: str) -> list[str]:
    return sorted(p.get_gid().removeprefix(prefix + " ") for p in ax.patches  # type: ignore[attr-defined]
                  if (p.get_gid() or "").startswith(prefix + " "))


def test_each_bundle_is_one_box_and_each_worker_a_labelled_box_in_it() -> None:
    # A GPU pool shared by two roles, a CPU-only pool of its own, and a worker reserving no
    # GPU on a GPU bundle (drawn thin, not left out).
    plan = plan_placement(
        [ResourcePool.uniform("gpus", 3, cpus=2, gpus=1), ResourcePool.uniform("cpu", 2)],
        [role("actor", "gpus", 3, cpus=1, gpus=0.5), role("critic", "gpus", 2, cpus=0.5,
                                                           gpus=0.5),
         role("reward", "gpus", 1, cpus=0.5), role("judge", "cpu", 2, cpus=0.5)])
    fig = placement_figure({"mixed": plan})
    (ax,) = fig.axes
    assert boxes(ax, BUNDLE_GID) == ["cpu[0]", "cpu[1]", "gpus[0]", "gpus[1]", "gpus[2]"]
    assert boxes(ax, SLOT_GID) == sorted(f"{s.role}[{s.rank}]" for s in plan.slots)
    texts = [t.get_text() for t in ax.texts]
    for s in plan.slots:
        share = f"{s.gpus:g} GPU, {s.cpus:g} CPU" if s.gpus else f"{s.cpus:g} CPU"
        assert f"{s.role}[{s.rank}]\n{share}" in texts
    assert "pool 'gpus' (PACK)" in texts and "pool 'cpu' (PACK)" in texts
    assert ax.get_title(loc="left") == "mixed"


def test_a_role_has_one_colour_in_every_row() -> None:
    plans = layouts.seed_layouts()
    fig = placement_figure(plans)
    assert len(fig.axes) == len(plans)
    colour: dict[str, set[tuple[float, ...]]] = {}
    for ax in fig.axes:
        for p in ax.patches:
            if (p.get_gid() or "").startswith(SLOT_GID):
                name = p.get_gid().removeprefix(SLOT_GID + " ").split("[")[0]
                colour.setdefault(name, set()).add(tuple(p.get_facecolor()))
    assert set(colour) == set(layouts.MODELS)
    assert all(len(c) == 1 for c in colour.values()), colour
    assert len({next(iter(c)) for c in colour.values()}) == len(layouts.MODELS)


def test_the_seed_layouts_colocate_what_each_system_colocates() -> None:
    plans = layouts.seed_layouts()
    ds, orlhf, nemo = plans.values()
    shared = {name: {frozenset(pair) for pair in combinations(layouts.MODELS, 2)
                     if plan.colocated(*pair)} for name, plan in plans.items()}
    assert shared[next(iter(plans))] == {frozenset(p) for p in combinations(layouts.MODELS, 2)}
    assert shared[list(plans)[1]] == set()
    assert shared[list(plans)[2]] == {frozenset({"actor", "reference"}),
                                      frozenset({"critic", "reward"})}
    for plan in (ds, orlhf, nemo):  # the same four GPUs, every one of them full
        assert sum(len(p.bundles) for p in plan.pools) == layouts.GPUS
        assert sum(s.gpus for s in plan.slots) == pytest.approx(layouts.GPUS)


def test_the_layouts_script_writes_the_figure(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = layouts.main(tmp_path / "layouts.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert printed.count("== ") == 3 and "bundle 0" in printed


def test_nothing_to_draw_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one PlacementPlan"):
        placement_figure({})
