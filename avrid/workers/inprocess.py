"""Chapter 1 — the in-process backend: every worker lives in the driver's own process.

Same contract as the Ray backend — same `Cluster`, `WorkerGroup`, calls, results and errors —
but no Ray at all, so `breakpoint()` inside a worker method just works and a stack trace is one
stack. Ray's old `local_mode` used to give this and is gone; verl users ask for it often.

Two modes:
- sequential (default): rank 0, then rank 1, ... in the caller's thread. Fully deterministic
  and debugger-friendly, but ranks never run at the same time, so collectives are impossible
  (the identity carries no rendezvous and `init_distributed` says so).
- concurrent: one thread per rank, like one actor per rank. Collectives work (each rank builds
  its own gloo group object); results are still returned in rank order. A worker's lanes
  (`Worker.lanes`) get one more thread per rank each, so their methods run beside the rest.

What it cannot show: a worker *process* dying (a crash here takes the driver with it), or
placement on real resources (bundles are recorded in identities but nothing is reserved).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

from avrid.workers.cluster import Cluster, make_identity
from avrid.workers.errors import WorkerError
from avrid.workers.group import WorkerGroup
from avrid.workers.identity import Rendezvous, WorkerIdentity
from avrid.workers.outcome import capture, check_outcome, free_port
from avrid.workers.placement import PlacementPlan, RoleSpec
from avrid.workers.worker import check_lanes

# How long closing waits for ranks still inside a call (a generate, a forward) to return;
# short, because a rank stuck for good (a hung reward) is then abandoned anyway.
_CLOSE_GRACE_S = 5.0


class _SequentialChannel:
    """Runs each call immediately, in the caller's thread; the ticket is the outcome. Lanes
    run inline too: nothing here can overlap, so a lane method never runs beside another call
    (a worker whose calls wait for each other needs the concurrent mode)."""

    def __init__(self, workers: Sequence[Any], identities: Sequence[WorkerIdentity],
                 lanes: Mapping[str, str]):
        self._workers = workers
        self._identities = identities

    def submit(self, rank: int, method: str, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        return capture(getattr(self._workers[rank], method), *args, **kwargs)

    def wait(self, tickets: Sequence[Any], ranks: Sequence[int], method: str,
             timeout_s: float | None) -> None:
        pass  # each call ran to its end when it was submitted

    def gather(self, tickets: Sequence[Any], ranks: Sequence[int], method: str,
               timeout_s: float | None) -> list[Any]:
        return [check_outcome(t, self._identities[r], method)
                for t, r in zip(tickets, ranks, strict=True)]

    def done(self, tickets: Sequence[Any]) -> bool:
        return True  # each call ran to its end when it was submitted

    def put(self, value: Any) -> Any:
        return value  # one process: every rank can read the object itself

    def close(self) -> None:
        pass


class _RankThread:
    """One daemon thread that runs one rank's calls in order (a rank is single-threaded, like
    an actor). Daemon, unlike a ThreadPoolExecutor's workers: Python joins those at exit, so a
    rank stuck in a hung reward function or a collective kept the driver from exiting (it took
    a second Ctrl-C). A stuck daemon thread is simply abandoned when the driver ends."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, lambda: capture(fn, *args, **kwargs)))
        return future

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            future, run = item
            if future.set_running_or_notify_cancel():
                future.set_result(run())  # `capture` turns any exception into a value

    def stop(self) -> None:
        """Cancel the calls not yet started and let the thread end after its current one."""
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self._calls.put(None)

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the thread to end, its native part included (see
        `_ThreadChannel.close`)."""
        deadline = time.monotonic() + timeout_s
        self._thread.join(timeout_s)
        # `Thread.join` returns once the thread's Python part is done, but the OS thread then
        # still destroys its native thread-locals, torch's among them; one that holds a Python
        # object needs the GIL, and if the interpreter is exiting by then the thread is stopped
        # inside that C++ destructor and the process aborts ("terminate called without an
        # active exception"). So wait for the OS thread itself: Linux lists a process's live
        # threads in /proc/self/task (elsewhere this part is skipped).
        task = Path(f"/proc/self/task/{self._thread.native_id}")
        while (not self._thread.is_alive() and task.exists()
               and time.monotonic() < deadline):
            time.sleep(0.001)


class _ThreadChannel:
    """One thread per rank: calls to one rank run in order, ranks in parallel. Each lane
    (`Worker.lanes`) adds one thread per rank, which runs that lane's methods in order."""

    def __init__(self, workers: Sequence[Any], identities: Sequence[WorkerIdentity],
                 lanes: Mapping[str, str]):
        self._workers = workers
        self._identities = identities
        self._lane_of = dict(lanes)
        self._threads = {lane: [_RankThread(ident.name if lane == "default"
                                            else f"{ident.name}:{lane}")
                                for ident in identities]
                         for lane in ("default", *sorted(set(lanes.values())))}

    def submit(self, rank: int, method: str, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Future[Any]:
        fn = getattr(self._workers[rank], method)
        lane = self._lane_of.get(method, "default")
        return self._threads[lane][rank].submit(fn, *args, **kwargs)

    def wait(self, tickets: Sequence[Future[Any]], ranks: Sequence[int], method: str,
             timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = set(tickets)
        rank_of = {id(t): r for t, r in zip(tickets, ranks, strict=True)}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
            if not done:
                late = sorted(rank_of[id(t)] for t in pending)
                first = self._identities[late[0]]
                raise WorkerError(role=first.role, rank=first.rank, method=method,
                                  reason="timeout", remote_traceback="",
                                  detail=f"ranks {late} still running after {timeout_s} s")
            # Fail fast: a failed rank may leave its peers blocked in a collective forever.
            for t in done:
                check_outcome(t.result(), self._identities[rank_of[id(t)]], method)

    def gather(self, tickets: Sequence[Future[Any]], ranks: Sequence[int], method: str,
               timeout_s: float | None) -> list[Any]:
        self.wait(tickets, ranks, method, timeout_s)
        return [t.result() for t in tickets]

    def done(self, tickets: Sequence[Future[Any]]) -> bool:
        return all(t.done() for t in tickets)

    def put(self, value: Any) -> Any:
        return value

    def close(self) -> None:
        # Threads cannot be killed; a rank stuck in a collective ends at its gloo timeout, and
        # one stuck forever is a daemon that does not hold the driver at exit. But a rank
        # thread still busy in torch, or still tearing down torch's thread-locals, when the
        # interpreter exits aborts the process ("terminate called without an active
        # exception"), so give each a bounded time to end completely first (`join`).
        threads = [t for lane in self._threads.values() for t in lane]
        for thread in threads:
            thread.stop()
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class InProcessBackend:
    """Runs every role's workers inside this process (see the module docstring).

    Example (a sketch; `chapters/ch01_workers` runs it for real)::

        backend = InProcessBackend(concurrent=True)   # threads, so collectives work
        with backend.launch(plan) as cluster:
            cluster.group("actor").call(ActorWorker.all_reduce_rank)
    """

    def __init__(self, *, concurrent: bool = False, call_timeout_s: float | None = None):
        self.concurrent = concurrent
        self.call_timeout_s = call_timeout_s

    def launch(self, plan: PlacementPlan) -> Cluster:
        """Build every worker of `plan` in this process and return the cluster."""
        groups: dict[str, WorkerGroup] = {}
        try:
            for spec in plan.roles:
                groups[spec.role] = self._start_role(plan, spec)
        except BaseException:
            for group in groups.values():
                group.close()
            raise
        return Cluster(plan, groups, release=lambda: None)

    def _start_role(self, plan: PlacementPlan, spec: RoleSpec) -> WorkerGroup:
        lanes = check_lanes(spec.worker)  # before any rank is built
        # Sequential ranks can never meet, so they get no rendezvous (a lone rank can).
        can_meet = self.concurrent or spec.world_size == 1
        rdv = (Rendezvous(master_addr="127.0.0.1", master_port=free_port(), in_process=True)
               if can_meet else None)
        workers, identities = [], []
        for slot in plan.slots_of(spec.role):
            # Everything runs here, so "where it landed" is known before construction.
            ident = replace(make_identity(spec, slot, rdv), node="127.0.0.1")
            built = capture(spec.worker, ident, **spec.init_kwargs)
            workers.append(check_outcome(built, ident, "__init__"))
            identities.append(ident)
        channel_cls = _ThreadChannel if self.concurrent else _SequentialChannel
        return WorkerGroup(role=spec.role, worker_cls=spec.worker, mesh=spec.mesh,
                           identities=identities, channel=channel_cls(workers, identities, lanes),
                           call_timeout_s=self.call_timeout_s)
