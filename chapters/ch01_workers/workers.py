"""Chapter 1 — the example workers of the demo and the notebook.

Two tiny roles built on `avrid.workers.Worker`: a trainer and a rollout worker. Each can say who
it is (from the `WorkerIdentity` the driver handed it) and join its group's torch.distributed
process group to run one gloo all-reduce. They do no training and no generation: the point of
chapter 1 is *where* workers run and *how* the driver talks to them, not what they compute.

These classes live in an importable module rather than in the demo's ``__main__`` because Ray
pickles a class by reference (module + name): each worker process must be able to import it.
"""

from __future__ import annotations

import os

from avrid.workers import Worker


class EchoWorker(Worker):
    """Base of the demo roles: reports identity and runs a group all-reduce."""

    def whoami(self) -> str:
        """This worker's one-line identity, as the worker itself sees it."""
        return self.identity.describe()

    def pid(self) -> int:
        """The OS process id: one per rank on Ray, the driver's own in-process."""
        return os.getpid()

    def greet(self, message: str) -> str:
        """Echo `message` with this worker's name: shows which argument reached which rank."""
        return f"{self.identity.name} got {message!r}"

    def all_reduce_rank(self) -> float:
        """Sum ``rank + 1`` over every rank of the group with gloo and return the total.

        Every rank must call this at the same time (it is a collective), so it needs the Ray
        backend or ``InProcessBackend(concurrent=True)``. With N ranks the answer is
        N * (N + 1) / 2 on every rank.
        """
        import torch  # heavy: imported in the worker, only when a collective is run
        import torch.distributed as dist

        self.init_distributed("gloo")
        try:
            t = torch.tensor([float(self.identity.rank + 1)])
            dist.all_reduce(t, group=self.process_group)  # default op: SUM
            return float(t.item())
        finally:
            # Leave the group every time, so the next call (or the next demo) can join afresh.
            self.destroy_distributed()


class TrainerWorker(EchoWorker):
    """Stands in for a training role (actor, critic): the part that would hold an optimizer."""


class RolloutWorker(EchoWorker):
    """Stands in for a rollout role (generation): the part that would hold an inference engine."""
