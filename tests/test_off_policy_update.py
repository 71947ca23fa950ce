"""Chapter 6 — the off-policy correction applied where it trains: `PolicyWorker.update`.

`test_off_policy.py` pins `importance_weights` as a function; this file pins that the actor's
update multiplies each token's clipped loss by it. The real worker updates on a batch whose
behaviour (rollout) log-probs differ from its proximal ones (`old_logp`): pi_old / pi_rollout
is 0.5 to 4 across the tokens, three of them above the cap of 2. The loss the update reports
and the gradient it would step with must equal the corrected objective written out token by
token (`test_role_formulas.reference_actor_loss`: no avrid function in between):

    none        w = 1                     (the rollout log-probs are not even read)
    tis         w = min(rho, C)
    decoupled   w = rho if rho <= C else 0

Deleting the line that applies the weights (`per_token = per_token * iw.weights`), swapping
its arguments or ignoring the cap fails here; before this file, the suite stayed green.
"""

from __future__ import annotations

import pytest

from avrid.ppo.algo.off_policy import CORRECTIONS
from tests.test_role_formulas import actor_update, assert_same, config

pytestmark = pytest.mark.chapter(6)


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_the_update_applies_the_correction_it_is_configured_with(correction: str) -> None:
    # The KL and entropy terms on too: the weight multiplies the clipped term only.
    cfg = config(f"pipeline.correction={correction}", "pipeline.is_cap=2.0",
                 "algo.kl_coef=0.5", "algo.kl_in=loss", "algo.entropy_coef=0.2")
    assert cfg.pipeline.applied_correction == correction
    assert_same(*actor_update(cfg, correction))


def test_auto_applies_tis_exactly_when_batches_can_be_stale() -> None:
    # "auto" (the default) resolves by K: tis for async K = 2, none for sync.
    stale = config("pipeline.mode=async", "pipeline.rollout_dp=1")
    assert stale.pipeline.applied_correction == "tis"
    assert_same(*actor_update(stale, "tis"))
    assert config().pipeline.applied_correction == "none"


def test_the_three_corrections_give_three_different_updates() -> None:
    # Not vacuous: on this batch the weights move the loss well beyond the tolerance.
    losses = [actor_update(config(f"pipeline.correction={c}"), c)[0] for c in CORRECTIONS]
    assert min(abs(a - b) for i, a in enumerate(losses) for b in losses[i + 1:]) > 1e-2
