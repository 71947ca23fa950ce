"""Chapter 2 — the dispatch plan: which sample goes to which shard and micro-batch, and back.

`make_plan(batch, num_shards, config)` costs every sequence, partitions the costs over the
data-parallel shards (`partition.py`), cuts each shard into token-budget micro-batches
(`microbatch.py`) and records the result as a frozen `DispatchPlan`: a value you can print,
compare and test without Ray. The plan is a permutation: `order` lists the samples in dispatch
order (shard by shard, micro-batch by micro-batch), and `inverse` puts outputs back.

    shards = plan.split(batch)          # one `Shard` per DP rank, micro-batches contiguous
    outputs = [work(s) for s in shards] # any per-sample outputs, as a Batch per shard
    merged = plan.restore(outputs)      # original order, ids checked

Unlike verl, there is no divisibility rule (any batch over any number of shards; a shard may
be empty) and the batch is never permanently reordered. Sending shards to workers is
`send.py`'s job; merging rich per-worker results is chapter 3's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain

import numpy as np
import torch

from avrid.dispatch.batch import Batch
from avrid.dispatch.cost import CostModel, TokenCost, check_costs
from avrid.dispatch.microbatch import Oversize, micro_batches
from avrid.dispatch.partition import METHODS, partition


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchConfig:
    """How to split a batch over data-parallel shards. Validated when made."""

    method: str = "kk"
    """Partitioner: "kk" (Karmarkar–Karp), "lpt" (greedy longest-first), "contiguous"."""
    cost: CostModel = field(default_factory=TokenCost)
    """What a sequence costs a worker: tokens, FLOPs (`FlopCost`), or your own function."""
    equal_count: bool = False
    """Give every shard the same number of samples (±1), e.g. for per-sample loss scaling."""
    micro_batch_tokens: int | None = None
    """Token budget of one micro-batch; None means the whole shard is one micro-batch."""
    same_micro_count: bool = False
    """Give every shard the same number of micro-batches (FSDP collectives must line up)."""
    oversize: Oversize = "own"
    """A sequence over the budget: its own micro-batch ("own") or an error ("error")."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 or None, "
                             f"got {self.micro_batch_tokens}")
        if self.oversize not in ("own", "error"):
            raise ValueError(f"oversize must be 'own' or 'error', got {self.oversize!r}")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Shard:
    """What one data-parallel rank receives: its samples and where its micro-batches start."""

    index: int
    """Which shard this is (the DP coordinate it goes to)."""
    batch: Batch
    """The shard's samples, ordered micro-batch by micro-batch."""
    micro_bounds: tuple[int, ...]
    """Micro-batch i is ``batch.slice(micro_bounds[i], micro_bounds[i + 1])``."""

    def micro_batches(self) -> list[Batch]:
        """The micro-batches as zero-copy slices (some may be empty; see `same_micro_count`)."""
        b = self.micro_bounds
        return [self.batch.slice(b[i], b[i + 1]) for i in range(len(b) - 1)]


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchPlan:
    """Sample -> (shard, micro-batch), and the way back. Build it with `make_plan`."""

    sample_ids: tuple[int, ...]
    """Ids of the planned batch, in its original order."""
    order: tuple[int, ...]
    """Original positions in dispatch order: shard 0's micro-batch 0 first."""
    shard_bounds: tuple[int, ...]
    """Shard s holds ``order[shard_bounds[s]:shard_bounds[s + 1]]``."""
    micro_bounds: tuple[tuple[int, ...], ...]
    """Per shard, micro-batch boundaries relative to the shard's start."""
    shard_costs: tuple[float, ...]
    """Total cost of each shard under the plan's cost model."""
    lower_bound: float
    """No partition can have a max shard cost below max(total / k, largest sample)."""
    method: str

    @property
    def num_shards(self) -> int:
        """Number of data-parallel shards."""
        return len(self.shard_bounds) - 1

    @property
    def imbalance(self) -> float:
        """Max shard cost over the lower bound (1.0 is perfect)."""
        return max(self.shard_costs) / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def inverse(self) -> tuple[int, ...]:
        """Dispatch-order index of each original position: ``order[inverse[p]] == p``."""
        return tuple(np.argsort(np.asarray(self.order, dtype=np.int64)).tolist())

    def shard_positions(self, shard: int) -> tuple[int, ...]:
        """Original positions of the samples of `shard`, in dispatch order."""
        return self.order[self.shard_bounds[shard]:self.shard_bounds[shard + 1]]

    def locate(self, sample_id: int) -> tuple[int, int]:
        """(shard, micro-batch) of a sample."""
        where = self.order.index(self.sample_ids.index(sample_id))
        shard = int(np.searchsorted(self.shard_bounds, where, side="right")) - 1
        rel = where - self.shard_bounds[shard]
        micro = int(np.searchsorted(self.micro_bounds[shard], rel, side="right")) - 1
        return shard, micro

    def split(self, batch: Batch) -> list[Shard]:
        """One `Shard` per DP rank; `batch` must be the batch the plan was made for."""
        if tuple(batch.sample_ids.tolist()) != self.sample_ids:
            raise ValueError("this plan was made for another batch (its sample ids differ); "
                             "make a plan for this batch first")
        order = torch.tensor(self.order, dtype=torch.int64)
        bounds = self.shard_bounds
        return [Shard(index=s, batch=batch.take(order[bounds[s]:bounds[s + 1]]),
                      micro_bounds=self.micro_bounds[s]) for s in range(self.num_shards)]

    def restore(self, parts: Sequence[Batch]) -> Batch:
        """Per-shard outputs (one Batch per shard, rows in the shard's order) back in the
        original order. Missing, extra or moved samples are an error naming the shard."""
        if len(parts) != self.num_shards:
            raise ValueError(f"restore needs one batch per shard ({self.num_shards}), "
                             f"got {len(parts)}")
        for s, part in enumerate(parts):
            want = [self.sample_ids[p] for p in self.shard_positions(s)]
            if part.sample_ids.tolist() != want:
                got = part.sample_ids.tolist()
                raise ValueError(f"shard {s} returned sample ids {got[:8]}{'...' * (len(got) > 8)}"
                                 f" but was sent {want[:8]}{'...' * (len(want) > 8)}")
        return Batch.concat(parts).take(list(self.inverse))

    def describe(self) -> str:
        """A table: one line per shard with its samples, cost and micro-batches."""
        lines = [f"{self.method}: {len(self.sample_ids)} samples over {self.num_shards} shards, "
                 f"max cost / lower bound = {self.imbalance:.4f}"]
        for s in range(self.num_shards):
            n = self.shard_bounds[s + 1] - self.shard_bounds[s]
            micro = np.diff(self.micro_bounds[s]).tolist()
            lines.append(f"  shard {s:>3}: {n:>5} samples  cost {self.shard_costs[s]:>12.0f}  "
                         f"micro-batch sizes {micro}")
        return "\n".join(lines)


def make_plan(batch: Batch, num_shards: int,
              config: DispatchConfig | None = None) -> DispatchPlan:
    """Plan how to spread `batch` over `num_shards` data-parallel shards (see module doc)."""
    config = config or DispatchConfig()
    if len(batch) == 0:
        raise ValueError("an empty batch: there is nothing to dispatch")
    prompt = batch.prompt_lens.numpy()
    response = batch.response_lens.numpy()
    # Checked here, where the sample ids are known, so a bad user cost names its sample.
    costs = check_costs(config.cost(prompt, response), sample_ids=batch.sample_ids.numpy())
    part = partition(costs, num_shards, method=config.method, equal_count=config.equal_count)
    groups = _micro_groups(prompt + response, part.shards, config)
    order: list[int] = []
    shard_bounds, micro_bounds = [0], []
    for shard, micro in zip(part.shards, groups, strict=True):
        if len(micro) == 1:  # the usual case: one micro-batch, the whole shard in order
            order += shard
            micro_bounds.append((0, len(shard)))
        else:
            bounds = [0]
            for group in micro:
                order += [shard[i] for i in group]
                bounds.append(bounds[-1] + len(group))
            micro_bounds.append(tuple(bounds))
        shard_bounds.append(len(order))
    return DispatchPlan(sample_ids=tuple(batch.sample_ids.tolist()), order=tuple(order),
                        shard_bounds=tuple(shard_bounds), micro_bounds=tuple(micro_bounds),
                        shard_costs=tuple(part.costs), lower_bound=part.lower_bound,
                        method=config.method)


def _micro_groups(tokens: np.ndarray, shards: tuple[tuple[int, ...], ...],
                  config: DispatchConfig) -> list[list[list[int]]]:
    """Per shard, its micro-batches as lists of positions within the shard."""
    budget = config.micro_batch_tokens
    if budget is None:
        return [[list(range(len(shard)))] for shard in shards]
    # Every shard's token counts from one gather, then sliced (views): one conversion of
    # positions to an index array in all, not one per shard (and fromiter beats a list).
    gathered = tokens[np.fromiter(chain.from_iterable(shards), np.intp, len(tokens))]
    ends = accumulate(len(shard) for shard in shards)
    per_shard = [gathered[end - len(shard):end] for shard, end in zip(shards, ends, strict=True)]
    groups = [micro_batches(t, budget, oversize=config.oversize) for t in per_shard]
    if config.same_micro_count:
        most = max(len(g) for g in groups)  # only shards with fewer are cut again
        groups = [g if len(g) == most
                  else micro_batches(t, budget, num_micro=most, oversize=config.oversize)
                  for g, t in zip(groups, per_shard, strict=True)]
    return groups
