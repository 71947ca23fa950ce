"""Chapter 5 — `RewardModelWorker`: a learned reward model (an HF sequence classifier) as a role.

Each rank holds the whole reward model (`reward_model.path`, frozen, in eval mode) and scores
the shard the driver's token-aware plan sent it (chapter 2's `run_shards`, like every role):

1. each response is decoded with the POLICY's tokenizer and joined to its prompt's text —
   the same reader the rule reward uses (`RewardWorker.samples`);
2. the text is made with `reward_model.template` (or the RM tokenizer's chat template) and
   tokenized with the reward model's OWN tokenizer: its vocabulary is not the policy's;
3. the sequences are cut into padded forwards of at most `micro_batch_tokens` tokens, padding
   included (`padded_micro_batches`: longest first, so rows of a forward have similar lengths);
4. each forward is the model's own ``model(input_ids, attention_mask).logits[:, 0]``, right
   padded with the model's pad id: transformers' pooling (the last token that is not the pad
   id) is used as it is, so a score is bit for bit the one transformers gives the text alone,
   up to the padded attention's rounding.

A checkpoint without a pad id (``config.pad_token_id`` None) is run one sequence per forward,
as transformers would require. The scores ("model_score", float32) go back as a per-sample
column and the metric ``reward/model_score``. The driver combines them with the rule rewards
(`driver/scoring.py`); this worker does not know the weights, the placement or the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from avrid.dispatch import Shard
from avrid.ppo.roles.reward import RewardWorker
from avrid.ppo.setup.reward_functions import Sample
from avrid.ppo.setup.reward_model import RewardModelConfig, check_checkpoint
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import Worker, WorkerIdentity

MODEL_SCORE_WRITES = ("model_score",)
"""The column `RewardModelWorker.score` adds; it reads `reward.SCORE_READS`, like the rule
reward."""


class RewardModelWorker(Worker):
    """One rank of the reward model: scores shards of (prompt + response) sequences."""

    def __init__(self, identity: WorkerIdentity, *, config: RewardModelConfig, device: str,
                 reader: dict) -> None:
        """`reader`: the rule reward worker's keyword arguments (task and policy tokenizer),
        used to turn a row of the batch into its prompt and decoded response."""
        super().__init__(identity)
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_checkpoint(config.path)
        self.config = config
        self.device = torch.device(device)
        self.reader = RewardWorker(identity, **{**reader, "rewards": None})
        self.tokenizer = AutoTokenizer.from_pretrained(config.path)
        dtype = getattr(torch, config.torch_dtype(device))
        self.model = AutoModelForSequenceClassification.from_pretrained(
            config.path, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        text_config = self.model.config.get_text_config()
        self.pad_id: int | None = text_config.pad_token_id
        self.max_length: int | None = (config.max_length if config.max_length is not None
                                       else getattr(text_config, "max_position_embeddings",
                                                    None))

    def texts(self, samples: Sequence[Sample]) -> list[str]:
        """The text the reward model reads for each sample (template or chat template)."""
        if self.config.chat_template:
            return [self.tokenizer.apply_chat_template(
                [{"role": "user", "content": s.prompt.text},
                 {"role": "assistant", "content": s.response}], tokenize=False)
                for s in samples]
        return [self.config.template.format(prompt=s.prompt.text, response=s.response)
                for s in samples]

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text under the reward model's tokenizer, each at most
        `max_length` (a longer text keeps its last tokens: `truncated`)."""
        return [self.truncated(row) for row in self.tokenize(texts)]

    def truncated(self, row: list[int]) -> list[int]:
        """`row` cut to its last `max_length` tokens: the score is read at the last token,
        so the end of the response is kept and the start of the prompt dropped."""
        return row if self.max_length is None else row[-self.max_length:]

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text under the reward model's tokenizer, whole. A chat template
        already holds its special tokens; a plain template gets those the tokenizer adds."""
        add = not self.config.chat_template
        ids = [self.tokenizer(t, add_special_tokens=add)["input_ids"] for t in texts]
        for text, row in zip(texts, ids, strict=True):
            if not row:
                raise ValueError(f"reward_model: the text {text[:80]!r} has no tokens under "
                                 f"the reward model's tokenizer; nothing to score")
        return ids

    def score(self, shard: Shard) -> WorkerResult:
        """The reward model's score of every sample of the shard: the scalar column
        "model_score"; needs the columns of `reward.SCORE_READS`."""
        builder = ResultBuilder.for_shard(self.identity, shard)
        batch = shard.batch
        with builder.span("reward_model"):
            samples = self.reader.samples(batch)
            whole = self.tokenize(self.texts(samples))
            ids = [self.truncated(row) for row in whole]
            scores = self.forward(ids)
        builder.add(batch.sample_ids, scalars={"model_score": scores})
        builder.metric("reward/model_score", scores, "mean_samples")
        # The share of texts cut to `max_length`: a run whose responses outgrow the reward
        # model shows it here instead of scoring positions the model never learned.
        cut = [len(row) < len(full) for row, full in zip(ids, whole, strict=True)]
        builder.metric("reward/model_truncated", torch.tensor(cut, dtype=torch.float32),
                       "mean_samples")
        return builder.build()

    def forward(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Scores (float32, CPU) of tokenized sequences, in padded forwards of at most
        `micro_batch_tokens` tokens each (one sequence each without a pad id)."""
        lengths = [len(row) for row in ids]
        budget = self.config.micro_batch_tokens if self.pad_id is not None else 1
        scores = torch.zeros(len(ids), dtype=torch.float32)
        pad = self.pad_id if self.pad_id is not None else 0
        with torch.no_grad():
            for group in padded_micro_batches(lengths, budget):
                width = max(lengths[i] for i in group)
                x = torch.full((len(group), width), pad, dtype=torch.long)
                mask = torch.zeros((len(group), width), dtype=torch.long)
                for row, i in enumerate(group):  # right padding: positions stay 0, 1, ...
                    x[row, :lengths[i]] = torch.tensor(ids[i])
                    mask[row, :lengths[i]] = 1
                logits = self.model(input_ids=x.to(self.device),
                                    attention_mask=mask.to(self.device)).logits
                scores[group] = logits[:, 0].float().cpu()
        return scores


def padded_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Positions grouped into padded forwards of at most `budget` tokens (rows x the longest
    row): longest first, so that a forward's rows have similar lengths and little padding;
    a sequence over the budget runs alone.

    Example:
        >>> padded_micro_batches([3, 9, 4, 8], budget=16)
        [[1], [3, 2], [0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        # The group's first row is its longest (longest first): it sets the padded width.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
