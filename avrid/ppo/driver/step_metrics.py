"""Chapter 5 — one step's metrics, from its calls and its scored batch.

`Trainer._metrics` reports what `step_metrics` computes: each call's merged metrics averaged
over the step's calls (mini-batches), the reward, the rollout/trainer log-prob gap, the KL to
the reference, dynamic sampling's counts, and the step's timing (`Phases.times`). Chapter 7
adds its own on top (`agents/trainer.py`).

Not here: logging them (`outputs/metrics.py`), or anything a worker computes (its metrics
arrive in the calls, already reduced exactly: chapter 3).
"""

from __future__ import annotations

from avrid.dispatch import Batch
from avrid.ppo.algo.losses import kl_estimate
from avrid.ppo.data.columns import action_mask, padded
from avrid.ppo.data.credit import shaping_metrics
from avrid.ppo.data.dynamic_sampling import FillStats
from avrid.ppo.setup.config import PPOConfig
from avrid.results import Merged, Phases


def step_metrics(batch: Batch, merged: list[Merged], phases: Phases, *, config: PPOConfig,
                 max_response: int, fill_stats: FillStats | None) -> dict[str, float]:
    """The metrics of a step that scored `batch` with the calls `merged`, timed by `phases`
    (`fill_stats`: dynamic sampling's, with ``algo.dynamic_sampling``)."""
    sums: dict[str, list[float]] = {}
    for m in merged:
        for k, v in m.metric_values().items():
            sums.setdefault(k, []).append(v)
    # Means over mini-batches, except counts of skipped (non-finite) optimizer steps.
    out = {k: sum(v) if k.endswith("/skipped_steps") else sum(v) / len(v)
           for k, v in sums.items()}
    mask = action_mask(batch).bool()  # observation tokens have no rollout_logp (chapter 7)
    gap = (padded(batch, "old_logp") - padded(batch, "rollout_logp")).abs()[mask]
    out["train/reward"] = float(batch.scalars["score"].mean())
    out.update(shaping_metrics(batch, config, max_response))
    if config.algo.dynamic_sampling:
        out.update(fill_stats.metrics())
    out["rollout/logprob_gap"] = float(gap.mean()) if gap.numel() else 0.0
    out["rollout/logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
    if "ref_logp" in batch.packed:
        kl = kl_estimate(padded(batch, "old_logp"), padded(batch, "ref_logp"), "k1")
        out["actor/ref_kl"] = float(kl[mask].mean())
    out.update(phases.times())
    out["perf/tokens_per_s"] = float(batch.total_lens.sum()) / out["time/step"]
    return out
