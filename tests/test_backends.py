"""One contract, two backends: the same scenarios on Ray and in-process give the same results.

`backend` is parametrized: "ray" (actors in placement groups, leak-checked) and "inprocess"
(threads in this process). Ray-only behaviour (process death, real placement) lives in
test_ray_failures.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from avrid.workers import (
    Backend,
    InProcessBackend,
    Mesh,
    ResourcePool,
    RoleSpec,
    UnknownMethodError,
    WorkerError,
    plan_placement,
)
from tests.helpers import EchoWorker, OtherWorker

pytestmark = pytest.mark.chapter(1)


def colocated_plan() -> Any:
    """actor (dp=2) and rollout (dp=2) share 2 bundles; critic has a pool of its own."""
    return plan_placement(
        [ResourcePool.uniform("shared", 2, cpus=1), ResourcePool.uniform("own", 1, cpus=1)],
        [RoleSpec(role="actor", worker=EchoWorker, mesh=Mesh.of(dp=2), pool="shared",
                  cpus=0.5, init_kwargs={"offset": 100}),
         RoleSpec(role="rollout", worker=EchoWorker, mesh=Mesh.of(dp=2), pool="shared",
                  cpus=0.5),
         RoleSpec(role="critic", worker=EchoWorker, mesh=Mesh.of(dp=1), pool="own")])


def scenario(backend: Backend) -> dict[str, Any]:
    """Everything a group can do, returned as plain values to compare across backends."""
    with backend.launch(colocated_plan()) as cluster:
        actor = cluster.group("actor", EchoWorker)
        rollout = cluster.group("rollout", EchoWorker)
        critic = cluster.group("critic", EchoWorker)
        where = {role: [(i.pool, i.bundle, i.local_rank, dict(i.coords))
                        for i in cluster.group(role).identities] for role in cluster.roles}
        return {
            "where": where,
            "same": actor.call(EchoWorker.add, 1, y=2),
            "per_rank": actor.call_per_rank(EchoWorker.add, [10, 20], y=[1, 2]),
            "some": rollout.call_ranks([1, 0], EchoWorker.add, 5),
            "submitted": critic.submit(EchoWorker.add, 7).result(),
            "state": actor.call(EchoWorker.count),
            "allreduce": rollout.call(EchoWorker.all_reduce_rank),
            "identity": [i.name for i in actor.call(EchoWorker.whoami)],
        }


def test_scenario_gives_the_same_results_on_both_backends(ray_cluster: None) -> None:
    from avrid.workers import RayBackend

    on_ray = scenario(RayBackend())
    in_process = scenario(InProcessBackend(concurrent=True))
    assert on_ray == in_process
    assert on_ray["same"] == [103, 104]
    assert on_ray["per_rank"] == [111, 123]
    assert on_ray["some"] == [6, 5]
    assert on_ray["submitted"] == [7]
    assert on_ray["state"] == [2, 2]  # per-worker state persists between calls
    assert on_ray["allreduce"] == [3.0, 3.0]  # 1 + 2 over gloo
    assert on_ray["identity"] == ["actor[0]", "actor[1]"]


def test_colocated_roles_share_bundles_by_identity(backend: Backend) -> None:
    with backend.launch(colocated_plan()) as cluster:
        ids = {role: cluster.group(role).call(EchoWorker.whoami) for role in cluster.roles}
    actor_at = [(i.pool, i.bundle) for i in ids["actor"]]
    assert actor_at == [(i.pool, i.bundle) for i in ids["rollout"]]
    assert actor_at == [("shared", 0), ("shared", 1)]
    assert {(i.pool, i.bundle) for i in ids["critic"]}.isdisjoint(actor_at)
    assert [i.coords for i in ids["actor"]] == [{"dp": 0}, {"dp": 1}]
    assert all(i.node for i in ids["actor"])  # filled in by the worker's own process


def test_gloo_all_reduce_over_four_workers_in_one_placement_group(backend: Backend) -> None:
    plan = plan_placement([ResourcePool.uniform("cpu", 4, strategy="STRICT_PACK")],
                          [RoleSpec(role="actor", worker=EchoWorker, mesh=Mesh.of(dp=4),
                                    pool="cpu")])
    with backend.launch(plan) as cluster:
        assert cluster.group("actor").call(EchoWorker.all_reduce_rank) == [10.0] * 4


def test_a_raising_method_names_role_rank_method_and_remote_traceback(backend: Backend) -> None:
    with backend.launch(colocated_plan()) as cluster:
        rollout = cluster.group("rollout", EchoWorker)
        start = time.monotonic()
        with pytest.raises(WorkerError) as err:
            rollout.call(EchoWorker.fail_on_rank, 1)
        assert time.monotonic() - start < 5
        e = err.value
        assert (e.role, e.rank, e.method, e.reason) == ("rollout", 1, "fail_on_rank", "raised")
        assert str(e).startswith("rollout[1].fail_on_rank() raised: KeyError")
        assert "rank 1 refuses" in e.remote_traceback
        assert "helpers.py" in e.remote_traceback  # the line in the worker's own code
        # the group is still usable after a method raised
        assert rollout.call(EchoWorker.add, 0) == [0, 1]


def test_unknown_methods_fail_at_once_before_anything_is_sent(backend: Backend) -> None:
    with backend.launch(colocated_plan()) as cluster:
        actor = cluster.group("actor", EchoWorker)
        for bad, match in [(OtherWorker.add, "is not a method of EchoWorker"),
                           (lambda self: 1, "is not a method of EchoWorker"),
                           ("add", "is not a method of EchoWorker"),
                           (EchoWorker._private, "private")]:
            start = time.monotonic()
            with pytest.raises(UnknownMethodError, match=match):
                actor.call(bad)  # type: ignore[arg-type]
            assert time.monotonic() - start < 1.0  # no call waited on (a busy machine stalls 0.1 s)
        assert actor.call(EchoWorker.count) == [0, 0]  # nothing ran
        with pytest.raises(ValueError, match="per-rank argument 0 has 3 items, the group "
                                             "has 2 ranks"):
            actor.call_per_rank(EchoWorker.add, [1, 2, 3])
        with pytest.raises(TypeError, match="runs EchoWorker, not OtherWorker"):
            cluster.group("actor", OtherWorker)


def test_cluster_releases_workers_after_an_error_inside_the_block(backend: Backend) -> None:
    with pytest.raises(RuntimeError, match="user code failed"):
        with backend.launch(colocated_plan()) as cluster:
            cluster.group("actor").call(EchoWorker.add, 1)
            raise RuntimeError("user code failed")
    # for Ray, the ray_cluster fixture fails this test if any actor or placement group is left


def test_sequential_in_process_backend_runs_in_the_callers_thread() -> None:
    import threading

    plan = plan_placement([ResourcePool.uniform("cpu", 2)],
                          [RoleSpec(role="a", worker=EchoWorker, mesh=Mesh.of(dp=2), pool="cpu")])
    with InProcessBackend().launch(plan) as cluster:
        group = cluster.group("a", EchoWorker)
        assert group.call(EchoWorker.add, 1) == [1, 2]
        assert all(i.rendezvous is None for i in group.identities)
        with pytest.raises(WorkerError, match="no rendezvous") as err:
            group.call(EchoWorker.all_reduce_rank)  # would deadlock; says why instead
        assert "InProcessBackend(concurrent=True)" in str(err.value)
    main = threading.current_thread().name
    with InProcessBackend().launch(plan) as cluster:
        # a breakpoint() in a worker method lands in this very thread
        assert cluster.group("a", EchoWorker).call(EchoWorker.whoami)[0].role == "a"
        assert threading.current_thread().name == main


def test_rendezvous_ports_come_from_below_the_ephemeral_range() -> None:
    # A port picked now is bound seconds later by rank 0's TCP store; from the ephemeral
    # range the kernel could meanwhile give it to an outgoing connection (EADDRINUSE).
    import socket

    from avrid.workers.outcome import ephemeral_ports, free_port

    low, high = ephemeral_ports()
    assert 0 < low < high
    ports = [free_port() for _ in range(20)]
    if low - 20000 >= 1000:  # else it falls back to any free port
        assert all(20000 <= p < low for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", ports[0]))  # still free


def test_a_local_ray_runs_its_workers_at_the_drivers_priority(ray_cluster: None) -> None:
    # Ray's default puts every worker process at nice 15: beside one busy program (a build,
    # a browser, a `yes` loop) such a process gets about 1/30 of a core, and a Ray test that
    # takes 14 s idle took over 400 s beside two busy loops. `start_ray` asks for nice 0.
    import os

    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)
