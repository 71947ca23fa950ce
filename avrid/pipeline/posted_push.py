"""Chapter 6 — a weight push in flight, as the driver holds it, and who broke a broken one.

The driver posts a push to both pools at once (`PipelinedTrainer._push`) and checks it later
(`_settle_push`); in between it holds a `PostedPush`: the trainer ranks' call and the rollout
ranks' call, both unfinished.

When a push breaks, the first failure the driver sees is often not its cause. A rollout rank
that dies mid-push leaves trainer rank 0's broadcasts unfinished; on NCCL they stay so (an
`abort` does not fail the peers' pending work, as gloo's closed connection does), and NCCL's
watchdog then ends trainer rank 0's process while it trains. The driver, waiting on a
training phase, sees "trainer rank 0 died", and the other trainer ranks stop in their FSDP
collectives. `failed_receiver` looks at the rollout side of the push first: a rollout rank
that died in it is the failure to report.

Not here: posting or checking a push (driver.py), the push's own timeouts (push_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from avrid.workers import PendingCall, WorkerError


@dataclass(frozen=True, slots=True, kw_only=True)
class PostedPush:
    """A weight push posted to both pools, not yet checked (each rollout rank: `Received`)."""

    submitted: float
    sent: PendingCall  # per trainer rank: (partial fingerprints, start, end)
    got: PendingCall  # per rollout rank: `Received`

    def done(self) -> bool:
        """Whether both pools have finished their side (well or not)."""
        return self.sent.done() and self.got.done()


def failed_receiver(push: PostedPush, timeout_s: float) -> WorkerError | None:
    """The death of the rollout rank that broke `push`, or None if no rollout rank died in
    it. Waits at most `timeout_s` for the rollout side to end (each rollout rank's receive
    ends by its own push deadline, so the push timeout is enough); a death is seen at once,
    whatever the other ranks still do. A rollout rank that RAISED is not blamed here: that
    may be the consequence (a `PushTimeout`, gloo's closed connection) of the very trainer
    failure being reported."""
    try:
        push.got.result(timeout_s)
    except WorkerError as lost:
        return lost if lost.reason == "died" else None
    return None
