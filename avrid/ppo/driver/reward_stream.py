"""Chapter 5 — rewards scored while the step still generates (`rollout.stream_rewards`).

Serially the reward phase starts when the step's last response is generated, and the
reward worker idles through generation while the policy idles through scoring. A response
is final long before its batch is (the engine decodes the long tail for the others), so the
driver can send each one to the reward worker as soon as it ends:

    generate_streamed(k) on every policy rank                (`roles/streaming.py`)
    until every rank has ended:
        take_finished(k) on every rank   ("stream" lane: answers while generation goes on)
        each rank's newly finished responses ──► start_shards(reward, RewardWorker.score)
    the generate call's result                               (the step's "generate" phase)
    ... `learn` ... `score` ──► `take`: only the calls still running are waited for, and
                                the scores are put together   (the step's "reward" phase)

Bit for bit the serial scores and metrics: each response is scored from the same token ids
by the same function (a sample's reward never depends on when or beside which others it
was scored; a batched reward function gets the handfuls instead of the whole batch, so
one that looks across its batch, normalising say, would not be per-sample and cannot be
streamed), the "score" column is put back in the batch's order, and the metrics are
reduced on the driver over the serial call's own shards (`cached_plan`), in its order,
with the worker's own code (`reward.add_scores`), so a float sum adds the same numbers in
the same order. On the timeline the reward worker's spans sit under the "generate" phase;
the "reward" phase holds only the tail: the scoring of the last responses and the merge.

Failures stay the serial run's one-line errors: a reward call that raises is reported as
soon as its result is in (during generation too), a hung one by the group's call timeout
(`train.call_timeout_s`) when the driver waits for it; a generate call that fails is
reported as itself, even when a question on its stream lane noticed first, and one that
hangs by its own timeout (after at most twice `call_timeout_s`: the questions run first).

Not here: the policy rank's side (`roles/streaming.py`), what the scores are
(`roles/reward.py`), and the reward model, which scores the whole batch after generation
as before (`scoring.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import torch

from avrid.dispatch import Batch, Packed, cached_plan
from avrid.ppo.data.columns import with_responses
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.roles.reward import SCORE_READS, RewardWorker, add_scores
from avrid.ppo.roles.streaming import Finished, StreamingPolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.results import Merged, ResultBuilder, ShardCall, merge_metrics, start_shards
from avrid.workers import PlacementPlan, WorkerError, WorkerGroup

POLL_WAIT_S = 0.05
"""How long one question to a rank's stream lane waits for a response to finish before it
answers with none (this only bounds the idle round trips)."""
GATHER_S = 0.02
"""Once a response has finished, how long the rank gathers more before it answers (never
past the end of its generation): one reward call per handful, not one per response. Each
call costs a dispatch (~5-10 ms of CPU on Ray here) that a 2-core machine takes from
generation; the last handful, scored after generation, is what finished in the last
`GATHER_S` (measured: `benchmarks/bench_stream_rewards.py`)."""


def streaming_worker(config: PPOConfig, worker: type[PolicyWorker]) -> type[PolicyWorker]:
    """The policy worker class a trainer starts: `StreamingPolicyWorker` where
    ``rollout.stream_rewards`` asks for it, the rule reward is computed (not with a reward
    model at ``rule_weight=0``) and the trainer's own is chapter 5's `PolicyWorker`; else
    `worker` (chapter 6's and 7's trainers bring their own: chapter 7's environments score
    each episode as it ends already)."""
    rm = config.reward_model
    rule = not rm.enabled or rm.rule_weight != 0  # rule_weight=0: no rule reward to stream
    if config.rollout.stream_rewards and rule and worker is PolicyWorker:
        return StreamingPolicyWorker
    return worker


def with_policy_worker(plan: PlacementPlan, worker: type) -> PlacementPlan:
    """`plan` with its policy ranks running `worker` (`streaming_worker`'s choice)."""
    roles = tuple(dataclasses.replace(r, worker=worker) if r.role == "policy" else r
                  for r in plan.roles)
    return dataclasses.replace(plan, roles=roles)


def for_groups(policy: WorkerGroup, reward: WorkerGroup) -> RewardStream | None:
    """The run's `RewardStream` when its policy ranks stream (`StreamingPolicyWorker`),
    else None: each batch is scored whole, after generation."""
    if policy.worker_cls is not StreamingPolicyWorker:
        return None
    return RewardStream(policy, reward)


@dataclass(slots=True)
class _Scoring:
    """One generate call's reward calls, started as its responses finished."""

    sample_ids: torch.Tensor
    """The generated batch's ids, in its order (what `take` must be asked for)."""
    running: list[ShardCall] = field(default_factory=list)
    merged: list[Merged] = field(default_factory=list)
    """The calls that have answered, merged (in the order they were started)."""

    def collect(self) -> None:
        """Merge the calls that have answered, in order (so a failed one raises its error,
        the serial reward phase's, without waiting for those still running)."""
        while self.running and self.running[0].done():
            self.merged.append(self.running.pop(0).result())  # at once: it has answered

    def results(self) -> list[Merged]:
        """Every call merged, waiting for those still running (each at most the reward
        group's call timeout)."""
        while self.running:
            self.merged.append(self.running.pop(0).result())
        return self.merged


class RewardStream:
    """Scores each generate call's responses as its policy ranks finish them (module
    docstring). `generate` stands for the generate call; `take` for the reward call."""

    def __init__(self, policy: WorkerGroup, reward: WorkerGroup) -> None:
        self.policy, self.reward = policy, reward
        self._keys = itertools.count()  # a stream key per generate call
        self._pending: _Scoring | None = None

    def generate(self, prompts: Batch, sampling: dict[str, int | bool]) -> Merged:
        """Generate responses to `prompts` (the result `run_shards(policy,
        PolicyWorker.generate, prompts, **sampling)` gives, the same samples), starting the
        reward calls of the responses as they finish; `take` returns their scores."""
        key = next(self._keys)
        call = start_shards(self.policy, StreamingPolicyWorker.generate_streamed, prompts,
                            None, stream=key, **sampling)
        scoring = _Scoring(sample_ids=prompts.sample_ids)
        timeout = self.policy.call_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        generating = list(range(self.policy.world_size))  # the ranks not yet ended
        while generating:
            answers = self._ask(call, key, generating)
            for finished in answers:
                if finished.sample_ids:
                    scoring.running.append(self._score(prompts, finished))
            scoring.collect()
            generating = [r for r, f in zip(generating, answers, strict=True) if not f.last]
            if deadline is not None and time.monotonic() > deadline:
                break  # a stuck rank: the generate call's own timeout reports it below
        generated = call.result()
        self._pending = scoring  # for the `score` of this very batch, which comes next
        return generated

    def take(self, batch: Batch) -> Merged | None:
        """The rule reward call of `batch` (`scoring.rule_scores`' result, bit for bit), if
        its responses were streamed: waits for the reward calls still running and puts
        them together. None when they were not (validation, a batch that was refilled)."""
        scoring = self._pending
        if scoring is None or not torch.equal(scoring.sample_ids, batch.sample_ids):
            return None
        self._pending = None
        return _put_together(self.reward, batch, scoring.results())

    def _ask(self, call: ShardCall, key: int, ranks: list[int]) -> list[Finished]:
        """The newly finished responses of stream `key` on each of `ranks` (those whose
        generation has not ended: a rank that said `last` has forgotten the stream)."""
        try:
            return self.policy.call_ranks(ranks, StreamingPolicyWorker.take_finished, key,
                                          wait_s=POLL_WAIT_S, gather_s=GATHER_S)
        except WorkerError:
            if call.done():  # the generate call failed first: its error is the one to see
                call.result()
            raise

    def _score(self, prompts: Batch, finished: Finished) -> ShardCall:
        """Start the reward call of some finished responses (their rows as the serial reward
        call reads them: prompt + response tokens, split, prompt index)."""
        rows = prompts.select(list(finished.sample_ids))
        responses = Packed.from_rows([torch.tensor(r, dtype=torch.int64)
                                      for r in finished.responses])
        generated = Batch(sample_ids=rows.sample_ids, prompt_lens=rows.prompt_lens,
                          response_lens=torch.zeros_like(rows.prompt_lens),
                          packed={"response": responses})
        scored = with_responses(rows, generated).only(*SCORE_READS)
        return start_shards(self.reward, RewardWorker.score, scored)


def _put_together(reward: WorkerGroup, batch: Batch, calls: list[Merged]) -> Merged:
    """One merged reward call from the streamed ones: their columns in `batch`'s order, their
    workers' results and driver spans (the timeline), and the metrics the serial call would
    have reduced: its plan's shards (`cached_plan`, as `run_shards` makes it), each shard's
    rows in the order sent, `add_scores` (the worker's code), merged in rank order."""
    columns = Batch.concat([c.batch for c in calls]).select(batch.sample_ids)
    axis = reward.mesh.names[0]
    plan = cached_plan(batch.only(*SCORE_READS), reward.mesh.axis_size(axis), None)
    metrics = []
    for shard in range(plan.num_shards):
        rows = columns.take(list(plan.shard_positions(shard)))
        builder = ResultBuilder(reward.identities[shard], rows)
        extras = {name.removeprefix("reward/"): column
                  for name, column in rows.scalars.items() if name.startswith("reward/")}
        add_scores(builder, rows.sample_ids, rows.scalars["score"], extras)
        metrics += builder.build().metrics
    return Merged(batch=columns, metrics=merge_metrics(metrics),
                  results=tuple(r for c in calls for r in c.results),
                  driver_spans=tuple(s for c in calls for s in c.driver_spans))
