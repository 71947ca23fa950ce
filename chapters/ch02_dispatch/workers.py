"""Chapter 2 — the example worker and the example batch of the demo and the notebook.

- `rollout_batch` makes what a reasoning-RL step hands the trainer: G responses for each of P
  prompts (GRPO groups), with long-tailed response lengths — most short, a few very long, and a
  spike at the maximum length where generation was cut off. Hard prompts make the whole group
  long, so consecutive samples are correlated, as they are in a real rollout buffer. Tokens
  travel packed (one flat tensor plus offsets), never padded.
- `LogProbWorker` stands in for an actor computing log-probs: it takes its `Shard`, walks the
  micro-batches, and returns one "log-prob" per sample (a toy function of the tokens, so the
  driver can recompute it and check every value) plus where the sample ran (dp rank,
  micro-batch index), as a `Batch` in the shard's order — what `DispatchPlan.restore` expects.

These live in an importable module, not in the demo's ``__main__``, because Ray pickles a
class by reference (module + name): each worker process must be able to import it.
"""

from __future__ import annotations

import numpy as np
import torch

from avrid.dispatch import Batch, Shard
from avrid.workers import Worker, WorkerIdentity

VOCAB = 32_000


def rollout_batch(*, num_prompts: int = 64, group_size: int = 8, max_response: int = 4096,
                  median_response: int = 900, seed: int = 0) -> Batch:
    """`num_prompts` x `group_size` sequences with lognormal response lengths, capped at
    `max_response` (the cap is the spike: truncated generations). Same seed, same batch."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(64, 512, num_prompts)
    # Each prompt has a difficulty (its typical length); its responses scatter around it.
    typical = rng.lognormal(np.log(median_response), 0.9, num_prompts)
    response = rng.lognormal(np.log(np.repeat(typical, group_size)), 0.6)
    response_lens = np.clip(response, 1, max_response).astype(np.int64)

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(VOCAB, (int(n),), generator=gen) for n in prompt_lens]
    tokens = [torch.cat([prompts[i // group_size],  # the G responses share their prompt
                         torch.randint(VOCAB, (int(r),), generator=gen)])
              for i, r in enumerate(response_lens.tolist())]
    n = num_prompts * group_size
    return Batch.from_rows(
        sample_ids=range(1000, 1000 + n),  # stable ids, deliberately not positions
        prompt_lens=np.repeat(prompt_lens, group_size).tolist(),
        response_lens=response_lens.tolist(),
        packed={"tokens": tokens},
        scalars={"prompt": torch.arange(n) // group_size})


def toy_logprobs(batch: Batch) -> torch.Tensor:
    """(n,) float64: the sum over each sample's *response* tokens of -log(2 + token % 30).

    A stand-in for a model's sequence log-prob that works on the packed column directly: every
    token knows its row (`repeat_interleave` of the lengths), so no padding is ever made.
    """
    tokens = batch.packed["tokens"]
    n = len(batch)
    row = torch.repeat_interleave(torch.arange(n), tokens.lengths)
    pos_in_row = torch.arange(len(tokens.values)) - tokens.offsets[:-1][row]
    is_response = pos_in_row >= batch.prompt_lens[row]
    per_token = -torch.log(2.0 + (tokens.values % 30).to(torch.float64))
    return torch.zeros(n, dtype=torch.float64).index_add_(0, row[is_response],
                                                          per_token[is_response])


class LogProbWorker(Worker):
    """A pretend actor: per-sample log-probs of its shard, micro-batch by micro-batch."""

    def __init__(self, identity: WorkerIdentity) -> None:
        super().__init__(identity)
        self._last = "nothing received yet"

    def log_probs(self, shard: Shard) -> Batch:
        """One row per sample of `shard`, in the shard's order: "logprob", "dp", "micro"."""
        dp = self.identity.coords["dp"]
        if shard.index != dp:  # the dispatcher routes by DP coordinate; check it did
            raise ValueError(f"{self.identity.name} (dp={dp}) received shard {shard.index}")
        # Start from empty tensors: a shard may be empty (more shards than samples).
        logprobs = [torch.zeros(0, dtype=torch.float64)]
        micro = [torch.zeros(0, dtype=torch.int64)]
        for i, mb in enumerate(shard.micro_batches()):  # one forward pass each, on a real GPU
            logprobs.append(toy_logprobs(mb))
            micro.append(torch.full((len(mb),), i, dtype=torch.int64))
        b = shard.batch
        self._last = (f"{self.identity.name} {self.identity.coords}: shard {shard.index}, "
                      f"{len(b)} samples, {int(b.total_lens.sum())} tokens, "
                      f"{len(shard.micro_bounds) - 1} micro-batches")
        return Batch(sample_ids=b.sample_ids, prompt_lens=b.prompt_lens,
                     response_lens=b.response_lens,
                     scalars={"logprob": torch.cat(logprobs), "micro": torch.cat(micro),
                              "dp": torch.full((len(b),), dp, dtype=torch.int64)})

    def last_shard(self) -> str:
        """What this rank received in its last `log_probs` call (TP replicas: the same shard)."""
        return self._last
