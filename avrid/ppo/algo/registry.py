"""Chapter 5 — choosing the advantage estimator and the policy loss by name, yours included.

`algo.name` and `algo.policy_loss` are looked up in two plain dicts, `ADVANTAGE_ESTIMATORS`
and `POLICY_LOSSES`: no decorators, no class hierarchy, nothing registered behind your back.
Each entry is a function with ONE calling convention, so the trainer calls every estimator
(and every loss) the same way:

    estimator(inputs: AdvantageInputs) -> torch.Tensor | AdvantageOut   (B, T) float
    loss(inputs: PolicyLossInputs) -> losses.PolicyLossOut   per_token, clipped, dual_clipped

The built-in entries are thin adapters over the math in `advantages.py`, `estimators.py`,
`losses.py` and `policy_losses.py`, which keep their own explicit arguments. A name that is
not built in is read as ``package.module:function`` (as `task.name` is) and imported: your
estimator is a function in your own module, and nothing in avrid changes. `resolve_estimator`
and `resolve_policy_loss` check it at start (it imports, it is callable, it takes one
argument), so a typo fails in one line before any worker starts, not at the first update.
At each call, `estimate` and `compute_policy_loss` check what it returns (shape, dtype,
finite values) and turn an exception it raises into a ValueError naming the field: a broken
user function is one line and exit status 2 from `avrid ppo`, never a bare traceback.

Only "ppo" uses a critic (`ESTIMATORS_WITH_CRITIC`): a user's estimator sees `values=None`.
Pure tensor code plus `importlib`; no models, no batches, no Ray.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from avrid.ppo.algo.advantages import gae, grpo_advantages, whiten
from avrid.ppo.algo.estimators import (
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from avrid.ppo.algo.losses import PolicyLossOut, policy_loss
from avrid.ppo.algo.policy_losses import cispo_policy_loss, gspo_policy_loss


@dataclass(frozen=True, slots=True, kw_only=True)
class AdvantageInputs:
    """What every advantage estimator is given (B responses, T = longest response).

    Example: 2 prompts x 2 responses, scores [1, 0, 1, 1], lengths [2, 1, 2, 2]:
    ``scores = tensor([1., 0., 1., 1.])``, ``group_ids = tensor([0, 0, 1, 1])``,
    ``mask = tensor([[1, 1], [1, 0], [1, 1], [1, 1]])`` and, with no KL in the reward,
    ``token_rewards = tensor([[0., 1.], [0., 0.], [0., 1.], [0., 1.]])``.
    """

    scores: torch.Tensor
    """(B,) float32 outcome score per response: the task's reward after `algo.truncation`
    and the overlong penalty, MINUS kl_coef x the response's summed KL when the KL goes in
    the reward (what verl's outcome estimators get as token_level_rewards.sum(-1))."""
    token_rewards: torch.Tensor
    """(B, T) float32 reward per response token: -kl_coef x KL_t at each token (KL in the
    reward; else 0) plus the shaped task score at the last token. Its row sum is `scores`."""
    group_ids: torch.Tensor
    """(B,) int64; equal ids mark responses to the same prompt."""
    mask: torch.Tensor
    """(B, T) float32 0/1, right-padded: the valid response tokens."""
    values: torch.Tensor | None
    """(B, T) float32 critic values V(s_t), or None for estimators without a critic."""
    algo: Any
    """The run's `AlgoConfig` (gamma, lam, grpo_norm_by_std, whiten_advantages, ...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdvantageOut:
    """An estimator's result when it has value targets too (GAE); others may return just the
    (B, T) advantages tensor."""

    advantages: torch.Tensor
    """(B, T) float32, 0 on padding."""
    returns: torch.Tensor | None = None
    """(B, T) float32 value targets for the critic, or None."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyLossInputs:
    """What every policy loss is given, for one micro-batch (B rows, T response tokens); it
    returns a `losses.PolicyLossOut` of (B, T) tensors (its docstring is the contract).

    Example: one response of 2 tokens whose ratios are 1.5 and 0.9 under advantage 1:
    ``logp = log(tensor([[1.5, 0.9]]))``, ``old_logp = zeros(1, 2)``,
    ``advantages = ones(1, 2)``, ``mask = ones(1, 2)``; PPO's loss ("ppo", clip 0.2) gives
    ``per_token = [[-1.2, -0.9]]`` and ``clipped = [[True, False]]``.
    """

    logp: torch.Tensor
    """(B, T) log-probs of the sampled tokens under the policy being trained (has grad)."""
    old_logp: torch.Tensor
    """(B, T) log-probs under the policy before this step's updates (no grad)."""
    advantages: torch.Tensor
    """(B, T) per-token advantages (no grad)."""
    mask: torch.Tensor
    """(B, T) 0/1 valid response tokens."""
    algo: Any
    """The run's `AlgoConfig` (clip_low, clip_high, dual_clip, ...)."""


AdvantageFn = Callable[[AdvantageInputs], "torch.Tensor | AdvantageOut"]
PolicyLossFn = Callable[[PolicyLossInputs], PolicyLossOut]


# ---- the built-in estimators: adapters from AdvantageInputs to each function's arguments ---

def _ppo(x: AdvantageInputs) -> AdvantageOut:
    """PPO: GAE over the token rewards with the critic's values, whitened if configured."""
    if x.values is None:
        raise ValueError("the 'ppo' estimator (GAE) needs the critic's values")
    adv, ret = gae(x.token_rewards, x.values, x.mask, gamma=x.algo.gamma, lam=x.algo.lam)
    if x.algo.whiten_advantages:
        adv = whiten(adv, x.mask)
    return AdvantageOut(advantages=adv, returns=ret)


def _grpo(x: AdvantageInputs) -> torch.Tensor:
    """GRPO (or Dr.GRPO with grpo_norm_by_std=False): group-normalised scores."""
    return grpo_advantages(x.scores, x.group_ids, x.mask, norm_by_std=x.algo.grpo_norm_by_std)


def _rloo(x: AdvantageInputs) -> torch.Tensor:
    """RLOO: each score minus its siblings' mean."""
    return rloo_advantages(x.scores, x.group_ids, x.mask)


def _reinforce_pp(x: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++: discounted token returns (KL paid per token), whitened over the batch."""
    return reinforce_pp_advantages(x.token_rewards, x.mask, gamma=x.algo.gamma)


def _reinforce_pp_baseline(x: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++-baseline: group mean subtracted, then whitened over the batch."""
    return reinforce_pp_baseline_advantages(x.scores, x.group_ids, x.mask)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "ppo": _ppo,
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_plus_plus": _reinforce_pp,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline,
}
"""`algo.name` -> estimator. The names are verl's (`algorithm.adv_estimator`)."""

ESTIMATORS_WITH_CRITIC = frozenset({"ppo"})
"""Estimators that read the critic's values (the run then trains a critic)."""

GROUP_ESTIMATORS = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline"})
"""Estimators whose baseline compares a response with its siblings: they need >= 2 responses
per prompt."""


# ---- the built-in policy losses --------------------------------------------------------------

def _ppo_loss(x: PolicyLossInputs) -> PolicyLossOut:
    """PPO's clipped surrogate (clip-higher, dual clip)."""
    a = x.algo
    return policy_loss(x.logp, x.old_logp, x.advantages, x.mask,
                       clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip)


def _gspo_loss(x: PolicyLossInputs) -> PolicyLossOut:
    """GSPO: one length-normalised importance ratio per sequence (token variant)."""
    return gspo_policy_loss(x.logp, x.old_logp, x.advantages, x.mask,
                            clip_low=x.algo.clip_low, clip_high=x.algo.clip_high)


def _cispo_loss(x: PolicyLossInputs) -> PolicyLossOut:
    """CISPO: clipped, stop-gradient importance weight times REINFORCE."""
    return cispo_policy_loss(x.logp, x.old_logp, x.advantages, x.mask,
                             clip_low=x.algo.clip_low, clip_high=x.algo.clip_high)


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": _ppo_loss,
    "gspo": _gspo_loss,
    "cispo": _cispo_loss,
}
"""`algo.policy_loss` -> loss. The names are verl's (`actor.policy_loss.loss_mode`; its
"vanilla" is "ppo" here)."""


# ---- lookup -----------------------------------------------------------------------------------

def resolve_estimator(name: str) -> AdvantageFn:
    """The estimator `algo.name` names: a built-in or ``package.module:function``.

    Example:
        >>> resolve_estimator("rloo").__name__
        '_rloo'
    """
    return _resolve(name, ADVANTAGE_ESTIMATORS, "algo.name", "an advantage estimator",
                    "AdvantageInputs")


def resolve_policy_loss(name: str) -> PolicyLossFn:
    """The loss `algo.policy_loss` names: a built-in or ``package.module:function``."""
    return _resolve(name, POLICY_LOSSES, "algo.policy_loss", "a policy loss",
                    "PolicyLossInputs")


def estimate(name: str, x: AdvantageInputs) -> AdvantageOut:
    """Run the estimator `name` on `x`; its result checked: (B, T) floating-point advantages,
    finite on the valid tokens, and (B, T) floating-point returns if any.

    Raises:
        ValueError: naming `algo.name` and what was wrong, for any of those, and for a
            user's estimator that raised (its exception chained: ``--debug`` shows where).
    """
    out = _call_user(resolve_estimator(name), name, ADVANTAGE_ESTIMATORS, "algo.name", x)
    if not isinstance(out, AdvantageOut):
        out = AdvantageOut(advantages=out)
    for what, t in (("advantages", out.advantages), ("returns", out.returns)):
        if t is None and what == "returns":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(x.mask.shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"algo.name={name!r} returned {what} of shape {got}; expected a "
                             f"(B, T) = {tuple(x.mask.shape)} tensor")
        # An integer or bool tensor is a slip (a mask returned, a rounding): refused, not cast.
        if not t.is_floating_point():
            raise ValueError(f"algo.name={name!r} returned {what} of dtype {t.dtype}; "
                             f"expected a floating-point tensor (e.g. float32)")
        if not bool(torch.isfinite(t[x.mask.bool()]).all()):
            raise ValueError(f"algo.name={name!r} returned non-finite {what}")
    return out


def compute_policy_loss(fn: PolicyLossFn, name: str, x: PolicyLossInputs) -> PolicyLossOut:
    """Run the loss `fn` (`resolve_policy_loss(name)`) on `x`; its result checked.

    Raises:
        ValueError: naming `algo.policy_loss`, for a result that is not a `PolicyLossOut` of
            (B, T) tensors, and for a user's loss that raised (its exception chained).
    """
    out = _call_user(fn, name, POLICY_LOSSES, "algo.policy_loss", x)
    shape = tuple(x.mask.shape)
    if not isinstance(out, PolicyLossOut) or any(
            tuple(t.shape) != shape for t in (out.per_token, out.clipped, out.dual_clipped)):
        got = (f"shapes {[tuple(t.shape) for t in (out.per_token, out.clipped)]}"
               if isinstance(out, PolicyLossOut) else type(out).__name__)
        raise ValueError(f"algo.policy_loss={name!r} returned {got}; expected a PolicyLossOut "
                         f"whose per_token, clipped and dual_clipped are (B, T) = {shape}")
    return out


def _call_user(fn: Callable, name: str, builtins: dict[str, Any], field: str, x: Any) -> Any:
    """``fn(x)``; a user's function (a name not in `builtins`) that raises becomes a
    ValueError naming `field` and the exception, so `avrid ppo` reports it in one line and
    exit status 2, like any other bad input. A built-in's exception is avrid's own bug (or
    its own clear ValueError) and is left as it is."""
    if name in builtins:
        return fn(x)
    try:
        return fn(x)
    except Exception as e:  # anything a user's code may raise; the traceback stays chained
        text = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{field}={name!r} raised {type(e).__name__}"
                         f"{': ' + text if text else ''} (your function; --debug shows where)"
                         ) from e


def is_valid_name(name: object, builtins: dict[str, Any]) -> bool:
    """Whether `name` has the form of a built-in or ``module:function`` (not yet imported)."""
    if not isinstance(name, str):
        return False
    module, _, attr = name.partition(":")
    return name in builtins or (bool(module.strip()) and bool(attr.strip()) and " " not in name)


def _resolve(name: str, builtins: dict[str, Callable], field: str, what: str,
             argument: str) -> Callable:
    if name in builtins:
        return builtins[name]
    allowed = (f"one of {', '.join(repr(n) for n in builtins)} or 'package.module:function' "
               f"taking one {argument}")
    if not is_valid_name(name, builtins):
        raise ValueError(f"{field}={name!r} is not {what}; expected {allowed}")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{field}={name!r}: cannot import module {module_name!r} ({e}); is it "
                         f"on the PYTHONPATH of the driver and the workers?") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"{field}={name!r}: module {module_name!r} has no function {attr!r}; "
                         f"expected {allowed}")
    try:
        inspect.signature(fn).bind(object())  # called with exactly one positional argument
    except TypeError:
        raise ValueError(f"{field}={name!r}: {attr}{_signature(fn)} has the wrong signature; "
                         f"{what} takes exactly one argument, an {argument} "
                         f"(avrid.ppo.algo.registry)") from None
    except ValueError:  # a builtin without a readable signature: trust it, checked at use
        pass
    return fn


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"
