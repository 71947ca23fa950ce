"""Chapter 5 — `RewardWorker`: scores responses with the task's verifiable reward.

The reward role decodes each response (cut at the first EOS), looks up the prompt it answers
and calls ``task.reward(prompt, text)``. Every value goes through `task.check_reward`, so a
user reward that returns NaN, inf or a string stops the step with an error naming the sample,
the prompt and the value, instead of silently poisoning the advantages.

It is its own role (a worker, not a driver function) because real reward functions are
expensive — a sandbox running code, a learned reward model on a GPU — and must not block the
driver; here one CPU worker suffices, but the dispatch is the same for many.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from avrid.dispatch import Shard
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.task import Prompt, Task, check_reward
from avrid.ppo.setup.tokenizer import Tokenizer, response_text
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import Worker, WorkerIdentity

SCORE_READS = ("tokens", "split", "prompt_index")
"""The batch columns `RewardWorker.score` reads: the driver sends only these
(``batch.only(*SCORE_READS)``), not every column the batch has grown."""


class RewardWorker(Worker):
    """Scores shards of (prompt + response) sequences; outputs the per-sample "score"."""

    def __init__(self, identity: WorkerIdentity, *, task_name: str, task_options: dict,
                 task_path: str | None, tokenizer: Tokenizer) -> None:
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

    def score(self, shard: Shard) -> WorkerResult:
        """Reward of every sample of the shard; needs scalar columns "prompt_index" and
        "split" (TRAIN or VAL)."""
        builder = ResultBuilder.for_shard(self.identity, shard)
        batch = shard.batch
        scores = torch.zeros(len(batch), dtype=torch.float32)
        with builder.span("reward"):
            for i in range(len(batch)):
                split = int(batch.scalars["split"][i])
                prompt = self.splits[split][int(batch.scalars["prompt_index"][i])]
                row = batch.packed["tokens"].row(i)[int(batch.prompt_lens[i]):].tolist()
                value = self.task.reward(prompt, response_text(row, self.tokenizer))
                try:
                    scores[i] = check_reward(value, task_name=self.task.name, prompt=prompt)
                except ValueError as e:
                    raise ValueError(f"sample {int(batch.sample_ids[i])}: {e}") from None
        builder.add(batch.sample_ids, scalars={"score": scores})
        builder.metric("reward/score", scores, "mean_samples")
        return builder.build()
