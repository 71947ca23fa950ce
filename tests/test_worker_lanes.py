"""Lanes (`Worker.lanes`): a method declared on a lane runs beside the rank's other calls.

The scenario is chapter 7's: a `block` call (think `generate`) waits for something only a
second call (think `receive_weights`) provides. With `poke` on a lane of its own, both finish;
without lanes the rank runs them in order, so `block` gives up at its (short) timeout first.
Both backends, plus the checks made at launch on a bad declaration.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from avrid.workers import (
    Backend,
    InProcessBackend,
    Mesh,
    ResourcePool,
    RoleSpec,
    Worker,
    WorkerIdentity,
    plan_placement,
)

pytestmark = pytest.mark.chapter(1)


class Poked(Worker):
    """`block` waits (at most `wait_s`) for the event that only `poke` sets."""

    lanes = {"poke": "side"}

    def __init__(self, identity: WorkerIdentity, wait_s: float = 5.0) -> None:
        super().__init__(identity)
        self._event = threading.Event()  # what makes block and poke safe side by side
        self._wait_s = wait_s

    def block(self) -> bool:
        """True once `poke` ran, False if it did not within `wait_s`."""
        return self._event.wait(self._wait_s)

    def poke(self) -> str:
        """Wake `block`; answers with the thread it ran on."""
        self._event.set()
        return threading.current_thread().name


class Unlaned(Poked):
    """The same worker with no lanes: one call at a time, in order."""

    lanes = {}


def launch(backend: Backend, worker: type[Worker], **init_kwargs: Any) -> Any:
    """Two ranks of `worker`, one bundle each."""
    plan = plan_placement([ResourcePool.uniform("pool", 2, cpus=1)],
                          [RoleSpec(role="poked", worker=worker, mesh=Mesh.of(dp=2),
                                    pool="pool", init_kwargs=init_kwargs)])
    return backend.launch(plan)


def test_a_lane_call_runs_while_the_default_lane_is_busy(backend: Backend) -> None:
    with launch(backend, Poked) as cluster:
        group = cluster.group("poked", Poked)
        blocked = group.submit(Poked.block)
        poked = group.submit(Poked.poke)
        assert len(poked.result(timeout_s=30)) == 2
        assert blocked.result(timeout_s=30) == [True, True]  # woken, not timed out


def test_without_lanes_calls_run_in_order(backend: Backend) -> None:
    with launch(backend, Unlaned, wait_s=1.0) as cluster:
        group = cluster.group("poked", Unlaned)
        blocked = group.submit(Unlaned.block)
        poked = group.submit(Unlaned.poke)
        assert blocked.result(timeout_s=30) == [False, False]  # poke waited its turn
        assert len(poked.result(timeout_s=30)) == 2


def test_in_process_lanes_are_threads_of_their_own_and_close_with_the_group() -> None:
    with launch(InProcessBackend(concurrent=True), Poked) as cluster:
        names = cluster.group("poked", Poked).call(Poked.poke)
        assert names == ["poked[0]:side", "poked[1]:side"]
    alive = {t.name for t in threading.enumerate()}
    assert not alive & set(names)


def test_the_sequential_backend_runs_lane_methods_inline() -> None:
    # Nothing overlaps there: block gives up before poke is even submitted.
    with launch(InProcessBackend(), Poked, wait_s=0.1) as cluster:
        group = cluster.group("poked", Poked)
        assert group.call(Poked.block) == [False, False]
        assert group.call(Poked.poke) == [threading.current_thread().name] * 2
        assert group.call(Poked.block) == [True, True]


class UnknownMethod(Poked):
    lanes = {"pokes": "side"}


class DefaultLane(Poked):
    lanes = {"poke": "default"}


class EmptyLane(Poked):
    lanes = {"poke": ""}


class NotAString(Poked):
    lanes = {"poke": 1}


@pytest.mark.parametrize(("worker", "message"), [
    (UnknownMethod, r"UnknownMethod\.lanes names 'pokes', which is not a method of "
                    r"UnknownMethod"),
    (DefaultLane, r"DefaultLane\.lanes puts 'poke' on lane 'default'; a lane is a non-empty "
                  r"str other than 'default'"),
    (EmptyLane, r"EmptyLane\.lanes puts 'poke' on lane ''"),
    (NotAString, r"NotAString\.lanes puts 'poke' on lane 1"),
])
def test_a_bad_lane_declaration_fails_at_launch(backend: Backend, worker: type[Worker],
                                                message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launch(backend, worker)
