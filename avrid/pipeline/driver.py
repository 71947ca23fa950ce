"""Chapter 6 — `PipelinedTrainer`: chapter 5's step, with generation running ahead of it.

The synchronous loop (`Trainer.train_step`) makes every device wait for the slowest phase:
the trainer idles while the engines generate, the engines idle while the trainer trains.
Here the engines live in a rollout pool of their own (`placement.py`) and the driver keeps
them generating the NEXT batches while the trainer learns from the current one:

    train_step(s)   take step s's batch from the queue (waiting for it if it is still being
                    generated: the trainer's bubble, the phase "wait_rollout")
                    pump: start the next admitted generation, so it overlaps what follows
                    learn: chapter 5's phases from reward to actor_update, unchanged, with
                    a pump at every phase boundary (a finished generation is collected and
                    the next one started while the trainer is between calls)
                    pump again: the trainer has a new version, so push it and start more

    pump            with no generation in flight (a push never cancels one; chapter 7's
                    partial rollouts let one land mid-generation): if the engines are
                    behind the trainer, push its weights (`transfer.py`); then, if the gate
                    admits the next step's batch (`staleness.py`: trainer version - engine
                    version <= K, queue has room), start generating it (`start_shards`)

Nobody waits for a push: trainer rank 0 posts one broadcast per bucket and returns (the
learning goes on while the bytes travel), each rollout rank receives and loads before the
generation queued behind it, and the driver checks the fingerprints (`_settle_push`) at the
latest before it accepts a batch made with those weights. A rollout rank that dies mid-push
is reported as itself, not as the trainer's or a peer's timeout that follows from it.

Every sample carries the version of the weights that made it (the rollout worker stamps it);
the driver checks the stamp, computes each batch's staleness and refuses one above K. K = 0
admits a batch only with the weights the synchronous loop would have used, so it reproduces
the sync run exactly; one_step_off is K = 1; async lets generation run up to K versions
ahead, and its versions then depend on timing (fast generation fills the queue early).

Per step it adds `pipeline/` metrics (`report.py`): staleness, overlap, queue, version,
importance weights. With dynamic sampling, extra rounds run at staleness 0 (`generate_round`).

A checkpoint takes what the pipeline holds between two steps (`pipeline_state`: the
generation in flight is collected first, then the queue, the versions, `next_gen`;
`resume.py`), and `start` puts it back, so a resumed run is the uninterrupted one. The fresh
engines get the checkpoint's weights only if the saved ones held the trainer's version;
otherwise the next launch pushes them, exactly where the uninterrupted run did.

Not here: the learning (chapter 5's `Trainer.learn`), admission (`staleness.py`), transfer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from avrid.dispatch import Batch
from avrid.pipeline import report
from avrid.pipeline.learner import LearnerWorker
from avrid.pipeline.placement import pipeline_placement
from avrid.pipeline.posted_push import PostedPush, failed_receiver
from avrid.pipeline.resume import PipelineState
from avrid.pipeline.rollout import RolloutWorker
from avrid.pipeline.staleness import (
    Rollout,
    RolloutQueue,
    StalenessError,
    StalenessGate,
    check_stamps,
)
from avrid.pipeline.transfer import push_plan
from avrid.ppo.data.columns import with_responses
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.config import PPOConfig
from avrid.reshard import check_same, combine
from avrid.results import Merged, Phases, ShardCall, Span, WorkerResult, start_shards
from avrid.workers import PlacementPlan, WorkerError


@dataclass(frozen=True, slots=True, kw_only=True)
class _InFlight:
    """The one generation running in the rollout pool."""

    step: int
    version: int
    prompts: Batch
    call: ShardCall
    launched: float


class _TendingPhases(Phases):
    """A step's phases that tend the pipeline at every phase boundary (collect a finished
    generation, start the next admitted one), so the rollout pool never idles a whole step."""

    def __init__(self, tend: Callable[[], None]) -> None:
        super().__init__()
        self._tend = tend

    def boundary(self) -> None:
        self._tend()


class PipelinedTrainer(Trainer):
    """The one_step_off and async modes (`pipeline.mode`); use as a context manager, and
    call `train_step` for consecutive steps, like `Trainer`."""

    policy_worker = LearnerWorker
    rollout_worker: type[RolloutWorker] = RolloutWorker
    """The worker class of the "rollout" role."""
    pushes_mid_generation = False
    """Whether a push may land while a batch is generated (chapter 7's partial rollouts: its
    rollout worker takes weights between two engine calls); chapter 6's waits for it."""

    def __init__(self, config: PPOConfig) -> None:
        if not config.pipeline.disaggregated:
            raise ValueError("PipelinedTrainer runs pipeline.mode 'one_step_off' or 'async'; "
                             "the synchronous loop is avrid.ppo's Trainer")
        super().__init__(config)
        k = config.pipeline.staleness_bound
        self.gate = StalenessGate(max_staleness=k, capacity=max(1, k),
                                  warmup_steps=config.train.critic_warmup_steps)
        self.queue = RolloutQueue(self.gate.capacity)
        self.trainer_version = 0
        """Actor updates so far (the version a push sends)."""
        self.rollout_version: int | None = None
        """The version the rollout engines hold (None before the first push)."""
        self.next_gen = 0
        """The next step whose batch is to be generated."""
        self._inflight: _InFlight | None = None
        self._pushing: PostedPush | None = None
        self._collected: list[Merged] = []  # generations finished during the current step
        self._spans: list[Span] = []  # pushes checked since the current step began
        self._push_trainer: list[float] = []  # and the seconds each cost the trainer ranks
        self._push_ranks: list[WorkerResult] = []  # and each rank's side of them, as timed

    # ---- lifecycle -------------------------------------------------------------------------

    def placement(self) -> PlacementPlan:
        """Chapter 5's roles, with `LearnerWorker` as the policy, plus the rollout pool."""
        return pipeline_placement(self.config, self.tokenizer,
                                  max_response_tokens=self.max_response,
                                  learner=self.policy_worker, rollout=self.rollout_worker)

    def start(self, weights: dict | None = None, optimizers: dict | None = None, *,
              step: int = 0, pipeline_state: dict[str, Any] | None = None) -> None:
        """Chapter 5's start, then the rollout pool: engines, the transfer group, and a first
        checked push, so the engines hold the trained weights before anything is generated.
        A resume passes the checkpoint's `pipeline_state` (what `pipeline_state()` returned):
        its queue and versions are restored (`_restore`), so the run goes on exactly."""
        super().start(weights, optimizers, step=step)
        t = self.config.train
        self.rollout = self.cluster.group("rollout", self.rollout_worker)
        self.rollout.submit(self.rollout_worker.setup).result(t.setup_timeout_s)
        shapes = self.policy.call_ranks([0], self.policy_worker.weight_shapes)[0]
        self.push_plan = push_plan(shapes, trainers=self.policy.world_size,
                                   rollouts=self.rollout.world_size,
                                   engine_dtype=self.config.model.dtype)
        address, port = self.policy.call_ranks([0], self.policy_worker.transfer_address)[0]
        # Both pools join at once: the group forms only when all T + R processes are in.
        joining = [self.policy.submit(self.policy_worker.join_transfer, address, port,
                                      self.push_plan, t.call_timeout_s),
                   self.rollout.submit(self.rollout_worker.join_transfer, address, port,
                                       self.push_plan, t.call_timeout_s)]
        for call in joining:
            call.result(t.setup_timeout_s)
        self.trainer_version = self.gate.version_at(step)
        self.next_gen = step
        if pipeline_state is not None:
            self._restore(PipelineState.from_extra(pipeline_state), step)
            return
        self._push()
        self._settle_push(wait=True)

    def pipeline_state(self) -> dict[str, Any]:
        """What the pipeline holds between two steps, for a checkpoint (`resume.py`). The
        generation in flight ends first (its batch is queued, as the next step would have
        queued it) and the last push is checked: after this nothing runs in either pool."""
        while self._inflight is not None:
            self._collect()
        self._settle_push(wait=True)
        return PipelineState(trainer_version=self.trainer_version,
                             rollout_version=self.rollout_version, next_gen=self.next_gen,
                             queue=tuple(self.queue.held()),
                             pushes=tuple(self._push_trainer)).to_extra()

    def _restore(self, held: PipelineState, step: int) -> None:
        """Put the pipeline back as `pipeline_state` found it before step `step`."""
        if held.trainer_version != self.trainer_version:
            raise ValueError(f"the checkpoint's pipeline state is at trainer version "
                             f"{held.trainer_version}, but step {step} trains at version "
                             f"{self.trainer_version}: it is not this step's")
        for rollout in held.queue:
            self.queue.put(rollout)
        self.next_gen = held.next_gen
        # Fresh engines hold no trained weights. Saved ones at the trainer's version held the
        # checkpoint's actor: push it now. Ones behind need nothing: a push of the trainer's
        # version precedes every launch (`_pump`, `validate`), where the run made it.
        if held.rollout_version == self.trainer_version:
            self._push()
            self._settle_push(wait=True)
            self._spans, self._push_ranks = [], []  # this push is not the saved run's
        self.rollout_version = held.rollout_version
        self._push_trainer = list(held.pushes)  # the next step reports them, as it would have

    def generator(self):  # noqa: ANN201 - (WorkerGroup, method), as Trainer.generator
        """The rollout pool generates (validation included)."""
        return self.rollout, self.rollout_worker.generate

    def generate_round(self, prompts: Batch, sampling: dict[str, int | bool]) -> Merged:
        """Dynamic sampling's extra round by the pool at the trainer's weights (`catch_up`)."""
        self.catch_up()
        merged = super().generate_round(prompts, sampling)  # by `generator()`: the pool
        check_stamps(merged.batch, self.rollout_version, "an extra round")
        self._collected.append(merged)
        return merged

    def close(self, *, failed: bool = False) -> None:
        """Let a generation in flight end, stop the engines, then chapter 5's close."""
        if self.cluster is not None and not failed:
            timeout = self.config.train.call_timeout_s
            if self._inflight is not None:
                self._inflight.call.pending.result(timeout)
                self._inflight = None
            self._settle_push(wait=True)
            self.rollout.submit(self.rollout_worker.close).result(timeout)
        super().close(failed=failed)

    # ---- one step --------------------------------------------------------------------------

    def train_step(self, step: int) -> tuple[dict[str, float], Batch]:
        """Train on step `step`'s batch while the rollout pool generates ahead; returns the
        step's metrics and its scored batch."""
        phases = _TendingPhases(self._pump)
        expected = self.gate.version_at(step)
        if expected != self.trainer_version:
            raise StalenessError(f"train_step({step}): the trainer is at version "
                                 f"{self.trainer_version}, step {step} needs {expected}; "
                                 f"steps must be consecutive")
        with phases("wait_rollout"):  # the trainer's bubble: its batch is not ready yet
            rollout = self._take(step)
        self._pump()  # start the next batch now, so that it overlaps the learning below
        version = self.trainer_version  # the version this step trains at
        staleness = version - rollout.version
        if not 0 <= staleness <= self.gate.max_staleness:
            raise StalenessError(f"step {step}'s batch is {staleness} versions old; the "
                                 f"bound is {self.gate.max_staleness}")
        try:
            batch, merged = self.learn(step, rollout.batch, phases)
        except WorkerError as failed:
            self._blame_push(failed)
            raise
        if self.updates_actor(step):
            self.trainer_version += 1
        self._pump()
        metrics = self._metrics(batch, [rollout.generation, *merged], phases)
        metrics.update(self._pipeline_metrics(batch, phases, version))
        self.timeline = report.step_timeline(phases, self._collected, self._spans,
                                             self._push_ranks)
        self._collected, self._spans, self._push_trainer, self._push_ranks = [], [], [], []
        return metrics, batch

    def validate(self) -> dict[str, float]:
        """Chapter 5's validation, by the rollout pool brought to the trainer's weights."""
        self.catch_up()
        return super().validate()

    def catch_up(self) -> None:
        """Bring the rollout pool to the trainer's weights now: the generation in flight
        collected (its batch queued), a push if the engines are behind, the push checked."""
        while self._inflight is not None:
            self._collect()
        if self.rollout_version != self.trainer_version:
            self._push()
        self._settle_push(wait=True)

    # ---- the pipeline ----------------------------------------------------------------------

    def _take(self, step: int) -> Rollout:
        """Step `step`'s batch, generating or waiting for it as needed."""
        while step not in self.queue:
            if self._inflight is not None:
                self._collect()  # blocks until the generation in flight ends
                continue
            self._pump()
            if self._inflight is None:
                raise StalenessError(f"step {step}'s batch is neither queued nor admitted "
                                     f"(next to generate: step {self.next_gen})")
        return self.queue.take(step)

    def _pump(self) -> None:
        """Collect a finished generation; with none in flight, bring the engines up to date
        and start the next admitted batch. Never waits for a generation."""
        if self._inflight is not None and self._inflight.call.done():
            self._collect()
        if (self._inflight is not None or self.next_gen >= self.config.train.steps
                or not self.queue.has_room()):
            return
        if self.rollout_version != self.trainer_version:
            self._push()
        if self.gate.admits(step=self.next_gen, rollout_version=self.rollout_version,
                            queued=len(self.queue)):
            self._launch()

    def _launch(self) -> None:
        step = self.next_gen
        prompts = self.step_prompts(step)
        call = start_shards(self.rollout, self.rollout_worker.generate, prompts, None,
                            **self.sampling(step))
        self._inflight = _InFlight(step=step, version=self.rollout_version, prompts=prompts,
                                   call=call, launched=time.time())
        self.next_gen += 1

    def _collect(self) -> None:
        """Wait for the generation in flight; check its stamps and queue its batch."""
        done, self._inflight = self._inflight, None
        # A push posted before this generation ran before it on every rollout rank: its check
        # costs no waiting, and a failed push is reported as itself, not as a stale batch.
        self._settle_push(wait=True)
        merged = done.call.result()
        batch = with_responses(done.prompts, merged.batch)
        # Partial rollouts: a sample is as old as its oldest token, at least the launch's.
        newest = self.rollout_version if self.pushes_mid_generation else done.version
        check_stamps(batch, done.version, f"step {done.step}", newest=newest)
        oldest = int(batch.scalars["version"].min()) if len(batch) else done.version
        self.queue.put(Rollout(step=done.step, version=oldest, batch=batch, generation=merged))
        self._collected.append(merged)

    def _push(self) -> None:
        """Post the trainer's weights to every rollout engine; only with no generation in
        flight (unless `pushes_mid_generation`): a push never cancels one. Nobody waits for
        it here: the trainer ranks gather, rank 0 posts its broadcasts, and they go on
        training; the rollout ranks receive and load before the next call they are given (a
        generation, usually launched right after), and the driver checks the fingerprints
        later (`_settle_push`), before any batch made with them."""
        if self._inflight is not None and not self.pushes_mid_generation:
            raise StalenessError("a weight push was started while a generation is in flight")
        self._settle_push(wait=True)  # the previous push, long finished: check it first
        self._pushing = PostedPush(
            submitted=time.time(),
            sent=self.policy.submit(self.policy_worker.push_weights),
            got=self.rollout.submit(self.rollout_worker.receive_weights, self.trainer_version))
        self.rollout_version = self.trainer_version

    def _settle_push(self, *, wait: bool) -> None:
        """Check the push posted last: every rollout engine's fingerprints must equal the
        trainer ranks' partial ones added up. `wait=False` checks only a finished push (and
        reports a trainer rank whose push already failed); `wait=True` waits for it."""
        push, timeout = self._pushing, self.config.train.call_timeout_s
        if push is None:
            return
        if not wait and not push.done():
            if push.sent.done():
                push.sent.result(timeout)  # raises now if a trainer rank failed to send
            return
        self._pushing = None
        try:
            received = push.got.result(timeout)
        except WorkerError as lost:
            # A trainer rank that failed first is the cause: report it. But a rollout rank
            # that died is the cause of whatever its peers saw afterwards: report the death.
            if push.sent.done() and lost.reason != "died":
                push.sent.result(timeout)
            raise
        sent = push.sent.result(timeout)
        expected = combine(part[0] for part in sent)
        for r in received:
            check_same(expected, r.checksums, where=f"rollout engine of rollout rank {r.rank} "
                                                    f"(weights version {r.version})")
        # The push from its submission to the last rank's end; `time/push_trainer`: the
        # trainer's own share (gathering, posting its broadcasts).
        self._spans.append(Span(name="weight_push", start=push.submitted,
                                end=max(*(p[2] for p in sent), *(r.end for r in received))))
        self._push_trainer.append(max(p[2] - p[1] for p in sent))
        # Each rank's side as a worker span (its own clock): the trainer ranks gathering (rank
        # 0 also posting the broadcasts), the rollout ranks receiving, loading, fingerprinting.
        self._push_ranks += [report.push_result(ident, start, end) for ident, (_, start, end)
                             in zip(self.policy.identities, sent, strict=True)]
        self._push_ranks += [report.push_result(ident, r.start, r.end)
                             for ident, r in zip(self.rollout.identities, received, strict=True)]

    def _blame_push(self, failed: WorkerError) -> None:
        """A training phase failed while a push was unchecked: if a rollout rank broke that
        push, raise its failure instead (`posted_push.failed_receiver`: on NCCL the watchdog
        ends trainer rank 0 for it), with the trainer's as its context."""
        if self._pushing is not None and failed.role != "rollout":
            cause = failed_receiver(self._pushing, self.config.train.call_timeout_s)
            if cause is not None:
                raise cause from failed

    # ---- what a step reports (report.py) --------------------------------------------------

    def _pipeline_metrics(self, batch: Batch, phases: Phases,
                          version: int) -> dict[str, float]:
        since = None if self._inflight is None else self._inflight.launched
        return {**report.staleness(batch, version),
                "pipeline/overlap": report.step_overlap(phases, self._collected, since),
                "pipeline/queue": float(len(self.queue)),
                "pipeline/version": float(self.trainer_version),
                **report.off_policy(batch, self.config.pipeline),
                **report.pushes(self._spans, self._push_trainer, self.push_plan)}

