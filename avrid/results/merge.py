"""Chapter 3 — the driver-side merge: canonical results back into one batch, checked.

`merge(plan, results)` takes every worker's `WorkerResult` for one dispatched batch and returns
a `Merged`: the outputs in the batch's original order, the metrics reduced exactly, and the
results themselves (their spans feed the timeline). Before anything is combined it checks:

- every result has this avrid's format version;
- each shard has exactly one collect result (one per DP coordinate);
- each collect result covers exactly the samples its shard was sent — a missing, duplicated or
  unknown sample id is an error naming the ids and the worker;
- all collect results carry the same columns with the same dtype and per-sample shape;
- every per-token (packed) output row is as long as its sample's response (log-probs,
  values of the response tokens) or as its whole sequence (prompt + response), the same kind
  for every sample of a column, so a row one token too long cannot shift the tokens of the
  loss. A batch sent without responses (every response_lens 0: a generation call) gets back
  new tokens of any length, so its rows are not checked. The check is a few vectorised
  comparisons per column: merge runs on every call of every step.

Data metrics come from collect ranks only (a tensor-parallel replica saw the same samples);
per-rank metrics (memory, a worker's own time) come from every rank. This file does not send
anything to workers (`run.py`) and does not draw (`timeline.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from avrid.dispatch import Batch, DispatchPlan
from avrid.results.result import RESULT_VERSION, Metric, Span, WorkerResult, merge_metrics


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Merged:
    """One dispatched batch's outputs, metrics and provenance, merged."""

    batch: Batch
    """Outputs in the original order of the dispatched batch."""
    metrics: Mapping[str, Metric]
    """Exactly reduced metrics by name; `.value` gives the number."""
    results: tuple[WorkerResult, ...]
    """Every worker's result (collect or not), for spans and provenance."""
    driver_spans: tuple[Span, ...] = ()
    """What the driver spent its time on (filled by `run.py`)."""

    def metric_values(self) -> dict[str, float]:
        """Metric name -> reduced value."""
        return {name: m.value for name, m in self.metrics.items()}


def merge(plan: DispatchPlan, results: Sequence[WorkerResult], *,
          data_axis: str | None = None) -> Merged:
    """Check and combine the results of one dispatch made with `plan` (see module doc)."""
    for r in results:
        if r.version != RESULT_VERSION:
            raise ValueError(f"{r.identity.name} returned result format v{r.version}; this "
                             f"avrid reads v{RESULT_VERSION}")
    by_shard = _collect_results_by_shard(plan, results, data_axis)
    parts = [_checked_part(plan, s, by_shard[s]) for s in range(plan.num_shards)]
    _check_columns_agree(parts)
    for part in parts:
        _check_token_rows(part)
    template = next((p.outputs for p in parts if len(p.sample_ids)), None)
    outputs = [p.outputs if len(p.sample_ids) or template is None else template.take([])
               for p in parts]  # an empty shard's output gets the others' columns
    metrics = merge_metrics([m for r in results for m in r.metrics
                             if m.per_rank or r.is_collect])
    return Merged(batch=plan.restore(outputs), metrics=metrics,  # type: ignore[arg-type]
                  results=tuple(results))


def _collect_results_by_shard(plan: DispatchPlan, results: Sequence[WorkerResult],
                              data_axis: str | None) -> dict[int, WorkerResult]:
    by_shard: dict[int, WorkerResult] = {}
    for r in results:
        if not r.is_collect:
            continue
        coords = r.identity.coords
        axis = next(iter(coords), None) if data_axis is None else data_axis
        shard = coords.get(axis, r.identity.rank) if axis is not None else r.identity.rank
        if not 0 <= shard < plan.num_shards:
            raise ValueError(f"{r.identity.name} sits at {axis}={shard} but the plan has "
                             f"{plan.num_shards} shards")
        if shard in by_shard:
            raise ValueError(f"shard {shard} has two collect results, from "
                             f"{by_shard[shard].identity.name} and {r.identity.name}")
        by_shard[shard] = r
    missing = [s for s in range(plan.num_shards) if s not in by_shard]
    if missing:
        raise ValueError(f"no collect result for shards {missing}; every shard needs exactly "
                         f"one (its worker with coordinate 0 on every non-data axis)")
    return by_shard


def _checked_part(plan: DispatchPlan, shard: int, result: WorkerResult) -> WorkerResult:
    sent = [plan.sample_ids[p] for p in plan.shard_positions(shard)]
    assert result.outputs is not None  # collect results carry outputs
    got = result.outputs.sample_ids.tolist()
    if got == sent:  # the usual case: exactly the samples sent, in the order sent
        return result
    who = result.identity.name
    # Ids are unique inside one result (a Batch refuses repeats), so a duplicate is an id that
    # also belongs to another shard: its own collect worker returns it as well.
    unknown = sorted(set(got) - set(plan.sample_ids))
    duplicated = sorted(set(got) - set(sent) - set(unknown))
    missing = sorted(set(sent) - set(got))
    if duplicated or unknown or missing:
        problems = [f"{label} {ids_}" for label, ids_ in (
            ("missing sample ids", missing),
            ("duplicated sample ids (sent to another shard)", duplicated),
            ("unknown sample ids", unknown)) if ids_]
        raise ValueError(f"{who} (shard {shard}) returned a bad result: " + "; ".join(problems))
    # The right samples in another order: put them back in the order sent.
    return WorkerResult(version=result.version, identity=result.identity,
                        sample_ids=result.sample_ids, outputs=result.outputs.select(sent),
                        metrics=result.metrics, spans=result.spans)


def _check_columns_agree(parts: Sequence[WorkerResult]) -> None:
    """Same column names, dtypes and per-sample trailing shapes on every non-empty shard."""
    shaped = [p for p in parts if p.outputs is not None and len(p.sample_ids)]
    if not shaped:
        return
    first = shaped[0]
    want = _signature(first.outputs)  # type: ignore[arg-type]
    for p in shaped[1:]:
        have = _signature(p.outputs)  # type: ignore[arg-type]
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))
            raise ValueError(f"{p.identity.name} returned columns that disagree with "
                             f"{first.identity.name}'s: {diff}")


def _check_token_rows(part: WorkerResult) -> None:
    """Each packed column's rows are all response-long or all sequence-long (module doc)."""
    out = part.outputs
    if out is None or not bool(out.response_lens.any()):
        return  # empty, or prompts only (a generation call): rows are new tokens
    response, sequence = out.response_lens, out.total_lens
    for name, col in out.packed.items():
        lengths = col.lengths
        if torch.equal(lengths, response) or torch.equal(lengths, sequence):
            continue
        # Name a sample that breaks the column's majority kind (prompt_lens >= 1, so a row
        # is never both response-long and sequence-long).
        kind = (response if int((lengths == response).sum()) >= int((lengths == sequence).sum())
                else sequence)
        bad = (lengths != kind).nonzero().flatten()
        i = int(bad[0])
        raise ValueError(
            f"{part.identity.name} returned column {name!r} with {int(lengths[i])} values "
            f"for sample {int(out.sample_ids[i])}, whose response has {int(response[i])} "
            f"tokens (prompt + response: {int(sequence[i])}); a per-token column holds one "
            f"value per response token or per sequence token, the same for every sample "
            f"({len(bad)} such samples)")


def _signature(batch: Batch) -> dict[str, tuple[str, tuple[int, ...]]]:
    sig = {f"packed:{k}": (str(v.values.dtype), tuple(v.values.shape[1:]))
           for k, v in batch.packed.items()}
    sig.update({f"scalar:{k}": (str(v.dtype), tuple(v.shape[1:]))
                for k, v in batch.scalars.items()})
    return sig
