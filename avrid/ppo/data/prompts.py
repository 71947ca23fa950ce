"""Chapter 5 — prompts in, batches out: the data side of the training loop.

- `PromptSet`: a task's prompts of one split, each tokenized and checked against the
  prompt-length cap when first read (a too-long prompt fails naming it).
- `step_indices`: which training prompts step k uses. The order is a seeded permutation per
  epoch and the position is ``k * prompts_per_step``, so the data position is a function of
  the step: a run resumed at step k reads exactly what the uninterrupted run read.
- `prompt_batch`: the prompts of a step, each repeated `responses_per_prompt` times, as a
  chapter 2 `Batch` (unique sample ids, the prompt's index and its group for GRPO).
- `mini_batches`: a step's samples shuffled and cut into the optimizer's mini-batches.
- `step_seed`: the sampling seed of step k (and of validation), from (seed, k) alone.

No models and no Ray here; `driver/trainer.py` calls these. What a batch then grows (responses,
scores, log-probs, advantages) is `columns.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from avrid.dispatch import Batch, Packed
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.task import Prompt
from avrid.ppo.setup.tokenizer import Tokenizer

TRAIN, VAL = 0, 1
"""Values of the per-sample "split" column: which prompt list "prompt_index" points into."""


class PromptSet:
    """One split's prompts, each tokenized and checked the first time a step reads it.

    Lazy on purpose: a task's split may be computed rather than stored. The digit task's
    training split of 8-digit strings holds 10**8 prompts and a step reads a handful, so
    tokenizing the whole split up front would take minutes and gigabytes for nothing. A
    prompt longer than `max_tokens` (or empty) therefore fails when it is first read, naming
    it — as verl's dataset does with ``truncation="error"``. The trainer reads the whole
    validation split at start, so that one fails before anything runs.

    Example:
        >>> from avrid.ppo.setup.tokenizer import CharTokenizer
        >>> s = PromptSet([Prompt(index=0, text="12=", answer="21")], CharTokenizer("0123456789="),
        ...               max_tokens=8, split="train")
        >>> len(s), s.token_ids(0)
        (1, (3, 4, 12))
    """

    __slots__ = ("prompts", "split", "_tokenizer", "_max_tokens", "_ids")

    def __init__(self, prompts: Sequence[Prompt], tokenizer: Tokenizer, *, max_tokens: int,
                 split: str) -> None:
        self.prompts = prompts
        self.split = split
        self._tokenizer = tokenizer
        self._max_tokens = max_tokens
        self._ids: dict[int, tuple[int, ...]] = {}  # the prompts read so far

    def __len__(self) -> int:
        return len(self.prompts)

    def token_ids(self, i: int) -> tuple[int, ...]:
        """The token ids of prompt `i`; ValueError naming it if it is empty or too long."""
        ids = self._ids.get(i)
        if ids is None:
            p = self.prompts[i]
            ids = tuple(self._tokenizer.encode(p.text))
            if not 1 <= len(ids) <= self._max_tokens:
                raise ValueError(f"{self.split} prompt {p.index} ({p.text[:60]!r}) has "
                                 f"{len(ids)} tokens; rollout.max_prompt_tokens allows "
                                 f"1..{self._max_tokens}")
            self._ids[i] = ids
        return ids


def step_indices(step: int, count: int, num_prompts: int, seed: int) -> list[int]:
    """Indices of the `count` training prompts of step `step` (0-based), epoch by epoch.

    Example:
        >>> step_indices(0, 3, 4, seed=0) + step_indices(1, 3, 4, seed=0)  # 2 epochs of 4
        [0, 1, 3, 2, 1, 3]
    """
    out = []
    for position in range(step * count, (step + 1) * count):
        epoch, offset = divmod(position, num_prompts)
        out.append(int(_epoch_order(seed, epoch, num_prompts)[offset]))
    return out


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, num_prompts: int) -> torch.Tensor:
    """One permutation per epoch, from (seed, epoch) alone: no state to save or restore.
    Cached, because a step reads one or two epochs' orders and a big dataset's permutation
    costs milliseconds to draw (bench_ppo caught it taking 8% of a step, redrawn per prompt)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_prompts, generator=gen)


PROMPT_COLUMNS = ("tokens", "prompt_index", "split", "group")
"""The columns of `prompt_batch`'s rows (after generation "tokens" holds prompt + response)."""


def prompt_batch(prompts: PromptSet, indices: Sequence[int], *, repeats: int, first_id: int,
                 split: int) -> Batch:
    """`indices` prompts, each `repeats` times in a row; sample ids from `first_id` on.

    Scalar columns: "prompt_index" (into the split), "split", "group" (0.. per prompt: the
    GRPO group of its responses).
    """
    # Each distinct prompt is made a tensor once, then its row is repeated (one gather).
    once = Packed.from_rows([torch.tensor(prompts.token_ids(i), dtype=torch.int64)
                             for i in indices])
    group = torch.arange(len(indices)).repeat_interleave(repeats)
    tokens = once.take(group)
    n = len(group)
    return Batch(sample_ids=torch.arange(first_id, first_id + n),
                 prompt_lens=tokens.lengths, response_lens=torch.zeros(n, dtype=torch.int64),
                 packed={"tokens": tokens},
                 scalars={"prompt_index": torch.tensor(list(indices), dtype=torch.int64)
                          .repeat_interleave(repeats),
                          "split": torch.full((n,), split, dtype=torch.int64),
                          "group": group})


def mini_batches(n: int, size: int, min_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Shuffle positions 0..n-1 and cut them into chunks of `size`; a last chunk smaller than
    `min_size` (fewer samples than data-parallel ranks, which FSDP cannot split) joins the
    previous one. Nothing has to divide anything.

    Example:
        >>> [len(c) for c in mini_batches(10, 4, 3, torch.Generator().manual_seed(0))]
        [4, 6]
    """
    order = torch.randperm(n, generator=gen)
    chunks = list(order.split(size))
    if len(chunks) > 1 and len(chunks[-1]) < min_size:
        last = chunks.pop()
        chunks[-1] = torch.cat([chunks[-1], last])
    return chunks


def step_seed(config: PPOConfig, step: int) -> int:
    """The sampling seed of `step` (-1: validation), from (train.seed, step) alone; each rank
    adds its rank, and the step's mini-batch shuffle uses this + 1."""
    return config.train.seed * 1_000_003 + (step + 1) * 7919
