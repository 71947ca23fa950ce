"""Chapter 6 — `PushGroup`: the one communicator a weight push travels on, with real timeouts.

The push group is trainer rank 0 plus the R rollout ranks (group rank 0 is trainer rank 0,
group rank 1 + j is rollout rank j): `transfer.py` says why only trainer rank 0. Every
member builds it ONCE, at join time, from a TCP store that trainer rank 0 hosts (a process
has one default group, and the trainer ranks' is already their FSDP group), over gloo on CPU
and NCCL on GPU. Then every push reuses it.

Two clocks bound a push, and their order matters. avrid's own deadlines (`wait`, every one
set at or before the moment its operations are posted, `timeout_s` after it: a rollout rank's
from the start of its receive, trainer rank 0's from the start of its push, before it gathers
or posts a bucket) raise `PushTimeout`, naming the push, and the member then `leave`s. The
backend's own timeout (NCCL's watchdog; gloo's transport) ends an operation older than it,
and NCCL's watchdog, with the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ends the whole
PROCESS: trainer rank 0 killed for a rollout rank's death, the other trainer ranks left
waiting in FSDP collectives. So the backend gets `backend_timeout_s` = `timeout_s` +
`BACKEND_MARGIN_S`: every deadline avrid polls with passes first, by at least the margin.
Trainer rank 0 looks at its broadcasts only at its next push or at close; if a rollout rank
dies while it trains, the watchdog may still end it in between, and the driver then reports
the rollout rank, not trainer rank 0 (`posted_push.failed_receiver`).

Two things this class makes explicit, because the library calls hide them:

- **when the communicator exists.** NCCL creates a communicator lazily, at the first
  collective; a design with a 2-rank group per (trainer, rollout) pair pays T x R of them,
  inside the first push. Here the constructor runs one tiny all-reduce, so the one
  communicator is made (and every member is known to be there) before any push, and
  `PushGroup.built` counts how many this process has made: a test checks one per member.
- **what "finished" means.** On NCCL `Work.wait()` only makes the current CUDA stream wait:
  it returns at once, long before the bytes arrive, and a receiver that died leaves the
  sender "done". `wait` instead polls `Work.is_completed()` (NCCL reads the kernel's CUDA
  event; gloo, the transport's state) against a deadline and raises an error that says
  which push, which bucket and which member was waiting, then calls `wait()` to surface a
  failed operation's own error (gloo: the peer's closed connection or its timeout).

Which member died is not knowable from here (a broadcast in a tree stalls everybody below
the dead rank): the driver knows, because that worker's call fails (`driver._settle_push`,
`posted_push.failed_receiver`).

Not here: what goes into the buckets (`transfer.py`), when to push (`driver.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

POLL_S = 0.002
"""How often `wait` looks at unfinished operations (a 64 MiB bucket takes longer than that)."""


BACKEND_MARGIN_S = 60.0
"""How much longer than the push timeout the backend's own timeout is: far more than one
poll (`POLL_S`) and a `leave` after a deadline passes, so that a member that is waiting
always raises `PushTimeout` itself before NCCL's watchdog ends its process."""


def backend_timeout_s(timeout_s: float) -> float:
    """The backend's own timeout for a push group whose deadlines are `timeout_s` after the
    start of what they bound (see the module docstring): strictly later than all of them.

    Example:
        >>> backend_timeout_s(3600.0) - 3600.0 == BACKEND_MARGIN_S
        True
    """
    return timeout_s + BACKEND_MARGIN_S


class PushTimeout(TimeoutError):
    """A push's collective did not finish before its deadline: a member died or stopped."""


class PushGroup:
    """This process's member of the push group: one communicator, built once, used by every
    push; and a record of what it broadcast (`broadcasts`: bytes per call)."""

    built = 0
    """Push groups this process has built (class-wide): one per member, however many pushes."""

    def __init__(self, address: str, port: int, *, rank: int, world_size: int, device: str,
                 timeout_s: float) -> None:
        """Join as group rank `rank` of `world_size`; every member calls it at once, and
        group rank 0 hosts the TCP store at `address:port`. `timeout_s` bounds the join and
        every later operation (`wait`'s deadlines); the backend's own timeout is later,
        `backend_timeout_s(timeout_s)`."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout_s = timeout_s
        self.backend_timeout_s = backend_timeout_s(timeout_s)
        """The backend's own timeout: NCCL's watchdog, gloo's transport."""
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0,
                              timeout=timedelta(seconds=timeout_s))
        backend = timedelta(seconds=self.backend_timeout_s)
        if device == "cuda":  # NCCL between GPUs (not run on the CPU machines of this course)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = backend  # the watchdog ends an operation older than this
            self._backend = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self._backend = dist.ProcessGroupGloo(store, rank, world_size, backend)
        PushGroup.built += 1
        self.broadcasts: list[int] = []
        """Bytes of each `broadcast` this member took part in, in order."""
        # Eager: one tiny collective makes NCCL create its communicator now, not inside the
        # first push, and proves that every member has joined.
        one = torch.ones(1, device=device)
        self.wait([self._backend.allreduce([one])], deadline=time.monotonic() + timeout_s,
                  what=f"push group rank {rank}: joining the {world_size} members")

    def broadcast(self, flat: torch.Tensor, *, root: int = 0) -> dist.Work:
        """Post one broadcast of `flat` from group rank `root` (its data) into every other
        member's `flat` (same size and dtype); return it unfinished (`wait` for it)."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        self.broadcasts.append(flat.numel() * flat.element_size())
        return self._backend.broadcast([flat], options)

    def leave(self) -> None:
        """Close this member's connections now (a member that failed mid-push): every other
        member's unfinished operation then fails at once (gloo: "Connection closed by peer")
        instead of waiting out the timeout, and nothing waits for this member again."""
        self._backend.abort()

    def wait(self, works: Sequence[dist.Work], *, deadline: float, what: str) -> None:
        """Wait until every operation in `works` has really finished, or raise `PushTimeout`
        at `deadline` (a `time.monotonic()` value) naming `what` was waited for. A failed
        operation raises its error, with `what` in the message."""
        while not all(work.is_completed() for work in works):
            if time.monotonic() >= deadline:
                late = sum(not work.is_completed() for work in works)
                raise PushTimeout(f"{what}: {late} of {len(works)} operations unfinished "
                                  f"after the push timeout of {self.timeout_s:g} s (a member "
                                  f"of the push group died or stopped taking part)")
            time.sleep(POLL_S)
        for work in works:
            try:
                work.wait()
            except RuntimeError as exc:
                raise RuntimeError(f"{what}: {exc}") from exc
