"""Ray-only failure behaviour, each case timed: death, hangs, impossible placements, bad init.

Every test uses the leak-checked `ray_cluster` fixture, so each also proves the group released
its actors and placement groups after the failure.
"""

from __future__ import annotations

import time

import pytest

from avrid.workers import (
    Bundle,
    Mesh,
    PlacementError,
    ResourcePool,
    RoleSpec,
    WorkerError,
    plan_placement,
)
from tests.helpers import COLLECTIVE_TIMEOUT_S, BrokenInitWorker, EchoWorker

pytestmark = [pytest.mark.chapter(1), pytest.mark.usefixtures("ray_cluster")]


def _backend(**kw: float):  # noqa: ANN202
    from avrid.workers import RayBackend

    return RayBackend(**kw)


def echo_plan(n: int, pool: ResourcePool | None = None, worker: type = EchoWorker):  # noqa: ANN201
    pool = pool or ResourcePool.uniform("cpu", n)
    return plan_placement([pool], [RoleSpec(role="actor", worker=worker, mesh=Mesh.of(dp=n),
                                            pool=pool.name)])


def test_each_rank_process_exports_the_torch_rendezvous_from_its_identity() -> None:
    pool = ResourcePool(name="node", bundles=(Bundle(cpus=2),) * 2)
    plan = plan_placement([pool], [RoleSpec(role="actor", worker=EchoWorker,
                                            mesh=Mesh.of(dp=2, tp=2), pool="node",
                                            workers_per_bundle=2)])
    with _backend().launch(plan) as cluster:
        group = cluster.group("actor", EchoWorker)
        envs = group.call(EchoWorker.torch_env)
        idents = group.identities
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]  # index inside the bundle
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    rdv = idents[0].rendezvous
    assert rdv is not None and rdv.master_addr == idents[0].node
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {
        (rdv.master_addr, str(rdv.master_port))}


def test_a_worker_that_dies_mid_call_is_reported_within_10_s() -> None:
    with _backend().launch(echo_plan(2)) as cluster:
        group = cluster.group("actor", EchoWorker)
        start = time.monotonic()
        with pytest.raises(WorkerError) as err:
            group.call_ranks([1], EchoWorker.die)
        elapsed = time.monotonic() - start
    assert elapsed < 10, elapsed
    e = err.value
    assert (e.role, e.rank, e.method, e.reason) == ("actor", 1, "die", "died")
    assert "its process exited during the call" in str(e)


def test_death_inside_a_collective_does_not_hang_the_peers() -> None:
    # Ranks 0, 2, 3 block in an all-reduce that rank 1 never joins: the driver must not wait
    # for them (a verl classic), it reports rank 1 as soon as its process is gone.
    with _backend().launch(echo_plan(4)) as cluster:
        group = cluster.group("actor", EchoWorker)
        start = time.monotonic()
        with pytest.raises(WorkerError) as err:
            group.call(EchoWorker.die_in_collective, 1)
        elapsed = time.monotonic() - start
    # A hang would last until the peers' all-reduce times out (`COLLECTIVE_TIMEOUT_S`);
    # half that is the bound. Not 10 s: the call includes the four ranks' gloo rendezvous,
    # which alone took seconds on a 2-core machine beside other work (10.02 s was seen).
    assert elapsed < COLLECTIVE_TIMEOUT_S / 2, elapsed
    assert (err.value.rank, err.value.reason) == (1, "died")


def test_a_stuck_call_ends_at_its_timeout_naming_the_late_ranks() -> None:
    with _backend(call_timeout_s=1.0).launch(echo_plan(2)) as cluster:
        group = cluster.group("actor", EchoWorker)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"actor\[0\].sleep\(\) timeout: ranks \[0, 1\] "
                                              r"still running after 1.0 s"):
            group.call(EchoWorker.sleep, 30)
        assert time.monotonic() - start < 5


def test_asking_for_more_than_exists_fails_at_once_saying_what_and_what_exists() -> None:
    import ray

    have = ray.cluster_resources()["CPU"]
    start = time.monotonic()
    with pytest.raises(PlacementError) as err:
        _backend().launch(echo_plan(1, ResourcePool.uniform("big", 4, cpus=have)))
    assert time.monotonic() - start < 2
    msg = str(err.value)
    assert f"asks for {4 * have:g} CPU and 0 GPU in 4 bundles" in msg
    assert f"the cluster has {have:g} CPU and 0 GPU (short of CPU)" in msg

    with pytest.raises(PlacementError, match="short of GPU"):
        _backend().launch(echo_plan(1, ResourcePool.uniform("gpu", 1, gpus=1)))


def test_a_placement_that_fits_in_total_but_not_per_node_fails_within_its_timeout() -> None:
    # Two bundles on two distinct nodes cannot happen on a one-node cluster.
    pool = ResourcePool(name="spread", bundles=(Bundle(cpus=1),) * 2, strategy="STRICT_SPREAD")
    start = time.monotonic()
    with pytest.raises(PlacementError) as err:
        _backend(placement_timeout_s=2).launch(echo_plan(2, pool))
    assert time.monotonic() - start < 10
    msg = str(err.value)
    assert "pool 'spread' (2 bundles [{'CPU': 1}, {'CPU': 1}], STRICT_SPREAD)" in msg
    assert "could not be placed within 2 s; the cluster has" in msg


def test_a_failing_constructor_names_the_rank_and_leaves_nothing_behind() -> None:
    with pytest.raises(WorkerError) as err:
        _backend().launch(echo_plan(2, worker=BrokenInitWorker))
    e = err.value
    assert (e.rank, e.method, e.reason) == (1, "__init__", "raised")
    assert "cannot load model on this rank" in e.remote_traceback


def test_launch_without_ray_running_says_how_to_start_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="start_ray"):
        _backend().launch(echo_plan(1))
