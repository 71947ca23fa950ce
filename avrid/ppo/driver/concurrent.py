"""Chapter 5 — the step's phases issued as soon as they may run (`train.concurrent_phases`).

`Trainer.learn` runs reward, log-probs, values, advantages and the updates one after another,
so with the critic on a pool of its own its ranks wait while the policy works and the
policy's wait while it works. `learn_concurrently` runs the same phases by the step's graph
(`step_graph.py`): it issues every phase whose predecessors have finished — on the Ray and
the in-process backend alike, each in a driver thread of its own that makes exactly the
serial call (`run_shards`, with its timeout and its fail-fast errors) — waits for any of
them to finish, and issues what that made ready. PPO with the critic on its own pool:

    reward | old_logp | values        (three groups at once; each reads only the tokens)
    ref_logp                          (policy order: after old_logp; with
                                       placement.reference=pool, in the first wave)
    advantages                        (the driver's own, like resample and combine_scores:
                                       run in this thread while the workers' phases go on)
    critic_update | actor_update      (two groups at once)

Bit for bit the serial run, by construction: a phase reads the batch its predecessors made,
rebuilt in the serial order (`_Run.batch_for`: the same columns, the very same tensors), so
every call gets the input it gets serially; and once every phase has finished, the batch,
the calls kept for the metrics and each phase's spans are put together in the serial order,
so the metrics average the same numbers in the same order. On the timeline the driver's side
of each worker group's phases gets a lane of its own (``driver:critic``, ...), since they
overlap in time. (`time/compute` still sums each call's busiest rank, so with calls that
overlap it can exceed the step, and `time/overhead` reads 0.)

Failures: the first phase to fail (the earliest in the serial order among those that failed
together) ends the step with its own error, the one the serial run raises for that call.
The phases still in flight are not waited for: the trainer's close stops their workers (Ray:
kills the actors), as after any failure. Ctrl-C reaches this thread, which only ever waits
here, as in the serial loop. Chapter 6's pipeline is tended (`Phases.boundary`) before a
phase is issued, as serially, but only while no policy phase is in flight and the actor's
update has not begun, so a weight push never lands between two of its mini-batches.

Not here: which phase waits for which (`step_graph.py`), what a phase computes (the trainer
and its helpers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from avrid.dispatch import Batch
from avrid.ppo.data.columns import add_columns, reads
from avrid.ppo.data.credit import compute_advantages
from avrid.ppo.driver.reference import reference_logprobs
from avrid.ppo.driver.scoring import combined, model_scores, rule_reward
from avrid.ppo.driver.step_graph import DRIVER, StepGraph, StepPhase, learn_graph
from avrid.ppo.roles.critic import CRITIC_UPDATE_READS, VALUES_READS, CriticWorker
from avrid.ppo.roles.policy import LOGPROBS_READS, PolicyWorker, actor_update_reads
from avrid.results import Merged, Phases, run_shards

if TYPE_CHECKING:
    from avrid.ppo.driver.trainer import Trainer

OUTSIDE_LEARN = ("generate", "weight_sync")
"""The step's phases `learn` does not run: `train_step` generates before and syncs after."""


@dataclass
class Outcome:
    """What one phase did: how it changes the batch, and its timed spans and calls."""

    update: Callable[[Batch], Batch]
    """The batch after the phase, from the batch before it (new columns, or resample's new
    rows)."""
    kept: list[Merged] = field(default_factory=list)
    """The calls whose metrics the step reports (`learn`'s returned list)."""
    phases: Phases = field(default_factory=Phases)
    """Its spans and every call it made, for the step's timing and timeline."""


def learn_concurrently(trainer: Trainer, step: int, batch: Batch,
                       phases: Phases) -> tuple[Batch, list[Merged]]:
    """`Trainer.learn` with each phase issued when ready (module docstring); returns what
    the serial `learn` returns, bit for bit."""
    graph = learn_graph(trainer.config, updates_actor=trainer.updates_actor(step))
    run = _Run(trainer, step, batch, graph)
    order = [n for n in graph.names() if n not in OUTSIDE_LEARN]
    running: dict[Future[Outcome], str] = {}
    issued: set[str] = set()
    while len(run.done) < len(order):
        ready = [n for n in graph.ready(["generate", *run.done])  # generated: `batch`
                 if n in order and n not in issued]
        if ready:  # one at a time, in the serial order: a driver phase may ready more
            name = ready[0]
            if run.may_tend(list(running.values()), issued):
                phases.boundary()
            issued.add(name)
            if graph.phase(name).group == DRIVER:  # the driver's own work: here, now
                run.done[name] = run.body(name)()
            else:
                running[_start(name, run.body(name))] = name
            continue
        if not running:  # nothing in flight, nothing ready: the graph cannot be finished
            raise RuntimeError(f"step {step}: phases {sorted(set(order) - issued)} wait for "
                               f"phases that never run")
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in sorted(finished, key=lambda f: order.index(running[f])):
            name = running.pop(future)
            run.done[name] = future.result()  # the first failure is raised here, as itself
    outcomes = [run.done[n] for n in order]
    for name, outcome in zip(order, outcomes, strict=True):
        phases.extend(outcome.phases, lane=_driver_lane(graph.phase(name)))
    return run.batch_for(order), [m for o in outcomes for m in o.kept]


def _driver_lane(phase: StepPhase) -> str | None:
    """The timeline lane of the driver's side of `phase`: one per worker group and lane
    (phases on one never overlap: the graph chains them), the driver's own for its phases."""
    if phase.group == DRIVER:
        return None
    return f"{DRIVER}:{phase.group}" + ("" if phase.lane == "default" else f":{phase.lane}")


def _start(name: str, body: Callable[[], Outcome]) -> Future[Outcome]:
    """Run `body` in a daemon thread (a stuck call never keeps the driver from exiting; its
    workers are stopped by the trainer's close); its outcome or its exception in a future."""
    future: Future[Outcome] = Future()

    def run() -> None:
        try:
            future.set_result(body())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(exc)

    threading.Thread(target=run, name=f"phase:{name}", daemon=True).start()
    return future


class _Run:
    """One step's phases: their bodies, their outcomes and the batch each one reads."""

    def __init__(self, trainer: Trainer, step: int, batch: Batch, graph: StepGraph) -> None:
        self.trainer, self.step, self.base, self.graph = trainer, step, batch, graph
        self.done: dict[str, Outcome] = {}

    def batch_for(self, names: list[str]) -> Batch:
        """The batch after the phases `names` (those done among them), applied in the serial
        order to the generated batch: what the serial run holds after them."""
        batch = self.base
        for name in self.graph.names():
            if name in names and name in self.done:
                batch = self.done[name].update(batch)
        return batch

    def inputs(self, name: str) -> Batch:
        """The batch phase `name` reads: its predecessors' (all of them, transitively)."""
        before, todo = set(), list(self.graph.waits_for(name))
        while todo:
            if (p := todo.pop()) not in before:
                before.add(p)
                todo.extend(self.graph.waits_for(p))
        return self.batch_for(sorted(before))

    def may_tend(self, running: list[str], issued: set[str]) -> bool:
        """Whether chapter 6's pipeline may be tended now: no policy phase in flight (a push
        goes through the policy's ranks) and the actor's update not yet begun."""
        busy = any("policy" in self.graph.phase(n).groups for n in running)
        return not busy and "actor_update" not in issued

    def body(self, name: str) -> Callable[[], Outcome]:
        """The phase `name` as a call that runs it on its inputs, timed on its own
        `Phases` (each body is the serial `learn`'s code for that phase)."""
        batch = self.inputs(name)
        bodies = {"reward": self.reward, "reward_model": self.reward_model,
                  "combine_scores": self.combine_scores, "resample": self.resample,
                  "old_logp": self.old_logp, "ref_logp": self.ref_logp,
                  "values": self.values, "advantages": self.advantages,
                  "critic_update": self.critic_update, "actor_update": self.actor_update}
        return lambda: bodies[name](batch, Phases())

    # ---- the phases, as `Trainer.learn` (and `scoring.score_batch`) runs them ----------------

    def reward(self, batch: Batch, local: Phases) -> Outcome:
        t = self.trainer
        if not t.config.reward_model.enabled:  # the trainer's own `score` (chapter 7's: none)
            scored, calls = t.score(batch, local)
            return Outcome(_added(batch, scored), [local.add(c) for c in calls], local)
        # With a reward model, `scoring.score_batch`'s two calls, each a phase of its own (a
        # trainer that scores otherwise, chapter 7's, takes no reward model).
        with local("reward"):
            call = local.add(rule_reward(t.reward, batch, t.reward_stream))
        return Outcome(lambda b: b, [call], local)  # combine_scores weighs it

    def reward_model(self, batch: Batch, local: Phases) -> Outcome:
        if self.trainer.reward_model is None:
            raise ValueError("reward_model.path is set but no reward_model group was started")
        with local("reward_model"):
            call = local.add(model_scores(self.trainer.reward_model, batch))
        return Outcome(lambda b: b, [call], local)

    def combine_scores(self, batch: Batch, local: Phases) -> Outcome:
        rule = self.done.get("reward")
        model_score = self.done["reward_model"].kept[0].batch.scalars["model_score"]
        columns = combined(self.trainer.config.reward_model,
                           None if rule is None else rule.kept[0].batch.scalars["score"],
                           model_score)
        return Outcome(lambda b: add_columns(b, scalars=columns), [], local)

    def resample(self, batch: Batch, local: Phases) -> Outcome:
        with local("resample"):
            refilled, more, fill = self.trainer.fill(self.step, batch)
        self.trainer.fill_stats = fill
        return Outcome(lambda b: refilled, [local.add(m) for m in more], local)

    def old_logp(self, batch: Batch, local: Phases) -> Outcome:
        t = self.trainer
        with local("old_logp"):
            call = local.add(run_shards(t.policy, PolicyWorker.compute_logprobs,
                                        reads(batch, LOGPROBS_READS), t.dispatch))
        values = call.batch.packed["old_logp"]
        return Outcome(lambda b: add_columns(b, packed={"old_logp": values}), [call], local)

    def ref_logp(self, batch: Batch, local: Phases) -> Outcome:
        with local("ref_logp"):  # on the policy's ranks or the reference pool's
            call = local.add(reference_logprobs(self.trainer, reads(batch, LOGPROBS_READS)))
        values = call.batch.packed["ref_logp"]
        return Outcome(lambda b: add_columns(b, packed={"ref_logp": values}), [], local)

    def values(self, batch: Batch, local: Phases) -> Outcome:
        t = self.trainer
        with local("values"):
            call = local.add(run_shards(t.critic, CriticWorker.compute_values,
                                        reads(batch, VALUES_READS), t.dispatch))
        values = call.batch.packed["values"]
        return Outcome(lambda b: add_columns(b, packed={"values": values}), [], local)

    def advantages(self, batch: Batch, local: Phases) -> Outcome:
        t = self.trainer
        with local("advantages"):
            out = compute_advantages(batch, t.config, max_response=t.max_response)
        return Outcome(_added(batch, out), [], local)

    def critic_update(self, batch: Batch, local: Phases) -> Outcome:
        t = self.trainer
        with local("critic_update"):
            calls = t.train_on(t.critic, CriticWorker.update,
                               reads(batch, CRITIC_UPDATE_READS), self.step, local)
        return Outcome(lambda b: b, calls, local)

    def actor_update(self, batch: Batch, local: Phases) -> Outcome:
        t = self.trainer
        with local("actor_update"):
            calls = t.train_on(t.policy, PolicyWorker.update,
                               reads(batch, actor_update_reads(t.config)), self.step, local)
        return Outcome(lambda b: b, calls, local)


def _added(before: Batch, after: Batch) -> Callable[[Batch], Batch]:
    """The update that adds to a batch what `after` holds beyond `before` (new or replaced
    columns), taken as they are: the very tensors the serial run holds."""
    packed = {k: v for k, v in after.packed.items() if before.packed.get(k) is not v}
    scalars = {k: v for k, v in after.scalars.items() if before.scalars.get(k) is not v}
    return lambda b: add_columns(b, packed=packed, scalars=scalars)
