"""Chapter 1 — the Ray backend: one actor per rank, placed in Ray placement groups.

`start_ray` joins an existing cluster (an address, or RAY_ADDRESS) or starts a local Ray.
`RayBackend.launch(plan)` then does, in order:
1. checks the plan's total CPUs/GPUs against the cluster and fails at once if they cannot fit;
2. reserves one placement group per pool and waits a bounded time for it (a pool that fits in
   total but not per node — say STRICT_PACK over two half-full nodes — fails here, with what
   was asked and what is free, instead of waiting forever);
3. per role, asks rank 0's bundle for the torch.distributed rendezvous (its node IP, a free
   port), then starts one actor *of the worker class itself* per rank in its bundle.

A `Worker`'s calls go to its `_wire_call`, arguments packed by `call_wire` (or to `_plain_call`
when Ray must pickle them: a Ray handle, code from ``__main__``); the reply comes back packed.
`_RayChannel.gather` waits in short slices so that a rank that raised or whose process died is
reported within about a second — even while its peers are blocked in a collective waiting for
it — and a stuck call ends at its timeout. avrid registers no serializer with Ray (those are
process-wide and outlive ``ray.shutdown()``): the user's own Ray tasks pickle as without it.
A worker's lanes (`Worker.lanes`) are Ray concurrency groups of one thread each, so their
methods run beside the rank's other calls (the default group, still one thread).

Not here: how data is split (chapter 2) or how results are merged (chapter 3).
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from avrid.workers import call_wire
from avrid.workers.cluster import Cluster, make_identity
from avrid.workers.errors import PlacementError, WorkerError
from avrid.workers.group import WorkerGroup
from avrid.workers.identity import Rendezvous, WorkerIdentity
from avrid.workers.outcome import free_port, root_cause
from avrid.workers.placement import PlacementPlan, ResourcePool, RoleSpec
from avrid.workers.worker import Worker, check_lanes


def start_ray(address: str | None = None, *, num_cpus: int | None = None,
              num_gpus: int | None = None, connect_timeout_s: float = 10.0) -> None:
    """Join an existing Ray cluster or start a local Ray (or keep the one already running).

    Where Ray runs, in this order:

    1. `address`, if given: ``"auto"`` (the cluster ``ray start --head`` started on this
       machine), ``"host:port"`` (a head node's GCS address, as ``ray start --head`` prints
       it), ``"ray://host:port"`` (Ray Client) or ``"local"`` (always a new local Ray);
    2. else the ``RAY_ADDRESS`` environment variable, read the same way;
    3. else a new local Ray with quiet, test-friendly defaults — never a cluster that happens
       to run on this machine (Ray's own ``ray.init()`` would join the last ``ray start``).

    A local Ray gets `num_cpus` (default max(8, cores)): CPUs are logical scheduling slots in
    Ray, so a laptop can host the course's 4-8 single-CPU workers. `num_gpus` > 0 on a machine
    without GPUs makes *pretend* GPUs: Ray only does the bookkeeping, which is enough to watch
    fractional shares being placed. Its workers run at nice 0, not Ray's 15. A cluster brings
    its own resources and Ray refuses both there: they are an error next to an explicit
    `address`, and are ignored when the address comes from ``RAY_ADDRESS`` (the caller sized a
    local Ray; the user chose the cluster).

    Raises:
        ConnectionError: nothing answers at the cluster's address within `connect_timeout_s`
            (one line naming the address and the cause; checked first because ``ray.init``
            itself retries an unreachable address for minutes).
        ValueError: `num_cpus` or `num_gpus` given together with a cluster's `address`.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token file written to ~/.ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # The workers' output still reaches the driver (log_to_driver), as "(PolicyWorker pid=..)
    # text", but without the colour codes Ray wraps the prefix in (read as each line prints).
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if ray.is_initialized():
        return
    source = "" if address is not None else " (from RAY_ADDRESS)"
    target = address if address is not None else (os.environ.get("RAY_ADDRESS") or None)
    if target is None or target == "local":
        # "local" explicitly: with None, Ray would join the cluster `ray start` left behind.
        # Ray's default worker_niceness is 15: beside any busy nice-0 program a worker then
        # gets ~1/30 of a core (a 14 s test took 400 s beside two busy loops). 0: a fair share.
        ray.init(address="local", num_cpus=num_cpus or max(8, os.cpu_count() or 1),
                 num_gpus=num_gpus, include_dashboard=False, log_to_driver=True,
                 configure_logging=False, _system_config={"worker_niceness": 0})
        _no_colour_reset_at_exit()
        return
    if address is not None and (num_cpus is not None or num_gpus is not None):
        raise ValueError(f"start_ray: num_cpus/num_gpus size a new local Ray, but "
                         f"address={address!r} joins an existing cluster, which brings its "
                         f"own resources; drop them or use address='local'")
    ray.init(address=_reachable(target, source, connect_timeout_s), log_to_driver=True,
             configure_logging=False)
    _no_colour_reset_at_exit()


def _no_colour_reset_at_exit() -> None:
    """Undo a side effect of `ray.init`: its CLI logger's ``colorama.init()`` registers an
    exit hook writing ESC[0m ("reset colours"), a stray code at the end of every run."""
    colorama = sys.modules.get("colorama.initialise")
    if colorama is not None:
        atexit.unregister(colorama.reset_all)


def _reachable(target: str, source: str, timeout_s: float) -> str:
    """The address to give `ray.init` for `target`, once its head answers on TCP."""
    # Ray's own resolver (private, but what `ray.init` runs): "auto" -> the address that
    # `ray start` recorded on this machine, "localhost:port" -> this node's IP and port.
    from ray._private.services import canonicalize_bootstrap_address

    def fail(cause: object) -> ConnectionError:
        cause = " ".join(str(cause).split())  # Ray's messages span lines: keep one
        return ConnectionError(f"cannot join the Ray cluster at {target!r}{source}: {cause}")

    if target.startswith("ray://"):  # Ray Client: probe its server, hand Ray the URL as is
        host_port, resolved = target.removeprefix("ray://").split("/")[0], target
    else:
        try:
            resolved = host_port = canonicalize_bootstrap_address(target)
        except (OSError, ValueError) as exc:  # no cluster found, a malformed address
            raise fail(exc) from None
    host, _, port = host_port.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise fail(f"nothing answers at {host_port} ({exc}); is the head node up "
                   f"(`ray start --head`) and the address right?") from None
    return resolved


@ray.remote(num_cpus=0)
def _rendezvous_here() -> Rendezvous:
    """Runs in rank 0's bundle: that node's IP and a port free on it host the TCP store."""
    return Rendezvous(master_addr=ray.util.get_node_ip_address(), master_port=free_port())


def _record_placement(worker: Worker) -> WorkerIdentity:
    """Runs inside a freshly built actor: complete its identity with the node it landed on
    (IP and Ray node id) and the GPU ids Ray gave it (neither is known before placement)."""
    gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    # The node id too: several nodes may share one IP (containers, `ray.cluster_utils`).
    worker.identity = replace(worker.identity, node=ray.util.get_node_ip_address(),
                              node_id=ray.get_runtime_context().get_node_id(),
                              devices=tuple(gpus))
    return worker.identity


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its remote tracebacks


class _Ticket(NamedTuple):
    """One rank's call in flight: Ray's handle of its reply, and whether the reply is packed
    by `call_wire` (the call went to `Worker._wire_call` or `Worker._plain_call`)."""

    ref: ray.ObjectRef
    wired: bool


class _RayChannel:
    """Actor handles of one group; gathers outcomes with fail-fast death and error checks."""

    def __init__(self, actors: Sequence[Any], identities: Sequence[WorkerIdentity],
                 poll_s: float, *, wired: bool, lanes: dict[str, str]) -> None:
        self.actors = list(actors)
        self._identities = list(identities)
        self._poll_s = poll_s
        self._wired = wired  # the worker class is a `Worker`, so it has `_wire_call`
        self._lanes = lanes  # method -> its concurrency group (`Worker.lanes`)

    def submit(self, rank: int, method: str, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> _Ticket:
        actor, lane = self.actors[rank], self._lanes.get(method)
        cg = {"concurrency_group": lane} if lane else {}  # a lane's own thread (`Worker.lanes`)
        if not self._wired:  # not a `Worker`: an ordinary actor call, Ray pickles it all
            return _Ticket(getattr(actor, method).options(**cg).remote(*args, **kwargs), False)
        packed = call_wire.pack((args, kwargs)) if args or kwargs else None
        if packed is not None:  # the arguments as bytes: Ray passes them through untouched
            blob, buffers = packed
            return _Ticket(actor._wire_call.options(**cg).remote(method, blob, *buffers), True)
        # No arguments, or ones Ray must pickle: a Ray handle (Ray resolves ObjectRefs among
        # the arguments before the method runs), a lambda, code from __main__.
        try:
            return _Ticket(actor._plain_call.options(**cg).remote(method, *args, **kwargs), True)
        except TypeError as exc:  # neither pickler can carry an argument: nothing ran
            ident, cause = self._identities[rank], exc.__cause__ or exc
            raise TypeError(f"{ident.role}.{method}() was not called: an argument cannot be "
                            f"sent to {ident.name} ({type(cause).__name__}: {cause})") from exc

    def wait(self, tickets: Sequence[_Ticket], ranks: Sequence[int], method: str,
             timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = {t.ref: r for t, r in zip(tickets, ranks, strict=True)}
        pending = [t.ref for t in tickets]
        while pending:
            left = self._poll_s if deadline is None else min(
                self._poll_s, max(0.0, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=left)
            if not pending:
                break  # fast path: everything finished inside one slice
            # Some ranks are still running: report any finished rank that failed now, since
            # its peers may be blocked on it forever (e.g. inside an all-reduce).
            failures = [f for t in ready if (f := self._failure(t, rank_of[t], method))]
            if failures:
                # A death often shows up first as a peer's gloo error: give close-behind
                # failures one more slice to land, then report the root cause.
                more, _ = ray.wait(pending, num_returns=len(pending), timeout=self._poll_s)
                failures += [f for t in more if (f := self._failure(t, rank_of[t], method))]
                raise root_cause(failures)
            if deadline is not None and time.monotonic() >= deadline:
                late = sorted(rank_of[t] for t in pending)
                ident = self._identities[late[0]]
                raise WorkerError(role=ident.role, rank=ident.rank, method=method,
                                  reason="timeout", remote_traceback="",
                                  detail=f"ranks {late} still running after {timeout_s} s")

    def gather(self, tickets: Sequence[_Ticket], ranks: Sequence[int], method: str,
               timeout_s: float | None) -> list[Any]:
        self.wait(tickets, ranks, method, timeout_s)
        try:  # all finished: copy and deserialise the outcomes
            replies = ray.get([t.ref for t in tickets])
        except ray.exceptions.RayError:  # someone failed: find out who, and the root cause
            failures = [f for t, r in zip(tickets, ranks, strict=True)
                        if (f := self._failure(t.ref, r, method))]
            raise root_cause(failures) from None
        values = []
        for t, reply, rank in zip(tickets, replies, ranks, strict=True):
            try:
                values.append(call_wire.unpack_result(reply) if t.wired else reply)
            except call_wire.WireError as exc:  # the method ran; its result cannot be read
                ident = self._identities[rank]
                raise WorkerError(role=ident.role, rank=rank, method=method, reason="failed",
                                  remote_traceback="", detail=str(exc)) from None
        return values

    def done(self, tickets: Sequence[_Ticket]) -> bool:
        ready, _ = ray.wait([t.ref for t in tickets], num_returns=len(tickets), timeout=0)
        return len(ready) == len(tickets)

    def put(self, value: Any) -> ray.ObjectRef:
        # Once into the object store, packed where it can be: ~3x cheaper than Ray's pickling.
        packed = call_wire.pack(value) if self._wired else None
        return ray.put(value if packed is None else call_wire.Stored(*packed))

    def _failure(self, ticket: ray.ObjectRef, rank: int, method: str) -> WorkerError | None:
        """The error a finished call stands for, or None if it succeeded."""
        ident = self._identities[rank]
        try:
            ray.get(ticket)
        except ray.exceptions.RayTaskError as exc:  # the method raised: Ray carries it over
            # ... unless the call failed before it: its arguments could not be unpickled.
            reason = "failed" if isinstance(exc.cause, call_wire.WireError) else "raised"
            return WorkerError(role=ident.role, rank=rank, method=method, reason=reason,
                               detail=type(exc.cause).__name__,
                               remote_traceback=_ANSI.sub("", str(exc)))
        except ray.exceptions.RayActorError as exc:
            if getattr(exc, "actor_init_failed", False):  # the constructor raised
                return WorkerError(role=ident.role, rank=rank, method="__init__",
                                   reason="raised", remote_traceback=_ANSI.sub("", str(exc)),
                                   detail="the worker's constructor failed")
            return WorkerError(role=ident.role, rank=rank, method=method, reason="died",
                               remote_traceback=_ANSI.sub("", str(exc)),
                               detail="its process exited during the call")
        except ray.exceptions.RayError as exc:
            return WorkerError(role=ident.role, rank=rank, method=method, reason="failed",
                               remote_traceback=_ANSI.sub("", str(exc)),
                               detail=type(exc).__name__)
        return None

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class RayBackend:
    """Starts workers as Ray actors inside placement groups (see the module docstring).

    Args:
        placement_timeout_s: how long to wait for a placement group before failing.
        start_timeout_s: how long every rank of a role may take to start (a fresh process
            that imports torch takes seconds, more on a loaded 2-core laptop).
        call_timeout_s: default bound on every group call (None: wait as long as workers live).
        poll_s: how often a waiting call checks for failed or dead ranks.
    """

    def __init__(self, *, placement_timeout_s: float = 30.0, start_timeout_s: float = 180.0,
                 call_timeout_s: float | None = None, poll_s: float = 0.5) -> None:
        self.placement_timeout_s = placement_timeout_s
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self.poll_s = poll_s

    def launch(self, plan: PlacementPlan) -> Cluster:
        """Reserve the pools, start every rank of every role, return the cluster."""
        if not ray.is_initialized():
            raise RuntimeError("Ray is not running: call avrid.workers.start_ray() (or "
                               "ray.init()) before RayBackend().launch()")
        for spec in plan.roles:  # a bad `Worker.lanes` fails before anything is reserved
            check_lanes(spec.worker)
        _check_fits(plan)
        pgs: dict[str, PlacementGroup] = {}
        groups: dict[str, WorkerGroup] = {}

        def release() -> None:
            for pg in pgs.values():
                remove_placement_group(pg)

        try:
            for pool in plan.pools:
                pgs[pool.name] = self._reserve(pool)
            for spec in plan.roles:
                groups[spec.role] = self._start_role(plan, spec, pgs[spec.pool])
        except BaseException:
            for group in groups.values():
                group.close()
            release()
            raise
        return Cluster(plan, groups, release)

    def _reserve(self, pool: ResourcePool) -> PlacementGroup:
        pg = placement_group([b.as_ray() for b in pool.bundles], strategy=pool.strategy,
                             name=f"avrid-{pool.name}-{uuid.uuid4().hex[:8]}")
        try:
            ray.get(pg.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            # The node count matters too: STRICT_SPREAD needs a node per bundle.
            nodes = sum(1 for node in ray.nodes() if node["Alive"])
            raise PlacementError(
                f"pool {pool.name!r} ({len(pool.bundles)} bundles "
                f"{[b.as_ray() for b in pool.bundles]}, {pool.strategy}) could not be placed "
                f"within {self.placement_timeout_s} s; the cluster has "
                f"{_cpu_gpu(ray.cluster_resources())} in total and "
                f"{_cpu_gpu(ray.available_resources())} free, on {nodes} node(s)"
            ) from None
        return pg

    def _start_role(self, plan: PlacementPlan, spec: RoleSpec,
                    pg: PlacementGroup) -> WorkerGroup:
        slots = plan.slots_of(spec.role)

        def in_bundle(bundle: int) -> PlacementGroupSchedulingStrategy:
            # capture_child_tasks: actors a worker starts itself (e.g. vLLM's Ray workers)
            # stay inside this reservation.
            return PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=True)

        # The TCP store lives with rank 0, so ask its bundle's node for an address and port.
        rdv = ray.get(_rendezvous_here.options(scheduling_strategy=in_bundle(slots[0].bundle))
                      .remote(), timeout=self.start_timeout_s)
        planned = [make_identity(spec, slot, rdv) for slot in slots]
        # Each rank is an actor of the worker class itself: calls are its real methods. Each
        # lane is a concurrency group of one thread (which Ray takes here, not in .options()).
        lanes = check_lanes(spec.worker)
        actor_cls = ray.remote(spec.worker) if not lanes else ray.remote(
            concurrency_groups=dict.fromkeys(lanes.values(), 1))(spec.worker)
        actors = [actor_cls.options(num_cpus=slot.cpus, num_gpus=slot.gpus,
                                    scheduling_strategy=in_bundle(slot.bundle))
                  .remote(ident, **spec.init_kwargs)
                  for slot, ident in zip(slots, planned, strict=True)]
        wired = issubclass(spec.worker, Worker)  # `Worker._wire_call` packs calls and replies
        channel = _RayChannel(actors, planned, self.poll_s, wired=wired, lanes=lanes)
        try:
            placed = [_Ticket(a.__ray_call__.remote(_record_placement), False) for a in actors]
            identities = channel.gather(placed, range(len(slots)), "__init__",
                                        self.start_timeout_s)
        except BaseException:
            channel.close()
            raise
        channel._identities = list(identities)  # now with where each rank landed
        return WorkerGroup(role=spec.role, worker_cls=spec.worker, mesh=spec.mesh,
                           identities=identities, channel=channel,
                           call_timeout_s=self.call_timeout_s)


def _check_fits(plan: PlacementPlan) -> None:
    """Fail at once when the plan asks for more CPUs or GPUs in total than the cluster has."""
    have = _cpu_gpu(ray.cluster_resources())
    want = {"CPU": sum(p.total()["CPU"] for p in plan.pools),
            "GPU": sum(p.total()["GPU"] for p in plan.pools)}
    short = [k for k in want if want[k] > have[k] + 1e-9]
    if short:
        raise PlacementError(
            f"the placement asks for {want['CPU']:g} CPU and {want['GPU']:g} GPU in "
            f"{sum(len(p.bundles) for p in plan.pools)} bundles, but the cluster has "
            f"{have['CPU']:g} CPU and {have['GPU']:g} GPU (short of {', '.join(short)})"
        )


def _cpu_gpu(resources: dict[str, float]) -> dict[str, float]:
    return {"CPU": resources.get("CPU", 0.0), "GPU": resources.get("GPU", 0.0)}
