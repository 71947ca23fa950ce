"""Rollout and learner workers that fail on purpose or report their push group, for chapter
6's failure and push tests (a module of their own so that Ray workers can import them by
name, and `tests.helpers` stays torch-free)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator

import torch

from avrid.dispatch import Shard
from avrid.pipeline.learner import LearnerWorker
from avrid.pipeline.push_group import PushGroup
from avrid.pipeline.rollout import RolloutWorker
from avrid.pipeline.transfer import PushBucket
from avrid.reshard.engines import WeightSink
from avrid.results import ResultBuilder, WorkerResult


class RaisingRollout(RolloutWorker):
    """Raises in its third generate call (validation is the first) on rank 0."""

    calls = 0

    def generate(self, shard: Shard, **kwargs: object) -> WorkerResult:
        self.calls += 1  # an instance count (the class attribute is only its start)
        if self.identity.rank == 0 and self.calls == 3:
            raise RuntimeError("injected rollout failure")
        return super().generate(shard, **kwargs)


class DyingRollout(RolloutWorker):
    """Its process dies in its third generate call on the last rank (Ray only)."""

    calls = 0

    def generate(self, shard: Shard, **kwargs: object) -> WorkerResult:
        self.calls += 1
        if self.identity.rank == self.identity.world_size - 1 and self.calls == 3:
            os._exit(1)
        return super().generate(shard, **kwargs)


class CorruptingRollout(RolloutWorker):
    """From the second push on, loads one element wrong (a stale or half-written engine): the
    driver's fingerprint check must stop the run naming this rank."""

    def _load(self, sink: WeightSink, groups: Iterable[dict[str, torch.Tensor]]) -> None:
        if self.version is not None:  # the first push (version 0) loads cleanly
            groups = _first_tensor_off_by_one(groups)
        super()._load(sink, groups)


def _first_tensor_off_by_one(
        groups: Iterable[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """`groups`, with one element of the first tensor they hold changed (on a copy)."""
    wrong = False
    for group in groups:
        if group and not wrong:
            name = next(iter(group))
            group = {**group, name: group[name].clone()}
            group[name].view(-1)[0] += 1.0
            wrong = True
        yield group


class RaisingLearner(LearnerWorker):
    """Raises inside its update of step 1 (while the rollout pool generates step 2)."""

    def _set_lr(self, step: int, builder: ResultBuilder, prefix: str) -> None:
        if step == 1:
            raise RuntimeError("injected learner failure")
        super()._set_lr(step, builder, prefix)


def _push_counts(group: PushGroup | None) -> tuple[int, list[int]]:
    return PushGroup.built, [] if group is None else list(group.broadcasts)


class CountingLearner(LearnerWorker):
    """Reports its process's push groups and its member's broadcasts."""

    def push_counts(self) -> tuple[int, list[int]]:
        """(push groups built in this process, bytes of each broadcast this rank took part
        in; none where it is not in the push group)."""
        return _push_counts(self._transfer)

    def push_deadline(self) -> float:
        """When the last push must have finished, as rank 0 polls it (`time.monotonic()`)."""
        return self._deadline


class CountingRollout(RolloutWorker):
    """Reports its process's push groups and its member's broadcasts."""

    def push_counts(self) -> tuple[int, list[int]]:
        """As `CountingLearner.push_counts`."""
        return _push_counts(self._transfer)


class RaisingReceiver(CountingRollout):
    """Stops after the first bucket of its second push (the first is start-up's), on the
    last rank: a receiver that fails mid-push. Here it raises (in-process)."""

    def _receive_bucket(self, bucket: PushBucket, deadline: float) -> torch.Tensor:
        last = self.identity.rank == self.identity.world_size - 1
        if last and self.version is not None and bucket.index == 1:
            self._stop()
        return super()._receive_bucket(bucket, deadline)

    def _stop(self) -> None:
        raise RuntimeError("injected receiver failure")


class ExitingReceiver(RaisingReceiver):
    """As `RaisingReceiver`, but its process dies (Ray)."""

    def _stop(self) -> None:
        os._exit(1)


class ExitingReceiverSlowPeers(ExitingReceiver):
    """As `ExitingReceiver`; the other ranks take 5 s over each generation once trained
    weights arrived, so the driver cannot learn of the death from a finished generation
    before the trainer's next call."""

    def generate(self, shard: Shard, **kwargs: object) -> WorkerResult:
        if self.identity.rank != self.identity.world_size - 1 and self.version:
            time.sleep(5.0)
        return super().generate(shard, **kwargs)


class WatchdogLearner(CountingLearner):
    """Trainer rank 0's process ends once the broadcasts of its second push are over, as
    NCCL's watchdog ends it for broadcasts that a dead receiver left unfinished (gloo, which
    these tests run, fails them and lets the process live)."""

    pushes = 0

    def push_weights(self) -> tuple[dict[str, int], float, float]:
        self.pushes += 1  # an instance count
        out = super().push_weights()
        if self.identity.rank == 0 and self.pushes == 2:
            # Every bucket handed over first, so the receiver gets as far as its death.
            until = time.monotonic() + 30.0
            while time.monotonic() < until and not all(
                    work.is_completed() for work, _ in self._posted):
                time.sleep(0.01)
            os._exit(1)
        return out
