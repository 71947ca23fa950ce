"""Chapter 5 — the `algo` section of the config: the estimator, the policy loss, the KL, the
clips, and the shaping of scores and of the batch (truncation, overlong, dynamic sampling).

`AlgoConfig` is one of `PPOConfig`'s sections (re-exported by `config.py`, where the others
are). `name` and `policy_loss` are looked up in `algo/registry.py`; here only their form is
checked (a built-in or "module:function"): the driver imports a user's function at start.
The rules that tie this section to others (group sizes, the response budget) are in
`validate.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from avrid.ppo.algo.losses import AggMode, KlKind
from avrid.ppo.algo.registry import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATORS_WITH_CRITIC,
    POLICY_LOSSES,
    is_valid_name,
)
from avrid.ppo.setup.validate import finite, need, one_of, positive

KlPlace = Literal["reward", "loss"]
"""Where the KL to the reference goes (see `AlgoConfig.kl_in`)."""
Truncation = Literal["keep", "mask", "penalty"]
"""What to do with a response cut off at the response budget (finish reason "length")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgoConfig:
    """The RL algorithm: the advantage estimator (`name`), the policy loss, and the data-side
    shaping. PPO learns a critic and uses GAE; the others drop the critic (see
    `algo/registry.py` for the names and how to add your own)."""

    name: str = "ppo"
    """The advantage estimator (verl's names): "ppo" (actor + critic, GAE), "grpo"
    (group-normalised scores), "rloo" (leave-one-out baseline), "reinforce_plus_plus"
    (whitened returns, KL per token), "reinforce_plus_plus_baseline" (group mean, then
    whitened), or "package.module:function" (yours, taking one `registry.AdvantageInputs`)."""
    policy_loss: str = "ppo"
    """The actor's loss: "ppo" (clipped token ratio), "gspo" (one ratio per sequence: use
    tiny clips, e.g. 3e-4 / 4e-4), "cispo" (clipped, stop-gradient IS weight) or
    "package.module:function" (taking one `registry.PolicyLossInputs`)."""
    responses_per_prompt: int = 8
    """Responses sampled per prompt (GRPO's group size; PPO uses them as plain samples)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 1.0
    """GAE lambda."""
    grpo_norm_by_std: bool = True
    """GRPO divides by the group's std; False is Dr.GRPO (pair with seq-mean-token-sum-norm)."""
    clip_low: float = 0.2
    """PPO ratio clip below: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """PPO ratio clip above: ratio <= 1 + clip_high (DAPO's clip-higher when > clip_low)."""
    dual_clip: float | None = 3.0
    """Dual clip c > 1 bounding the loss of negative advantages; None disables it (the "ppo"
    policy loss only)."""
    value_clip: float | None = 0.5
    """Critic value clip around the old values; None disables it."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference policy (0 = no reference model is run)."""
    kl_in: KlPlace = "loss"
    """Where the KL goes: subtracted from the token rewards, or added to the actor loss."""
    kl_kind: KlKind = "k3"
    """KL estimator (Schulman's k1, k2, k3). In the reward any; in the loss k2 or k3 only (k1's
    expected gradient is 0: see `losses.py`)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight in the actor loss."""
    loss_agg: AggMode = "token-mean"
    """How token losses become one number; one of `losses.AGG_MODES`."""
    whiten_advantages: bool = True
    """PPO: whiten GAE advantages over the batch (GRPO's are already normalised)."""
    truncation: Truncation = "keep"
    """Responses that hit the response budget without a stop token: "keep" (train on them like
    any other), "mask" (leave them out of the actor and critic losses: DAPO's overlong
    filtering) or "penalty" (subtract `truncation_penalty` from their score)."""
    truncation_penalty: float = 1.0
    """With truncation="penalty": subtracted from a truncated response's score before the
    advantages (the task's reward scale; digits and gsm8k score in [0, 1])."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a response longer than (response budget - this)
    loses overlong_penalty x (excess / this) from its score, up to overlong_penalty at the
    budget (`algo/shaping.py`). 0 = off."""
    overlong_penalty: float = 1.0
    """The overlong punishment at the response budget (DAPO's penalty factor)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose responses all scored the same (they teach
    a group-relative estimator nothing) and generate more prompts until the step holds
    `train.prompts_per_step` groups (`data/dynamic_sampling.py`)."""
    dynamic_sampling_max_rounds: int = 10
    """With dynamic_sampling: most generation rounds per step, the first included; a step
    still short of groups after them stops the run with an error."""

    def __post_init__(self) -> None:
        finite("algo", self)
        need(is_valid_name(self.name, ADVANTAGE_ESTIMATORS), "algo.name",
             f"unknown algorithm {self.name!r}; allowed: {', '.join(ADVANTAGE_ESTIMATORS)} "
             f"or 'package.module:function'")
        need(is_valid_name(self.policy_loss, POLICY_LOSSES), "algo.policy_loss",
             f"unknown policy loss {self.policy_loss!r}; allowed: {', '.join(POLICY_LOSSES)} "
             f"or 'package.module:function'")
        positive("algo", responses_per_prompt=self.responses_per_prompt)
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            need(0.0 <= v <= 1.0, f"algo.{name}", f"must be in [0, 1], got {v}")
        # CISPO's weight may have no lower bound (clip_low = 1: w >= 0); PPO's ratio needs one.
        cispo = self.policy_loss == "cispo"
        need(0.0 < self.clip_low < 1.0 or (cispo and self.clip_low == 1.0), "algo.clip_low",
             f"must be in (0, 1{']' if cispo else ')'} (ratio >= 1 - clip_low"
             f"{' >= 0' if cispo else ' > 0'}), got {self.clip_low}")
        need(0.0 < self.clip_high <= 10.0, "algo.clip_high",
             f"must be in (0, 10], got {self.clip_high}")
        need(self.dual_clip is None or self.dual_clip > 1.0, "algo.dual_clip",
             f"must be > 1 or None, got {self.dual_clip}")
        need(self.value_clip is None or self.value_clip > 0, "algo.value_clip",
             f"must be > 0 or None, got {self.value_clip}")
        need(self.kl_coef >= 0 and math.isfinite(self.kl_coef), "algo.kl_coef",
             f"must be a finite number >= 0, got {self.kl_coef}")
        one_of("algo.kl_in", self.kl_in, KlPlace, "place for the KL")
        one_of("algo.kl_kind", self.kl_kind, KlKind, "KL estimator")
        need(self.entropy_coef >= 0, "algo.entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        one_of("algo.loss_agg", self.loss_agg, AggMode, "mode")
        one_of("algo.truncation", self.truncation, Truncation, "choice")
        need(math.isfinite(self.truncation_penalty) and self.truncation_penalty > 0,
             "algo.truncation_penalty",
             f"must be a finite number > 0, got {self.truncation_penalty}")
        need(self.overlong_buffer >= 0, "algo.overlong_buffer",
             f"must be >= 0 tokens (0 = off), got {self.overlong_buffer}")
        need(self.overlong_penalty > 0, "algo.overlong_penalty",
             f"must be a finite number > 0, got {self.overlong_penalty}")
        positive("algo", dynamic_sampling_max_rounds=self.dynamic_sampling_max_rounds)

    @property
    def uses_critic(self) -> bool:
        """PPO (GAE) learns a value function; the other estimators do not."""
        return self.name in ESTIMATORS_WITH_CRITIC
