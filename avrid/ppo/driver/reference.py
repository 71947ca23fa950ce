"""Chapter 5 — where a step's reference log-probs are computed: the policy's ranks or a pool.

The phase "ref_logp" is one call, sent where `placement.reference` says:

    "policy"  `PolicyWorker.compute_logprobs(reference=True)` on the policy's ranks (the
              frozen copy beside the actor, or with LoRA the actor with its adapters off),
              in the policy group's order: after "old_logp", never beside it;
    "pool"    `ReferenceWorker.compute_logprobs` on the reference pool's ranks
              (`roles/reference.py`), which `train.concurrent_phases` runs beside
              "old_logp" (`step_graph.py` puts the phase on the "reference" group).

Both the serial `Trainer.learn` and the concurrent controller (`concurrent.py`) call
`reference_logprobs`, so the two cannot send it to different places. Not here: what the
reference computes (the workers), where its ranks are (`placement.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from avrid.dispatch import Batch
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.roles.reference import ReferenceWorker
from avrid.results import Merged, run_shards

if TYPE_CHECKING:
    from avrid.ppo.driver.trainer import Trainer


def reference_logprobs(trainer: Trainer, batch: Batch) -> Merged:
    """The "ref_logp" column of `batch` (which holds `policy.LOGPROBS_READS`), computed on
    the ranks `trainer.config.placement.reference` names."""
    if trainer.config.placement.reference == "pool":
        group = trainer.cluster.group("reference", ReferenceWorker)
        return run_shards(group, ReferenceWorker.compute_logprobs, batch, trainer.dispatch)
    return run_shards(trainer.policy, PolicyWorker.compute_logprobs, batch, trainer.dispatch,
                      reference=True)
