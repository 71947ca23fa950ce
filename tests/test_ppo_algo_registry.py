"""Chapter 5 — estimators and policy losses chosen by name (`algo/registry.py`), and how
they are wired in: the config, `compute_advantages`, DAPO's overlong penalty, the CLI.

`test_ppo_estimators.py` pins each formula against verl; this file pins that choosing it by
name runs exactly that formula with the config's arguments, that the batch hands it the
right inputs (KL in the reward, truncation and overlong penalties applied first), and that a
user's own function (`tests/user_algo.py`) loads by name, trains, and is refused at start in
one line when it is wrong. Dynamic sampling is `test_dynamic_sampling.py`'s.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from avrid.cli import main
from avrid.dispatch import Batch
from avrid.ppo.algo.advantages import gae, grpo_advantages, whiten
from avrid.ppo.algo.estimators import (
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from avrid.ppo.algo.losses import policy_loss
from avrid.ppo.algo.policy_losses import cispo_policy_loss, gspo_policy_loss
from avrid.ppo.algo.registry import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    PolicyLossInputs,
    compute_policy_loss,
    estimate,
    resolve_policy_loss,
)
from avrid.ppo.algo.shaping import overlong_penalty
from avrid.ppo.data.columns import padded
from avrid.ppo.data.credit import compute_advantages
from avrid.ppo.driver.run import train
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.validate import validate
from tests import user_algo

pytestmark = pytest.mark.chapter(5)

T = torch.tensor
TOL = dict(atol=1e-6, rtol=1e-6)
USER = "tests.user_algo"


def algo(*overrides: str):
    """The `algo` section of a default config with `overrides` (e.g. "algo.gamma=0.9")."""
    return with_overrides(PPOConfig(), list(overrides)).algo


def random_inputs(seed: int, a) -> AdvantageInputs:
    """3-5 groups of 2-6 responses, ragged lengths 1-7, random scores, KL and values."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 7, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g)
    group_ids = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    n = len(group_ids)
    lens = torch.randint(1, 8, (n,), generator=g)
    mask = (torch.arange(int(lens.max()))[None] < lens[:, None]).float()
    token_rewards = torch.randn(mask.shape, generator=g) * mask
    return AdvantageInputs(scores=token_rewards.sum(1), token_rewards=token_rewards,
                           group_ids=group_ids, mask=mask,
                           values=torch.randn(mask.shape, generator=g) * mask, algo=a)


# ---- every built-in name runs its function with the config's arguments -----------------------

def direct_advantages(name: str, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What `name` must compute, written as a direct call of the function in algo/."""
    a = x.algo
    if name == "ppo":
        adv, ret = gae(x.token_rewards, x.values, x.mask, gamma=a.gamma, lam=a.lam)
        return (whiten(adv, x.mask) if a.whiten_advantages else adv), ret
    return {
        "grpo": lambda: grpo_advantages(x.scores, x.group_ids, x.mask,
                                        norm_by_std=a.grpo_norm_by_std),
        "rloo": lambda: rloo_advantages(x.scores, x.group_ids, x.mask),
        "reinforce_plus_plus": lambda: reinforce_pp_advantages(x.token_rewards, x.mask,
                                                               gamma=a.gamma),
        "reinforce_plus_plus_baseline": lambda: reinforce_pp_baseline_advantages(
            x.scores, x.group_ids, x.mask),
    }[name](), None


@given(seed=st.integers(0, 2**31 - 1), gamma=st.sampled_from([1.0, 0.9, 0.5]),
       lam=st.sampled_from([1.0, 0.95, 0.0]), by_std=st.booleans(), whiten_=st.booleans())
def test_each_estimator_name_runs_its_function_with_the_configs_arguments(
        seed: int, gamma: float, lam: float, by_std: bool, whiten_: bool) -> None:
    a = algo(f"algo.gamma={gamma}", f"algo.lam={lam}", f"algo.grpo_norm_by_std={by_std}",
             f"algo.whiten_advantages={whiten_}")
    x = random_inputs(seed, a)
    for name in ADVANTAGE_ESTIMATORS:
        out = estimate(name, x)
        adv, ret = direct_advantages(name, x)
        torch.testing.assert_close(out.advantages, adv, **TOL)
        assert (out.returns is None) == (ret is None), name  # only PPO has value targets
        if ret is not None:
            torch.testing.assert_close(out.returns, ret, **TOL)


@pytest.mark.parametrize("clips", [("0.2", "0.28", "3.0"), ("0.1", "0.5", "None"),
                                   ("0.0003", "0.0004", "None"), ("1.0", "0.3", "None")])
def test_each_policy_loss_name_runs_its_function_with_the_configs_arguments(
        clips: tuple[str, str, str]) -> None:
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(6)[None] < T([6, 3, 1, 5])[:, None]).float()
    logp = (torch.randn(mask.shape, generator=g) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(mask.shape, generator=g) * 0.4
    adv = torch.randn(mask.shape, generator=g) * mask
    low, high, dual = clips
    for name in POLICY_LOSSES:
        if low == "1.0" and name != "cispo":
            continue  # only CISPO allows no lower bound (the config refuses it for others)
        a = algo(f"algo.policy_loss={name}", f"algo.clip_low={low}", f"algo.clip_high={high}",
                 f"algo.dual_clip={dual}")
        out = compute_policy_loss(resolve_policy_loss(name), name, PolicyLossInputs(
            logp=logp, old_logp=old, advantages=adv, mask=mask, algo=a))
        fn = {"ppo": policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}[name]
        extra = {"dual_clip": a.dual_clip} if name == "ppo" else {}
        want = fn(logp, old, adv, mask, clip_low=a.clip_low, clip_high=a.clip_high, **extra)
        torch.testing.assert_close(out.per_token, want.per_token, **TOL)
        assert torch.equal(out.clipped, want.clipped)
        assert torch.equal(out.dual_clipped, want.dual_clipped)
        grad, = torch.autograd.grad(out.per_token.sum(), logp)
        want_grad, = torch.autograd.grad(want.per_token.sum(), logp)
        torch.testing.assert_close(grad, want_grad, **TOL)


# ---- compute_advantages: what the estimator is handed ----------------------------------------

C = 0.1  # kl_coef
OLD = [[-1.0, -0.5, -2.0], [-0.3], [-1.2, -0.7], [-0.4, -0.9, -0.2, -1.5]]
REF = [[-1.1, -0.2, -2.5], [-0.6], [-1.0, -0.7], [-0.9, -0.4, -0.2, -1.0]]
SCORES = [1.0, 0.0, 1.0, 0.5]


def kl_batch(truncated: list[float] | None = None) -> Batch:
    """Two prompts x two responses of lengths 3, 1, 2, 4 with old_logp, ref_logp, values."""
    lens = [len(r) for r in OLD]
    scalars = {"score": T(SCORES), "group": T([0, 0, 1, 1])}
    if truncated is not None:
        scalars["truncated"] = T(truncated)
    return Batch.from_rows(
        sample_ids=range(4), prompt_lens=[2] * 4, response_lens=lens,
        packed={"tokens": [torch.arange(2 + n) + 2 for n in lens],
                "old_logp": [T(r) for r in OLD], "ref_logp": [T(r) for r in REF],
                "values": [torch.full((n,), 0.25) for n in lens]}, scalars=scalars)


def test_kl_in_the_reward_reaches_every_estimator_as_its_inputs_say() -> None:
    batch = kl_batch()
    mask = (torch.arange(4)[None] < T([3, 1, 2, 4])[:, None]).float()
    # k1 = old_logp - ref_logp per token; the score is earned at the last valid token.
    kl = [[o - r for o, r in zip(ro, rr, strict=True)] for ro, rr in zip(OLD, REF, strict=True)]
    rewards = torch.zeros(4, 4)
    for i, row in enumerate(kl):
        rewards[i, :len(row)] = -C * T(row)
        rewards[i, len(row) - 1] += SCORES[i]
    net = T([s - C * sum(row) for s, row in zip(SCORES, kl, strict=True)])
    groups = T([0, 0, 1, 1])
    want = {
        "grpo": grpo_advantages(net, groups, mask, norm_by_std=True),
        "rloo": rloo_advantages(net, groups, mask),
        "reinforce_plus_plus": reinforce_pp_advantages(rewards, mask, gamma=0.9),
        "reinforce_plus_plus_baseline": reinforce_pp_baseline_advantages(net, groups, mask),
        "ppo": whiten(gae(rewards, torch.full((4, 4), 0.25) * mask, mask, gamma=0.9,
                          lam=0.95)[0], mask),
    }
    assert set(want) == set(ADVANTAGE_ESTIMATORS)
    for name, adv in want.items():
        cfg = with_overrides(PPOConfig(), [f"algo.name={name}", f"algo.kl_coef={C}",
                                           "algo.kl_in=reward", "algo.kl_kind=k1",
                                           "algo.gamma=0.9", "algo.lam=0.95"])
        out = compute_advantages(batch, cfg)
        torch.testing.assert_close(padded(out, "advantages"), adv, **TOL)
        assert ("returns" in out.packed) == (name == "ppo"), name  # value targets: PPO only
    # RLOO, by hand for the first group: A_0 = net_0 - net_1 = -A_1.
    rloo = padded(compute_advantages(batch, with_overrides(PPOConfig(), [
        "algo.name=rloo", f"algo.kl_coef={C}", "algo.kl_in=reward", "algo.kl_kind=k1"])),
        "advantages")
    d = SCORES[0] - SCORES[1] - C * (sum(kl[0]) - sum(kl[1]))
    assert rloo[0, :3].tolist() == pytest.approx([d] * 3, abs=1e-6)
    assert rloo[1, 0].item() == pytest.approx(-d, abs=1e-6)


# ---- DAPO's overlong penalty -----------------------------------------------------------------

def verl_overlong_reward(valid_response_length: int, max_resp_len: int,
                         overlong_buffer_len: int, overlong_penalty_factor: float) -> float:
    """verl 0.9.1 (PyPI wheel), verl/workers/reward_manager/dapo.py, DAPORewardManager.__call__,
    transcribed with plain numbers for its tensors. (verl asserts max_resp_len >= len; avrid
    asks len < max_resp_len: with len == max_resp_len the ramp would start at 0 tokens.)"""
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)


@given(data=st.data(), max_response=st.integers(2, 4096),
       factor=st.floats(1e-3, 10.0, allow_nan=False))
def test_overlong_penalty_equals_verls_dapo_reward_manager(data, max_response: int,
                                                          factor: float) -> None:
    buffer = data.draw(st.integers(1, max_response - 1))
    lens = data.draw(st.lists(st.integers(0, max_response), min_size=1, max_size=32))
    got = overlong_penalty(T(lens), max_response=max_response, buffer=buffer, factor=factor)
    want = T([float(verl_overlong_reward(n, max_response, buffer, factor)) for n in lens])
    torch.testing.assert_close(got, want, **TOL)
    assert got.dtype == torch.float32 and bool((got <= 0).all())


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_response=0, buffer=1, factor=1.0), "max_response"),
    (dict(max_response=8, buffer=0, factor=1.0), "buffer"),
    (dict(max_response=8, buffer=8, factor=1.0), "buffer"),
    (dict(max_response=8, buffer=9, factor=1.0), "buffer"),
    (dict(max_response=8, buffer=2, factor=0.0), "factor"),
    (dict(max_response=8, buffer=2, factor=-1.0), "factor"),
    (dict(max_response=8, buffer=2, factor=float("nan")), "factor"),
])
def test_overlong_penalty_refuses_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        overlong_penalty(T([1, 2]), **kwargs)
    with pytest.raises(ValueError, match="1-D"):
        overlong_penalty(T([[1, 2]]), max_response=8, buffer=2, factor=1.0)


def test_compute_advantages_shapes_the_scores_before_the_estimator() -> None:
    # Lengths 3, 1, 2, 4 with budget 4, buffer 2: the ramp starts after 2 tokens, so the
    # overlong penalties are -0.5 * [0.5, 0, 0, 1]; the truncation penalty 0.3 hits row 3.
    batch = kl_batch(truncated=[0, 0, 0, 1])
    shaping = ["algo.overlong_buffer=2", "algo.overlong_penalty=0.5", "algo.truncation=penalty",
               "algo.truncation_penalty=0.3"]
    want = T(SCORES) + T([-0.25, 0.0, 0.0, -0.5]) - T([0.0, 0.0, 0.0, 0.3])
    verl = T([SCORES[i] + verl_overlong_reward(n, 4, 2, 0.5) - 0.3 * (i == 3)
              for i, n in enumerate([3, 1, 2, 4])])
    torch.testing.assert_close(want, verl, **TOL)
    cfg = with_overrides(PPOConfig(), [f"algo.name={USER}:sign_advantage", *shaping])
    out = compute_advantages(batch, cfg, max_response=4)
    seen = user_algo.LAST["inputs"]
    torch.testing.assert_close(seen.scores, want, **TOL)
    torch.testing.assert_close(seen.token_rewards.sum(1), want, **TOL)
    torch.testing.assert_close(padded(out, "advantages")[:, 0], want - want.mean(), **TOL)
    # A built-in sees the same shaped scores (Dr.GRPO: score minus the group mean).
    cfg = with_overrides(PPOConfig(), ["algo.name=grpo", "algo.grpo_norm_by_std=false",
                                       *shaping])
    adv = padded(compute_advantages(batch, cfg, max_response=4), "advantages")[:, 0]
    torch.testing.assert_close(adv, want - want.view(2, 2).mean(1).repeat_interleave(2), **TOL)
    with pytest.raises(ValueError, match="overlong_buffer.*max_response"):
        compute_advantages(batch, cfg)  # without the budget it cannot shape


def test_validate_refuses_an_overlong_buffer_as_long_as_the_response_budget() -> None:
    with pytest.raises(ValueError, match=r"algo\.overlong_buffer.*8 tokens"):
        with_overrides(PPOConfig(), ["rollout.max_response_tokens=8", "algo.overlong_buffer=8"])
    with_overrides(PPOConfig(), ["rollout.max_response_tokens=8", "algo.overlong_buffer=7"])
    task = load_task("digits", op="reverse", length=2, num_val=30)  # a budget of 3 tokens
    for buffer, ok in ((2, True), (3, False), (10, False)):
        cfg = with_overrides(PPOConfig(), [f"algo.overlong_buffer={buffer}"])
        validate(cfg)  # no budget known without the task
        if ok:
            validate(cfg, task)
        else:
            with pytest.raises(ValueError, match=r"algo\.overlong_buffer.*3 tokens"):
                validate(cfg, task)
    for bad in ("algo.overlong_buffer=-1", "algo.overlong_penalty=0",
                "algo.overlong_penalty=nan", "algo.overlong_penalty=inf"):
        with pytest.raises(ValueError, match=bad.split("=")[0].replace(".", r"\.")):
            with_overrides(PPOConfig(), [bad])


# ---- the config: names, clips, group sizes ---------------------------------------------------

@pytest.mark.parametrize("field, builtins", [("algo.name", ADVANTAGE_ESTIMATORS),
                                             ("algo.policy_loss", POLICY_LOSSES)])
def test_the_config_takes_built_in_names_and_module_function(field: str, builtins) -> None:
    for name in [*builtins, "my_module:my_fn", "pkg.sub.mod:fn"]:  # imported at start only
        cfg = with_overrides(PPOConfig(), [f"{field}={name}", "algo.responses_per_prompt=2"])
        assert getattr(cfg.algo, field.split(".")[1]) == name
    for bad in ("bogus", "rloo2", "mod:", ":fn", "my mod:fn", "mod:my fn", ""):
        with pytest.raises(ValueError, match=rf"{field.replace('.', '[.]')}.*{bad!r}"):
            with_overrides(PPOConfig(), [f"{field}={bad}"])


def test_clip_low_of_one_is_cispos_alone() -> None:
    assert algo("algo.policy_loss=cispo", "algo.clip_low=1.0").clip_low == 1.0
    for loss in ("ppo", "gspo", f"{USER}:reinforce"):
        with pytest.raises(ValueError, match=r"algo\.clip_low.*\(0, 1\)"):
            algo(f"algo.policy_loss={loss}", "algo.clip_low=1.0")
    with pytest.raises(ValueError, match=r"algo\.clip_low.*\(0, 1\]"):
        algo("algo.policy_loss=cispo", "algo.clip_low=1.5")


def test_group_estimators_and_dynamic_sampling_need_two_responses_per_prompt() -> None:
    for name in ADVANTAGE_ESTIMATORS:
        one = [f"algo.name={name}", "algo.responses_per_prompt=1"]
        if name in GROUP_ESTIMATORS:
            with pytest.raises(ValueError, match=rf"algo\.responses_per_prompt.*{name}.*>= 2"):
                with_overrides(PPOConfig(), one)
        else:
            with_overrides(PPOConfig(), one)
            with pytest.raises(ValueError, match=r"algo\.responses_per_prompt.*dynamic samp"):
                with_overrides(PPOConfig(), [*one, "algo.dynamic_sampling=true"])
    assert GROUP_ESTIMATORS == {"grpo", "rloo", "reinforce_plus_plus_baseline"}


# ---- a user's function refused at start, in one line -----------------------------------------

@pytest.mark.parametrize("setting, problem", [
    (f"algo.name={USER}:wrong_signature", "wrong signature"),
    ("algo.name=tests.no_such_module:fn", "cannot import module 'tests.no_such_module'"),
    (f"algo.name={USER}:no_such_function", "has no function 'no_such_function'"),
    (f"algo.name={USER}:NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
    (f"algo.policy_loss={USER}:loss_wrong_signature", "wrong signature"),
    ("algo.policy_loss=tests.no_such_module:fn", "cannot import module"),
    ("algo.name=bogus", "unknown algorithm 'bogus'"),
    ("algo.policy_loss=bogus", "unknown policy loss 'bogus'"),
])
def test_a_bad_user_function_stops_the_cli_in_one_line_before_any_worker(
        setting: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[int] = []

    def start(self, *args, **kwargs) -> None:  # a worker would start here: it must not
        started.append(1)
        raise RuntimeError("a worker was started")

    monkeypatch.setattr(Trainer, "start", start)
    code = 0
    try:
        main(["ppo", "--preset", "tiny-grpo", "--backend", "inprocess", "--steps", "1",
              "--out", str(tmp_path / "run"), "--set", "train.progress=false", "--set",
              setting])
    except SystemExit as done:
        code = int(done.code or 0)
    out, err = capsys.readouterr()
    assert code == 2 and not started
    lines = err.strip().splitlines()
    field = setting.split("=")[0]
    assert len(lines) == 1 and lines[0].startswith("avrid ppo: "), err
    assert field in lines[0] and problem in lines[0], lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- runtime checks of what a user's function returns ----------------------------------------

@pytest.mark.parametrize("fn, problem", [("wrong_shape", r"shape \(\d+,\)"),
                                         ("not_finite", "non-finite advantages")])
def test_an_estimator_returning_a_bad_tensor_fails_naming_algo_name(fn: str,
                                                                    problem: str) -> None:
    name = f"{USER}:{fn}"
    with pytest.raises(ValueError, match=rf"algo\.name='{name}'.*{problem}"):
        estimate(name, random_inputs(0, algo()))
    with pytest.raises(ValueError, match=rf"algo\.name='{name}'.*{problem}"):
        compute_advantages(kl_batch(), with_overrides(PPOConfig(), [f"algo.name={name}"]))


def test_a_policy_loss_returning_a_bad_shape_fails_naming_algo_policy_loss() -> None:
    name = f"{USER}:loss_wrong_shape"
    mask = torch.ones(3, 4)
    x = PolicyLossInputs(logp=-torch.rand(3, 4), old_logp=-torch.rand(3, 4),
                         advantages=torch.randn(3, 4), mask=mask, algo=algo())
    with pytest.raises(ValueError, match=rf"algo\.policy_loss='{name}'.*\(3,\).*\(3, 4\)"):
        compute_policy_loss(resolve_policy_loss(name), name, x)


# ---- a user's function trains -----------------------------------------------------------------

@pytest.mark.parametrize("setting, counter", [
    (f"algo.name={USER}:sign_advantage", "sign_advantage"),
    (f"algo.policy_loss={USER}:reinforce", "reinforce"),
])
def test_a_user_function_loaded_by_name_trains(setting: str, counter: str,
                                               tmp_path: Path) -> None:
    # 20 steps of tiny-grpo in-process (a few seconds): validation reward 0.07 -> 0.40 (the
    # estimator) and 0.07 -> 0.55 (the loss) on seed 0; 100 steps reach 0.85 and 0.95.
    cfg = with_overrides(preset("tiny-grpo"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.steps=20", "train.val_every=10", "train.val_prompts=30", "train.seed=0",
        "train.progress=false", f"train.out_dir={tmp_path}", setting])
    calls = user_algo.CALLS[counter]
    summary = train(cfg)
    assert user_algo.CALLS[counter] - calls >= 20  # once a step at least: it was used
    assert summary.final_val_reward >= summary.initial_val_reward + 0.2, summary
    steps = [r for r in summary.rows if "actor/pg_clipfrac" in r]
    assert len(steps) == 20 and all(math.isfinite(r["actor/pg_clipfrac"]) for r in steps)
    if counter == "reinforce":  # its `clipped` is all False, and that is what was logged
        assert all(r["actor/pg_clipfrac"] == 0.0 for r in steps)
