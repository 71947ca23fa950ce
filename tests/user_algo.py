"""A user's own advantage estimators and policy losses, loaded by name in the tests
(``algo.name=tests.user_algo:sign_advantage``, ``algo.policy_loss=tests.user_algo:reinforce``).

What a researcher would write in their own module: plain functions taking one
`AdvantageInputs` (or `PolicyLossInputs`), nothing registered, nothing in avrid changed. Two
of them are valid and count their calls (`CALLS`), so a test can see that a run used them;
the others are each wrong in one way the registry must catch: a wrong signature, a wrong
shape or dtype, non-finite values, an exception of its own. Not a place for avrid's own
estimators (`avrid/ppo/algo/`).
"""

from __future__ import annotations

import torch

from avrid.ppo.algo.losses import PolicyLossOut
from avrid.ppo.algo.registry import AdvantageInputs, PolicyLossInputs

CALLS: dict[str, int] = {"sign_advantage": 0, "reinforce": 0}
"""How often each valid function has been called in this process (the in-process backend
runs the driver and the workers here)."""
LAST: dict[str, object] = {}
"""The last `AdvantageInputs` that `sign_advantage` was given (under "inputs")."""


def sign_advantage(x: AdvantageInputs) -> torch.Tensor:
    """Each score minus the batch's mean score, on every valid token: REINFORCE with one
    batch-wide baseline (no groups, no std)."""
    CALLS["sign_advantage"] += 1
    LAST["inputs"] = x
    centred = x.scores.float() - x.scores.float().mean()
    return centred.unsqueeze(1) * x.mask.float()


def reinforce(x: PolicyLossInputs) -> PolicyLossOut:
    """Plain REINFORCE, -A_t * logp_t per token: no ratio, no clip."""
    CALLS["reinforce"] += 1
    m = x.mask.bool()
    per_token = torch.where(m, -x.advantages.detach() * x.logp, 0.0)
    none = torch.zeros_like(m)
    return PolicyLossOut(per_token=per_token, clipped=none, dual_clipped=none)


def wrong_signature(x: AdvantageInputs, scale: float) -> torch.Tensor:
    """Wrong: two required arguments (the registry calls with one)."""
    return x.mask.float() * scale


def wrong_shape(x: AdvantageInputs) -> torch.Tensor:
    """Wrong: one value per response, (B,), not (B, T)."""
    return x.scores.float()


def not_finite(x: AdvantageInputs) -> torch.Tensor:
    """Wrong: NaN on the valid tokens."""
    return torch.full_like(x.mask.float(), float("nan"))


def loss_wrong_signature(x: PolicyLossInputs, y: PolicyLossInputs) -> PolicyLossOut:
    """Wrong: a policy loss with two required arguments."""
    raise AssertionError("never called: refused at start")


def loss_wrong_shape(x: PolicyLossInputs) -> PolicyLossOut:
    """Wrong: a per-sequence loss, (B,), where (B, T) is expected."""
    per_seq = -(x.advantages.detach() * x.logp * x.mask).sum(1)
    none = torch.zeros_like(per_seq, dtype=torch.bool)
    return PolicyLossOut(per_token=per_seq, clipped=none, dual_clipped=none)


NOT_A_FUNCTION = 3
"""Wrong: a name that is not callable."""


def raises(x: AdvantageInputs) -> torch.Tensor:
    """Wrong: raises (a bug in the user's own code, deep in torch)."""
    return x.scores[:, None] @ x.mask  # (B, 1) @ (B, T): a shape error inside the function


def wrong_dtype(x: AdvantageInputs) -> torch.Tensor:
    """Wrong: a bool tensor (whether each response beat the mean), not float advantages."""
    return (x.scores[:, None] > x.scores.mean()) & x.mask.bool()


def not_a_tensor(x: AdvantageInputs) -> list[float]:
    """Wrong: a list of per-response numbers."""
    return x.scores.tolist()


def loss_raises(x: PolicyLossInputs) -> PolicyLossOut:
    """Wrong: a policy loss that raises."""
    raise ZeroDivisionError("division by zero")
