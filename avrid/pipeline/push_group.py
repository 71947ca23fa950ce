"""Chapter 6 — `PushGroup`: the one communicator a weight push travels on, with real timeouts.

The push group is trainer rank 0 plus the R rollout ranks (group rank 0 is trainer rank 0,
group rank 1 + j is rollout rank j): `transfer.py` says why only trainer rank 0. Every
member builds it ONCE, at join time, from a TCP store that trainer rank 0 hosts (a process
has one default group, and the trainer ranks' is already their FSDP group), over gloo on CPU
and NCCL on GPU, with the push timeout given to the backend itself (NCCL's watchdog and
gloo's transport both honour it). Then every push reuses it.

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
the dead rank): the driver knows, because that worker's call fails (`driver._settle_push`).

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
        every later operation (`wait`'s deadlines, and the backend's own timeout)."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
        if device == "cuda":  # NCCL between GPUs (not run on the CPU machines of this course)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # the watchdog aborts an operation older than this
            self._backend = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self._backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
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
