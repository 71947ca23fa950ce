"""Chapter 7 — dropping samples too old to train on (opt-in: `pipeline.drop_older_than`).

Chapter 6 bounds staleness where a batch is launched: it is generated only if it will train
within K versions, so nothing ever has to be dropped, and by default nothing is. With
partial rollouts the tokens of one batch differ in age (a push lands mid-generation), and a
sample's age is its oldest token's. `drop_older_than = D < K` asks for a tighter bound on
that age, applied when the step trains: older samples leave the batch.

Dropping is where length bias comes from: if long episodes were the old ones, training
would lean to short ones. So every step logs what it dropped overall and in the shorter and
the longer half of the batch (by response length, the halves `report.staleness_by_length`
uses). In avrid's pipeline all episodes of a batch start from the same weights and a push
only freshens the later tokens of the long ones, so the long half is dropped no more often.

Not here: when the step's prompts are generated again because nothing was left
(`pipelined.AgentPipelinedTrainer.learn`).
"""

from __future__ import annotations

import torch

from avrid.dispatch import Batch
from avrid.pipeline.report import length_halves


def drop_stale(batch: Batch, version: int,
               older_than: int | None) -> tuple[Batch, dict[str, float]]:
    """`batch` without its samples more than `older_than` versions behind `version` (the
    trainer's), and the ``pipeline/dropped_share*`` metrics of the step (all 0 with
    `older_than` None: nothing is dropped).

    A sample's age is `version` minus its "version" scalar, which chapter 7's rollout worker
    sets to its oldest policy token's version.

    Example:
        >>> b = Batch.from_rows(sample_ids=[0, 1, 2, 3], prompt_lens=[1] * 4,
        ...     response_lens=[1, 2, 3, 4],
        ...     packed={"tokens": [torch.zeros(n + 1, dtype=torch.long) for n in (1, 2, 3, 4)]},
        ...     scalars={"version": torch.tensor([3, 2, 3, 1])})
        >>> kept, m = drop_stale(b, 3, 1)
        >>> kept.sample_ids.tolist(), m["pipeline/dropped_share"]
        ([0, 1, 2], 0.25)
        >>> m["pipeline/dropped_share_short"], m["pipeline/dropped_share_long"]
        (0.0, 0.5)
    """
    age = version - batch.scalars["version"]
    bound = older_than if older_than is not None else float("inf")
    dropped = age > bound
    out = {"pipeline/dropped_share": float(dropped.double().mean()) if len(batch) else 0.0}
    for name, rows in length_halves(batch).items():
        part = dropped[rows].double()
        out[f"pipeline/dropped_share_{name}"] = float(part.mean()) if len(part) else 0.0
    if not bool(dropped.any()):
        return batch, out
    return batch.take(torch.nonzero(~dropped).flatten()), out
