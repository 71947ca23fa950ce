"""The device mesh: coordinates, groups and collect ranks, and its errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from avrid.workers import Mesh, MeshError

pytestmark = pytest.mark.chapter(1)

sizes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


def _mesh(ss: list[int]) -> Mesh:
    return Mesh(tuple(f"a{i}" for i in range(len(ss))), tuple(ss))


def test_dp_tp_layout_is_row_major_with_tp_fastest() -> None:
    mesh = Mesh.of(dp=2, tp=2)
    assert [mesh.coords(r) for r in range(4)] == [
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert mesh.groups("tp") == [[0, 1], [2, 3]]
    assert mesh.groups("dp") == [[0, 2], [1, 3]]
    assert mesh.collect_ranks() == [0, 2]
    assert mesh.collect_ranks("tp") == [0, 1]
    assert mesh.ranks_where(dp=1) == [2, 3]
    assert mesh.ranks_along("dp", 3) == [1, 3]
    assert str(mesh) == "dp=2 x tp=2"


@given(sizes)
def test_coords_and_rank_of_are_inverse(ss: list[int]) -> None:
    mesh = _mesh(ss)
    seen = set()
    for r in range(mesh.size):
        c = mesh.coords(r)
        assert mesh.rank_of(**c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == mesh.size


@given(sizes, st.data())
def test_groups_along_an_axis_partition_the_ranks(ss: list[int], data: st.DataObject) -> None:
    mesh = _mesh(ss)
    axis = data.draw(st.sampled_from(mesh.names))
    groups = mesh.groups(axis)
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(mesh.size))
    assert all(len(g) == mesh.axis_size(axis) for g in groups)
    for g in groups:  # members differ only along `axis`
        for r in g:
            assert mesh.ranks_along(axis, r) == g
    # one collect rank per coordinate of the data axis
    assert len(mesh.collect_ranks()) == mesh.sizes[0]


def test_mesh_errors_are_clear() -> None:
    with pytest.raises(MeshError, match="covers 4 ranks but the group has 3 workers"):
        Mesh.of(dp=2, tp=2).check_world_size(3)
    with pytest.raises(MeshError, match="unknown mesh axis 'pp'"):
        Mesh.of(dp=2).groups("pp")
    with pytest.raises(MeshError, match="integer size >= 1"):
        Mesh.of(dp=0)
    with pytest.raises(MeshError, match="unique"):
        Mesh(("dp", "dp"), (1, 1))
    with pytest.raises(MeshError, match="outside the mesh"):
        Mesh.of(dp=2).coords(2)
    with pytest.raises(MeshError, match="needs exactly the axes"):
        Mesh.of(dp=2, tp=2).rank_of(dp=1)


def test_a_group_whose_mesh_does_not_match_its_workers_fails_at_once() -> None:
    import time

    from avrid.workers import WorkerGroup, WorkerIdentity
    from tests.helpers import EchoWorker

    # RoleSpec derives the world size from the mesh, so this can only happen when a group is
    # wired by hand; it must still fail before any call is made.
    idents = [WorkerIdentity(role="actor", rank=r, world_size=3) for r in range(3)]
    start = time.monotonic()
    with pytest.raises(MeshError, match=r"mesh dp=2 x tp=2 covers 4 ranks but the group has 3"):
        WorkerGroup(role="actor", worker_cls=EchoWorker, mesh=Mesh.of(dp=2, tp=2),
                    identities=idents, channel=None)  # type: ignore[arg-type]
    assert time.monotonic() - start < 1.0  # no worker waited on (a busy machine stalls 0.1 s)
