"""Chapter 1 — `Worker`: the base class of every role's code (actor, critic, rollout, ...).

A worker is an ordinary Python class — on Ray, each rank is one actor of exactly this class. It
is constructed with its `WorkerIdentity` and its methods are plain methods: the driver calls
them by naming them (``group.call(MyWorker.step, x)``), so "go to definition" and a type checker
follow every call. Nothing here is rewritten, registered or scanned.

The one service the base class gives is `init_distributed`: joining the group's
torch.distributed process group from the rendezvous in the identity, the same way on Ray
(one process per rank, the standard default group) and in-process (ranks are threads, so each
builds its own gloo group object). Worker code then always passes ``group=self.process_group``.

A rank runs one call at a time, in order, unless its class declares *lanes* (`Worker.lanes`,
checked at launch by `check_lanes`): methods that run on a thread of their own, beside the
rank's other calls (a weight push landing while a generate runs, chapter 7).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from avrid.workers.identity import WorkerIdentity

if TYPE_CHECKING:  # torch is heavy; import it where a process group is actually made
    from torch.distributed import ProcessGroup


class Worker:
    """Base class for role workers: holds the identity and, once joined, the process group.

    Example:
        >>> class Echo(Worker):
        ...     def hello(self, greeting: str) -> str:
        ...         return f"{greeting} from {self.identity.name}"
        >>> Echo(WorkerIdentity(role="echo", rank=0, world_size=1)).hello("hi")
        'hi from echo[0]'
    """

    lanes: ClassVar[Mapping[str, str]] = {}
    """Method name -> lane name. A lane is one more thread of each rank: the methods on one
    lane run in order, one at a time, but concurrently with the rank's other calls (which
    all run on the default lane, in order, as without lanes). The worker must make its lane
    methods safe to run beside the others (its own locks and events). Lane names are
    non-empty strings other than "default"; an empty mapping (the default) changes nothing.

    Example::

        class Rollout(Worker):
            lanes = {"receive_weights": "weights"}   # lands while `generate` runs
    """

    def __init__(self, identity: WorkerIdentity) -> None:
        self.identity = identity
        self._process_group: ProcessGroup | None = None
        rdv = identity.rendezvous
        if rdv is not None and not rdv.in_process:
            # This worker owns its process (Ray: one actor per rank), so it can export what
            # torch.distributed and libraries built on it (vLLM, FSDP) read: RANK, WORLD_SIZE,
            # LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Threads of one process could not.
            os.environ.update(identity.torch_env())

    @property
    def process_group(self) -> ProcessGroup:
        """The group's torch.distributed process group; `init_distributed` must run first."""
        if self._process_group is None:
            raise RuntimeError(f"{self.identity.name}: call init_distributed() before using "
                               f"the process group")
        return self._process_group

    def init_distributed(self, backend: str = "gloo", timeout_s: float = 60.0) -> ProcessGroup:
        """Join the group's process group: every rank of the group must call this at once.

        `backend` is "gloo" (CPU tensors, any machine), "nccl" (CUDA tensors) or both
        ("cuda:nccl,cpu:gloo": each tensor's device picks its backend). The timeout
        bounds how long a rank waits for the others in this and every later collective of the
        group, so a missing rank fails instead of hanging. The 60 s default suits small CPU
        groups; a role whose first collective waits behind a checkpoint load or vLLM's
        start-up needs minutes (the PPO roles pass `train.collective_timeout_s`, 600 s).
        """
        import torch.distributed as dist

        ident = self.identity
        if ident.rendezvous is None:
            raise RuntimeError(
                f"{ident.name}: this group has no rendezvous. A sequential in-process group runs "
                f"one rank at a time, so collectives would deadlock; use "
                f"InProcessBackend(concurrent=True) or the Ray backend"
            )
        timeout = timedelta(seconds=timeout_s)
        if "nccl" in backend:  # "nccl", or NCCL beside gloo ("cuda:nccl,cpu:gloo")
            import torch

            torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES leaves this worker's GPU at 0
        if ident.rendezvous.in_process:
            # Threads of one process cannot share the process-global default group, so each
            # rank builds its own gloo group over a TCP store hosted by rank 0.
            if backend != "gloo":
                raise RuntimeError(f"{ident.name}: in-process groups support gloo only, "
                                   f"got {backend!r}")
            store = dist.TCPStore(ident.rendezvous.master_addr, ident.rendezvous.master_port,
                                  ident.world_size, is_master=ident.rank == 0, timeout=timeout)
            self._process_group = dist.ProcessGroupGloo(store, ident.rank, ident.world_size,
                                                        timeout)
        else:
            # One process per rank: the standard env:// rendezvous, from the variables that
            # __init__ exported from the identity.
            dist.init_process_group(backend, timeout=timeout)
            self._process_group = dist.group.WORLD
        return self._process_group

    def _wire_call(self, method: str, blob: bytes, *buffers: Any) -> Any:
        """How the Ray backend calls a method: its arguments arrive pickled as one byte
        string (and the out-of-band buffers of large tensors), its result goes back the same
        way (`call_wire`). The driver checked that `method` is one of this class's."""
        # Imported here: call_wire imports Ray, and this module must load without it (the
        # in-process backend and the pure parts of avrid.workers never need Ray).
        from avrid.workers.call_wire import pack_result, unpack

        args, kwargs = unpack(blob, buffers, failure=self._not_run(method))
        return pack_result(getattr(self, method)(*args, **kwargs))

    def _plain_call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """How the Ray backend calls a method whose arguments Ray pickled itself (a Ray
        handle among them, or code only cloudpickle can send; none at all): Ray resolved
        the ObjectRefs among them, values the driver stored packed (`call_wire.Stored`) are
        unpacked here, and the result goes back packed like `_wire_call`'s."""
        # `method` is positional-only: a keyword argument of the same name goes to the method.
        from avrid.workers.call_wire import pack_result, unstore

        failure = self._not_run(method)
        args = tuple(unstore(a, failure=failure) for a in args)
        kwargs = {k: unstore(v, failure=failure) for k, v in kwargs.items()}
        return pack_result(getattr(self, method)(*args, **kwargs))

    def _not_run(self, method: str) -> str:
        """What a call's arguments that cannot be unpickled here mean (`call_wire.unpack`)."""
        return (f"{type(self).__name__}.{method} did not run: its arguments could not be "
                f"unpickled in this worker")

    def destroy_distributed(self) -> None:
        """Leave the process group (all ranks at once); a no-op if never joined."""
        import torch.distributed as dist

        if self._process_group is None:
            return
        own_store = self.identity.rendezvous is not None and self.identity.rendezvous.in_process
        if not own_store and not dist.is_initialized():
            # The default group is gone already: closing a vLLM engine in this process
            # destroys the group vLLM built its own over (its `cleanup_dist_env_and_memory`).
            self._process_group = None
            return
        # A barrier first: without it gloo sometimes aborts at teardown ("terminate called
        # without an active exception") when one rank leaves while another still talks.
        dist.barrier(group=self._process_group)
        if self._process_group is dist.group.WORLD:
            dist.destroy_process_group()
        self._process_group = None


def check_lanes(worker_cls: type) -> dict[str, str]:
    """`worker_cls`'s lanes (`Worker.lanes`; a class without the attribute has none), checked:
    each key names a method of the class, each lane is a non-empty str other than "default"
    (nor starting with "_ray", Ray's own groups). Both backends call this at launch.

    Raises:
        ValueError: a declaration that breaks these rules, naming the class and the method.
    """
    lanes = getattr(worker_cls, "lanes", {})
    name = worker_cls.__name__
    if not isinstance(lanes, Mapping):
        raise ValueError(f"{name}.lanes must map method names to lane names, got "
                         f"{type(lanes).__name__}")
    for method, lane in lanes.items():
        if not isinstance(method, str) or not callable(getattr(worker_cls, method, None)):
            raise ValueError(f"{name}.lanes names {method!r}, which is not a method of "
                             f"{name}; the keys must be its method names")
        if (not isinstance(lane, str) or not lane or lane == "default"
                or lane.startswith("_ray")):
            raise ValueError(f"{name}.lanes puts {method!r} on lane {lane!r}; a lane is a "
                             f"non-empty str other than 'default' (and not starting with "
                             f"'_ray'); leave a method out to keep it on the default lane")
    return dict(lanes)
