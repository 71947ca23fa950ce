"""Chapter 5 — `RewardWorker`: scores responses with the task's verifiable reward.

The reward role decodes each response (cut at the first EOS), looks up the prompt it answers
and calls ``task.reward(prompt, text)`` — or, when the config names reward functions
(``task.reward=module:function``, `setup/reward_functions.py`), those, weighted, with their
extra values logged as ``reward/<name>``. Every value goes through `task.check_reward`, so a
user reward that returns NaN, inf or a string stops the step with an error naming the sample,
the prompt and the value, instead of silently poisoning the advantages.

It is its own role (a worker, not a driver function) because real reward functions are
expensive — a sandbox running code, a learned reward model on a GPU — and must not block the
driver; here one CPU worker suffices, but the dispatch is the same for many.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from avrid.dispatch import Batch, Shard
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.reward_functions import Sample, load_functions, score_samples
from avrid.ppo.setup.task import Prompt, Task, check_reward
from avrid.ppo.setup.tokenizer import Tokenizer, response_text
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import Worker, WorkerIdentity

SCORE_READS = ("tokens", "split", "prompt_index")
"""The batch columns `RewardWorker.score` reads: the driver sends only these
(``batch.only(*SCORE_READS)``), not every column the batch has grown."""
SCORE_WRITES = ("score",)
"""The column `RewardWorker.score` adds: the rule reward per sample (with a reward model it is
the "rule_score" that `driver/scoring.py` weighs against the model's). Its result also holds
each logged extra per sample ("reward/<name>"), which the driver does not add to the batch."""


def add_scores(builder: ResultBuilder, sample_ids: torch.Tensor, scores: torch.Tensor,
               extras: Mapping[str, torch.Tensor]) -> None:
    """The rule reward's outputs for these samples — "score", and each extra the reward
    functions log as the per-sample column "reward/<name>" — and their means as metrics.
    `RewardWorker.score` adds its shard's with it, and the driver the whole batch's of a
    streamed step (`driver/reward_stream.py`), so both reduce the same numbers the same way:
    a streamed step's metrics are the serial step's bit for bit."""
    columns = {f"reward/{name}": column for name, column in extras.items()}
    builder.add(sample_ids, scalars={"score": scores, **columns})
    builder.metric("reward/score", scores, "mean_samples")
    for name, column in columns.items():
        builder.metric(name, column, "mean_samples")


class RewardWorker(Worker):
    """Scores shards of (prompt + response) sequences; outputs the per-sample "score"."""

    def __init__(self, identity: WorkerIdentity, *, task_name: str, task_options: dict,
                 task_path: str | None, tokenizer: Tokenizer,
                 rewards: Mapping[str, float] | None = None) -> None:
        super().__init__(identity)
        kwargs = dict(task_options)
        if task_path is not None:
            kwargs["path"] = task_path
        # Loaded here, in the worker's process: a custom task's module must be importable
        # on every machine, which is checked the moment the cluster starts.
        self.task: Task = load_task(task_name, **kwargs)
        # The splits as the task gives them (sequences, read by index): never listed, since
        # a split may be computed rather than stored (8-digit strings: 10**8 prompts).
        self.splits: tuple[Sequence[Prompt], Sequence[Prompt]] = (
            self.task.train_prompts(), self.task.val_prompts())
        self.tokenizer = tokenizer
        # `rewards` (spec -> weight) replaces the task's reward; its modules are imported here,
        # by name, like a custom task's (a file spec arrives as an absolute path).
        self.functions = load_functions(rewards or {})

    def score(self, shard: Shard) -> WorkerResult:
        """Reward of every sample of the shard; needs scalar columns "prompt_index" and
        "split" (TRAIN or VAL)."""
        builder = ResultBuilder.for_shard(self.identity, shard)
        batch = shard.batch
        extras: dict[str, list[float]] = {}
        with builder.span("reward"):
            samples = self.samples(batch)
            if self.functions:
                values, extras = score_samples(self.functions, samples)
            else:
                values = [self._task_reward(s) for s in samples]
            scores = torch.tensor(values, dtype=torch.float32)
        add_scores(builder, batch.sample_ids, scores,
                   {name: torch.tensor(column, dtype=torch.float32)
                    for name, column in extras.items()})
        return builder.build()

    def samples(self, batch: Batch) -> list[Sample]:
        """Every row of `batch` as its prompt and decoded response (the reward model's
        worker, `reward_model.py`, reads its rows through this too)."""
        return [self._sample(batch, i) for i in range(len(batch))]

    def _task_reward(self, sample: Sample) -> float:
        """The task's own reward of one sample, checked; errors name the sample."""
        value = self.task.reward(sample.prompt, sample.response)
        try:
            return check_reward(value, task_name=self.task.name, prompt=sample.prompt)
        except ValueError as e:
            raise ValueError(f"sample {sample.sample_id}: {e}") from None

    def _sample(self, batch: Batch, i: int) -> Sample:
        """Row `i` of `batch` as its prompt and decoded response."""
        split = int(batch.scalars["split"][i])
        prompt = self.splits[split][int(batch.scalars["prompt_index"][i])]
        row = batch.packed["tokens"].row(i)[int(batch.prompt_lens[i]):].tolist()
        return Sample(sample_id=int(batch.sample_ids[i]), prompt=prompt,
                      response=response_text(row, self.tokenizer))
