"""Chapter 6 — what a pipelined step reports, beyond chapter 5's metrics.

`PipelinedTrainer` (driver.py) hands these functions what it saw during a step and gets back
its ``pipeline/`` metrics, the push metrics and the step's timeline:

    staleness        how many versions old the step's samples were (max, mean); with
                     per-token versions (chapter 7) also per token, and by trajectory length
    off_policy       the importance weights pi_old / pi_rollout of the batch
                     (`algo/off_policy.py`), even when no correction applies them
    pushes           the bytes each rollout rank received in this step's pushes, and their
                     times (the whole push, and the trainer ranks' own share of it)
    step_overlap     the share of the step in which generation and training ran at once
    step_timeline    every worker's spans of the step, the pushes' included

Pure functions of what they are given: no workers, no driver state.

Not here: deciding when to push or generate (driver.py), the interval arithmetic of the
overlap (overlap.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from avrid.dispatch import Batch
from avrid.pipeline.overlap import overlap_fraction
from avrid.ppo.algo.off_policy import importance_weights, weight_stats
from avrid.ppo.data.columns import action_mask, padded
from avrid.ppo.setup.config import PipelineConfig
from avrid.reshard import TransferPlan
from avrid.results import (
    HANDLING_SPANS,
    RESULT_VERSION,
    Merged,
    Phases,
    Span,
    Timeline,
    WorkerResult,
)
from avrid.workers import WorkerIdentity


def staleness(batch: Batch, version: int) -> dict[str, float]:
    """Trainer version `version` minus each sample's "version" stamp: max and mean; with a
    per-token "token_version" column (chapter 7's episodes), the same over action tokens
    (`pipeline/staleness_token_*`: a token is as old as the weights that generated it), and
    the share of samples whose tokens span versions (`pipeline/spanning_share`)."""
    stale = (version - batch.scalars["version"]).double()
    out = {"pipeline/staleness_max": float(stale.max()) if len(stale) else 0.0,
           "pipeline/staleness_mean": float(stale.mean()) if len(stale) else 0.0}
    if "token_version" in batch.packed:
        mask = action_mask(batch).bool()
        tokens = (version - padded(batch, "token_version")[mask]).double()
        out["pipeline/staleness_token_max"] = float(tokens.max()) if tokens.numel() else 0.0
        out["pipeline/staleness_token_mean"] = float(tokens.mean()) if tokens.numel() else 0.0
        # Samples whose tokens span versions: a push landed while they were generated.
        versions = padded(batch, "token_version")
        newest = versions.masked_fill(~mask, -torch.inf).max(dim=1).values
        oldest = versions.masked_fill(~mask, torch.inf).min(dim=1).values
        spanning = (newest > oldest).double()
        out["pipeline/spanning_share"] = float(spanning.mean()) if len(spanning) else 0.0
        out.update(staleness_by_length(batch, versions, mask, version))
    return out


def staleness_by_length(batch: Batch, versions: torch.Tensor, mask: torch.Tensor,
                        version: int) -> dict[str, float]:
    """Mean token staleness of the shorter and the longer half of the batch's samples (by
    response length; the middle sample of an odd batch counts in both).

    A batch's episodes all start from the weights it was launched with; a push that lands
    mid-generation (chapter 7's partial rollouts) reaches only the later tokens of the long
    ones, so they come out fresher on average. Nothing is dropped for age (a batch is
    bounded by K at admission and trained whole), so no length is under-represented by a
    drop; these two show how age differs with length.

    Example:
        >>> b = Batch.from_rows(sample_ids=[0, 1], prompt_lens=[1, 1], response_lens=[1, 2],
        ...     packed={"tokens": [torch.tensor([5, 6]), torch.tensor([5, 6, 7])],
        ...             "token_version": [torch.tensor([1]), torch.tensor([1, 2])]})
        >>> m = action_mask(b).bool()  # the long one took version 2 after its first token
        >>> staleness_by_length(b, padded(b, "token_version"), m, 2)
        {'pipeline/staleness_token_mean_short': 1.0, 'pipeline/staleness_token_mean_long': 0.5}
    """
    order = torch.argsort(batch.response_lens, stable=True)
    halves = {"short": order[:(len(order) + 1) // 2], "long": order[len(order) // 2:]}
    out = {}
    for name, rows in halves.items():
        ages = (version - versions[rows])[mask[rows]].double()
        out[f"pipeline/staleness_token_mean_{name}"] = float(ages.mean()) if ages.numel() \
            else 0.0
    return out


def off_policy(batch: Batch, config: PipelineConfig) -> dict[str, float]:
    """The importance weights' statistics (`weight_stats`) of a scored batch, over its action
    tokens (`columns.action_mask`): an observation token of a multi-turn response (chapter 7)
    has no behaviour log-prob (its rollout_logp is 0), so no ratio."""
    mask = action_mask(batch)
    # With no correction the weights are 1, but the ratios still say how off-policy the
    # batch is: report them (and how many exceed the cap) as truncated IS would see them.
    correction = config.applied_correction
    shown = "tis" if correction == "none" else correction
    iw = importance_weights(padded(batch, "old_logp"), padded(batch, "rollout_logp"), mask,
                            correction=shown, cap=config.is_cap)
    return {f"pipeline/{k}": v for k, v in weight_stats(iw, mask).items()}


def pushes(spans: Sequence[Span], trainer_seconds: Sequence[float],
           plan: TransferPlan) -> dict[str, float]:
    """The push metrics of a step: `trainer_seconds` has one entry per push checked in it
    (what it cost the trainer ranks), `spans` their spans as the workers saw them (a
    resumed step has the entries of the pushes before the checkpoint, not their spans)."""
    per_rank = max(plan.bytes_to(r) for r in range(plan.target_world))
    # Every step reports the same keys: 0 when no push fell in this step.
    return {"sync/bytes_per_rank": float(per_rank) if trainer_seconds else 0.0,
            "time/weight_push": sum(s.end - s.start for s in spans if s.name == "weight_push"),
            "time/push_trainer": sum(trainer_seconds)}


def step_overlap(phases: Phases, collected: Sequence[Merged],
                 in_flight_since: float | None) -> float:
    """The share of this step in which rollout ranks generated (the generations `collected`
    during it, and one still in flight since `in_flight_since`, counted until now) while
    trainer ranks computed."""
    now = time.time()
    gen = [(s.start, s.end) for m in collected for r in m.results for s in r.spans
           if s.name not in HANDLING_SPANS]
    if in_flight_since is not None:
        gen.append((in_flight_since, now))
    train = [(s.start, s.end) for m in phases.merged for r in m.results for s in r.spans
             if s.name not in HANDLING_SPANS]
    return overlap_fraction(gen, train, (phases.start, now))


def step_timeline(phases: Phases, collected: Sequence[Merged], push_spans: Sequence[Span],
                  push_ranks: Sequence[WorkerResult]) -> Timeline:
    """The step's timeline: its calls, the generations collected during it, and its pushes
    (the driver's spans and each rank's side, `push_result`)."""
    results = [r for m in [*phases.merged, *collected] for r in m.results]
    results += push_ranks
    driver = [*phases.driver_spans(), *push_spans,
              *(s for m in collected for s in m.driver_spans)]
    return phases.with_driver_lanes(Timeline.from_results(results, driver_spans=driver))


def push_result(identity: WorkerIdentity, start: float, end: float) -> WorkerResult:
    """One rank's side of a push, timed by that rank, as a result for the timeline."""
    return WorkerResult(version=RESULT_VERSION, identity=identity,
                        sample_ids=torch.zeros(0, dtype=torch.int64), outputs=None,
                        spans=(Span(name="weight_push", start=start, end=end),))
