"""Chapter 6 — `LearnerWorker`: a policy rank that trains but does not generate.

With a rollout pool of its own, the policy's ranks keep chapter 5's actor and reference —
log-probs, updates, checkpoints, all inherited from `PolicyWorker` unchanged — and drop the
rollout engine: its memory (a whole model, and on GPU the KV cache) goes back to training,
and its weight sync is replaced by a push to the rollout pool (`transfer.py`):

    weight_shapes     the actor's whole-tensor shapes, from which the driver plans the push
    transfer_address  rank 0 only: its node's IP and a free port (the group's TCP store)
    join_transfer     join the trainer + rollout process group (every rank at once)
    push_weights      post the sends of a snapshot of this rank's FSDP2 shards, cast to the
                      engine's dtype, and return their partial fingerprints for the driver's
                      check, without waiting for the rollout ranks to receive them: the
                      sends finish while the trainer trains, and are waited for at the next
                      push (or at close)

Not here: when to push (the driver) or how a rollout rank receives (`rollout.py`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from avrid.pipeline.transfer import Shapes, join_group, post_shards
from avrid.ppo.roles import fsdp
from avrid.ppo.roles.policy import PolicyWorker
from avrid.reshard import TransferPlan
from avrid.workers.outcome import free_port


class LearnerWorker(PolicyWorker):
    """One data-parallel rank of the actor (+ reference), with no engine of its own."""

    _transfer: dist.ProcessGroup | None = None
    _plan: TransferPlan | None = None
    _sending: tuple[dist.Work, ...] = ()  # the last push's sends, posted, not yet waited for
    _snapshot: dict[str, torch.Tensor] | None = None  # what they send: kept until they finish

    def _make_engine(self, model: torch.nn.Module) -> None:
        """No engine: the rollout pool generates (see the module docstring)."""
        return None

    def weight_shapes(self) -> Shapes:
        """name -> (whole shape, dtype name) of every actor parameter, in order."""
        # A sharded parameter (DTensor) reports its global shape.
        return {n: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
                for n, p in self.model.named_parameters()}

    def transfer_address(self) -> tuple[str, int]:
        """Where this rank (rank 0) hosts the transfer group's TCP store: IP and free port."""
        return self.identity.node or "127.0.0.1", free_port()

    def join_transfer(self, address: str, port: int, plan: TransferPlan,
                      timeout_s: float) -> None:
        """Join the trainer + rollout group as process `rank` and keep the push plan."""
        ident = self.identity
        world = plan.source_world + plan.target_world
        self._transfer = join_group(address, port, rank=ident.rank, world_size=world,
                                    device=self.device, timeout_s=timeout_s)
        self._plan = plan

    def push_weights(self) -> tuple[dict[str, int], float, float]:
        """Post the sends of this rank's shards to every rollout rank and return; all trainer
        and rollout ranks at once. Returns (partial fingerprints, start, end) — the times for
        the timeline."""
        if self._transfer is None or self._plan is None:
            raise RuntimeError(f"{self.identity.name}: join_transfer() must run before "
                               f"push_weights()")
        start = time.time()
        self.finish_push()  # the previous push's sends: long delivered by now
        # A copy even where the dtypes agree: the sends read it after this call returns,
        # while the optimizer overwrites the parameters themselves.
        self._snapshot = {n: t.to(self.dtype, copy=True)
                          for n, t in fsdp.local_shards(self.model).items()}
        works, sums = post_shards(self._plan, self.identity.rank, self._snapshot,
                                  self._transfer)
        self._sending = tuple(works)
        return sums, start, time.time()

    def finish_push(self) -> None:
        """Wait for the last push's sends (a failed send raises here) and free the snapshot."""
        sending, self._sending = self._sending, ()
        for work in sending:
            work.wait()
        self._snapshot = None

    def close(self) -> None:
        """Let the last push's sends finish (the driver has checked that they arrived), then
        chapter 5's close."""
        try:
            self.finish_push()
        finally:
            super().close()
