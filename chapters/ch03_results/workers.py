"""Chapter 3 — the example worker of the demo and the notebook: one computation, three local
strategies, one canonical result.

`ActorWorker.log_probs(shard, strategy)` stands in for an actor computing the old log-probs of
its shard. It can walk the shard three ways (`STRATEGIES`):

- ``"packed"``: the plan's token-budget micro-batches, tokens packed (flat values + offsets);
- ``"whole"``: the whole shard as one packed pass (fine on a big GPU, an OOM on a small one);
- ``"padded"``: the plan's micro-batches, each padded to a (n, longest response) tensor, as many
  trainers do — the padding is computed and then thrown away.

Whichever it picks, it hands its outputs to a `ResultBuilder` and returns the `WorkerResult`
the builder makes: the same sample ids, the same per-token "logprobs" column, the same
per-sample "seq_logprob", the same data metrics. Only the per-rank metrics (how many forward
passes the rank ran, how many tokens its biggest pass held) tell the strategies apart, which
is what per-rank metrics are for.

The "model" is a toy: a token's log-prob is ``-(1 + token % 16) / 8``. It depends on the token
alone, so batching cannot change it, and it is a multiple of 1/8, so every sum is exact in
float64 in any order — the demo can compare results with ``==``, not ``allclose``. The "GPU
time" of a pass is a sleep proportional to the tokens it holds (padding included), so the
timeline shows real bubbles, and sleeping workers share two CPU cores without slowing down.

This lives in an importable module, not in the demo's ``__main__``, because Ray pickles a
class by reference (module + name): each worker process must be able to import it.
"""

from __future__ import annotations

import time

import torch

from avrid.dispatch import Batch, Packed, Shard
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import Worker

STRATEGIES: dict[str, str] = {
    "packed": "the plan's micro-batches, packed",
    "whole": "the whole shard as one packed pass",
    "padded": "the plan's micro-batches, padded to the longest response",
}
"""Local strategies `ActorWorker.log_probs` accepts, with a one-line description."""

PAD = 0
"""Token id written into padding positions (any id: padded outputs are dropped)."""


def toy_token_logprobs(tokens: torch.Tensor) -> torch.Tensor:
    """float64 "log-prob" of each token, element by element: ``-(1 + token % 16) / 8``."""
    return -(1.0 + (tokens % 16).to(torch.float64)) / 8.0


def response_tokens(batch: Batch) -> Packed:
    """The response part of every row of ``batch.packed["tokens"]``, still packed: row i holds
    the last ``response_lens[i]`` tokens of sequence i."""
    tokens = batch.packed["tokens"]
    row = torch.repeat_interleave(torch.arange(len(batch)), tokens.lengths)
    pos_in_row = torch.arange(len(tokens.values)) - tokens.offsets[:-1][row]
    offsets = torch.zeros(len(batch) + 1, dtype=torch.int64)
    torch.cumsum(batch.response_lens, 0, out=offsets[1:])
    return Packed(values=tokens.values[pos_in_row >= batch.prompt_lens[row]], offsets=offsets)


def expected_log_probs(batch: Batch) -> Packed:
    """What the workers should return for ``batch``, computed in one go on the driver."""
    resp = response_tokens(batch)
    return Packed(values=toy_token_logprobs(resp.values), offsets=resp.offsets)


class ActorWorker(Worker):
    """A pretend actor: per-token log-probs of its shard as a canonical `WorkerResult`."""

    def log_probs(self, shard: Shard, strategy: str = "packed", *,
                  seconds_per_token: float = 0.0) -> WorkerResult:
        """Walk `shard` the `strategy` way and return the canonical result.

        Outputs: packed "logprobs" (one per response token) and per-sample "seq_logprob".
        Data metrics: "logprob_mean" (per token), "response_len_mean" (per sample),
        "response_tokens" (sum), "longest_response" (max). Per-rank metrics:
        "forward_passes" (sum), "peak_pass_tokens" (max; padding included). One "forward"
        span per pass, each sleeping `seconds_per_token` per token it holds.
        """
        dp = self.identity.coords["dp"]
        if shard.index != dp:  # the dispatcher routes by DP coordinate; check it did
            raise ValueError(f"{self.identity.name} (dp={dp}) received shard {shard.index}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
        builder = ResultBuilder.for_shard(self.identity, shard)
        passes = [shard.batch] if strategy == "whole" else shard.micro_batches()
        for mb in passes:
            if len(mb) == 0:  # an empty micro-batch (same_micro_count) has nothing to add
                continue
            with builder.span("forward"):
                if strategy == "padded":
                    _padded_pass(builder, mb, seconds_per_token)
                else:
                    _packed_pass(builder, mb, seconds_per_token)
        return builder.build()


def _packed_pass(builder: ResultBuilder, mb: Batch, seconds_per_token: float) -> None:
    """One forward pass over packed tokens: no padding is made, none is computed."""
    resp = response_tokens(mb)
    lp = toy_token_logprobs(resp.values)
    _pretend_compute(int(mb.total_lens.sum()), seconds_per_token)
    row = torch.repeat_interleave(torch.arange(len(mb)), resp.lengths)
    seq = torch.zeros(len(mb), dtype=torch.float64).index_add_(0, row, lp)
    builder.add(mb.sample_ids, packed={"logprobs": Packed(values=lp, offsets=resp.offsets)},
                scalars={"seq_logprob": seq})
    _record_metrics(builder, lp, resp.lengths, int(mb.total_lens.sum()))


def _padded_pass(builder: ResultBuilder, mb: Batch, seconds_per_token: float) -> None:
    """One forward pass over a right-padded (n, longest) tensor: every row pays for the
    longest one, and the padding's outputs must be masked out before anything is reduced."""
    resp = response_tokens(mb)
    lengths = resp.lengths
    mask = torch.arange(int(lengths.max())) < lengths[:, None]
    padded = torch.full(mask.shape, PAD, dtype=resp.values.dtype)
    padded[mask] = resp.values  # row-major fill: row i gets its first lengths[i] slots
    lp = toy_token_logprobs(padded)  # (n, longest): garbage in the padding slots
    work = len(mb) * int(mb.total_lens.max())
    _pretend_compute(work, seconds_per_token)
    seq = torch.where(mask, lp, 0.0).sum(dim=1)
    builder.add_padded(mb.sample_ids, lengths, padded={"logprobs": lp},
                       scalars={"seq_logprob": seq})
    _record_metrics(builder, lp[mask], lengths, work)


def _record_metrics(builder: ResultBuilder, token_lp: torch.Tensor, response_lens: torch.Tensor,
                    pass_tokens: int) -> None:
    """Per-token and per-sample values, never a pass's own mean: the builder keeps sums and
    weights, so the result cannot depend on how the shard was cut."""
    builder.metric("logprob_mean", token_lp, "mean_tokens")
    builder.metric("response_len_mean", response_lens, "mean_samples")
    builder.metric("response_tokens", response_lens, "sum")
    builder.metric("longest_response", response_lens, "max")
    # Facts about this rank, not about samples: merged over every rank, TP replicas included.
    builder.metric("forward_passes", 1.0, "sum", per_rank=True)
    builder.metric("peak_pass_tokens", float(pass_tokens), "max", per_rank=True)


def _pretend_compute(tokens: int, seconds_per_token: float) -> None:
    """Stand-in for a forward pass's GPU time: a sleep proportional to its tokens."""
    if seconds_per_token > 0:
        time.sleep(tokens * seconds_per_token)
