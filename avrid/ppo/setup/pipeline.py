"""Chapter 6 — the `pipeline` section of the config: when generation runs, and with which weights.

    sync          the chapter 5 loop: generate, then train, then sync; the rollout engine
                  lives in the policy's processes (the hybrid engine). The default.
    one_step_off  rollout workers in a pool of their own generate step k+1's batch while the
                  trainer trains on step k's; weights are pushed between the two pools after
                  every step. Every batch after the first is exactly one version old.
    async         the same two pools, with generation admitted as far ahead as the bound K
                  (`max_staleness`) allows: a batch generated with weight version v may train
                  at trainer version t only if t - v <= K. K = 0 is the synchronous algorithm.

The staleness of a batch is (trainer version when it trains) - (weight version it was
generated with); versions count the actor's updates. `correction` chooses how the loss
accounts for the gap between the rollout's policy and the trainer's (`algo/off_policy.py`).
Its default, "auto", is truncated importance sampling wherever a batch can be stale (K >= 1)
and no correction where none can (K = 0): measured on the default run, one-step-off without
a correction fell short of the synchronous reward on one seed of three, with TIS it reached
it on all three; and K = 0 stays exactly the synchronous algorithm. An explicit choice
applies in every mode (even sync has a small engine-vs-trainer gap).

Only this section's own ranges are checked here; the rules that tie it to other sections
(an in-process run has one rollout rank, ...) are in `validate.py`. The driver of the
asynchronous modes is the `avrid.pipeline` package, a layer above `avrid.ppo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from avrid.ppo.algo.off_policy import Correction
from avrid.ppo.setup.validate import finite, need, one_of

PipelineMode = Literal["sync", "one_step_off", "async"]
CorrectionChoice = Literal["auto", "none", "tis", "decoupled"]
"""`Correction`s, plus "auto": "tis" when K >= 1, "none" when K = 0."""
DEFAULT_STALENESS = {"sync": 0, "one_step_off": 1, "async": 2}
"""The bound K each mode has when `max_staleness` is left unset."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineConfig:
    """How generation and training overlap (chapter 6)."""

    mode: PipelineMode = "sync"
    """"sync" (generate, then train; hybrid engine), "one_step_off" (generate step k+1 while
    training step k) or "async" (generate up to `max_staleness` versions ahead)."""
    max_staleness: int | None = None
    """K: the largest (trainer version - sample version) a batch may train at. None = the
    mode's own: 0 for sync, 1 for one_step_off, 2 for async. sync allows only 0 and
    one_step_off only 1; async takes any K >= 0 (0 = synchronous)."""
    rollout_dp: int | None = None
    """Rollout workers (one engine each, own bundles) in one_step_off and async; None = as many
    as placement.actor_dp. With the same count, K = 0 reproduces the sync run exactly."""
    correction: CorrectionChoice = "auto"
    """Off-policy correction of the policy loss: "none", "tis" (truncated importance
    sampling, weight min(pi_old / pi_rollout, is_cap)), "decoupled" (decoupled PPO: weight
    pi_old / pi_rollout, tokens above is_cap dropped), or "auto": "tis" where batches can be
    stale (K >= 1), "none" where they cannot (K = 0). See `algo/off_policy.py`."""
    is_cap: float = 2.0
    """C: the cap on the importance weight pi_old / pi_rollout (>= 1)."""
    partial_rollouts: bool = True
    """async mode, multi-turn tasks (chapter 7): a weight push lands while a batch is being
    generated (the episodes take the new weights at their next engine call; each token keeps
    the version that made it). False: a push waits for the generation in flight, as in
    chapter 6. one_step_off and single-turn tasks always wait."""

    def __post_init__(self) -> None:
        finite("pipeline", self)
        one_of("pipeline.mode", self.mode, PipelineMode, "mode")
        one_of("pipeline.correction", self.correction, CorrectionChoice, "correction")
        k = self.max_staleness
        need(k is None or k >= 0, "pipeline.max_staleness", f"must be >= 0 or None, got {k}")
        need(self.mode != "sync" or k in (None, 0), "pipeline.max_staleness",
             f"mode 'sync' trains every batch with the weights that made it, so K is 0; got "
             f"{k} (use mode='async' for K > 0)")
        need(self.mode != "one_step_off" or k in (None, 1), "pipeline.max_staleness",
             f"mode 'one_step_off' is K = 1 by definition, got {k}; use mode='async' with "
             f"max_staleness={k} for another bound")
        need(self.rollout_dp is None or self.rollout_dp >= 1, "pipeline.rollout_dp",
             f"must be >= 1 or None, got {self.rollout_dp}")
        need(self.mode != "sync" or self.rollout_dp is None, "pipeline.rollout_dp",
             "mode 'sync' generates in the policy's own processes (the hybrid engine), so it "
             "has no rollout pool; set mode='one_step_off' or 'async', or drop rollout_dp")
        need(self.is_cap >= 1.0, "pipeline.is_cap", f"must be >= 1, got {self.is_cap}")

    @property
    def staleness_bound(self) -> int:
        """K, resolved: `max_staleness`, or the mode's default."""
        return DEFAULT_STALENESS[self.mode] if self.max_staleness is None else self.max_staleness

    @property
    def applied_correction(self) -> Correction:
        """The correction the loss applies: `correction`, with "auto" resolved by K."""
        if self.correction == "auto":
            return "tis" if self.staleness_bound > 0 else "none"
        return self.correction

    @property
    def disaggregated(self) -> bool:
        """Whether generation runs in a rollout pool of its own (every mode but sync)."""
        return self.mode != "sync"
