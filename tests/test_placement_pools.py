"""The reference and the rule reward on pools of their own (`placement.reference`,
`placement.reward`; `avrid/ppo/driver/placement.py`, `roles/reference.py`,
`driver/reference.py`): the plan puts each role where the fields say, a run with the
reference on ranks of its own (LoRA included: the base weights) gives the colocated run's
metrics, samples and weights bit for bit — serially and with `train.concurrent_phases`, in
process and once on Ray — and the policy then holds no reference of its own; bad
combinations are refused in one line.

Why bit for bit: the pool's rank builds the very fp32 initial weights the policy's copy is
built from (one seed, one builder), and with as many reference ranks as policy ranks the
dispatch plan cuts the same micro-batches, so each forward computes the same numbers in the
same order.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from avrid.ppo.data.columns import reads
from avrid.ppo.driver.placement import REWARD_CPU_SHARE, build_placement
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.roles.policy import LOGPROBS_READS, PolicyWorker
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.tokenizer import make_tokenizer
from avrid.results import run_shards
from avrid.workers import PlacementPlan, WorkerError
from tests.test_concurrent_phases import CONCURRENT, assert_same_batches, assert_same_weights, run
from tests.test_concurrent_phases import config as short

pytestmark = pytest.mark.chapter(5)

POOL = "placement.reference=pool"


def plan(cfg: PPOConfig) -> PlacementPlan:
    task = load_task(cfg.task.name, **cfg.task.kwargs)
    return build_placement(cfg, make_tokenizer(cfg, task), max_response_tokens=4)


def pools(p: PlacementPlan) -> dict[str, set[str]]:
    """Role -> the pools its ranks are in."""
    return {r.role: {s.pool for s in p.slots_of(r.role)} for r in p.roles}


# ---- the plan ---------------------------------------------------------------------------------

def test_a_reference_pool_has_its_own_bundles_and_ranks() -> None:
    p = plan(with_overrides(preset("tiny-ppo"), ["algo.kl_coef=0.05", POOL,
                                                  "placement.reference_dp=3"]))
    assert pools(p)["reference"] == {"reference"}
    assert len(p.pool("reference").bundles) == 3 and p.role("reference").world_size == 3
    assert pools(p)["policy"] == pools(p)["critic"] == {"policy"}
    assert "reference" not in pools(plan(with_overrides(preset("tiny-ppo"),
                                                        ["algo.kl_coef=0.05"])))


@pytest.mark.parametrize(("sets", "where", "first_bundle"), [
    ((), "policy", {"policy", "critic", "reward"}),  # today's default
    (("placement.reward=pool",), "reward", {"policy", "critic"}),
    (("placement.reward=critic", "placement.colocate_critic=false"), "critic",
     {"critic", "reward"}),
    (("placement.reward=critic",), "policy", {"policy", "critic", "reward"}),  # colocated
])
def test_the_rule_reward_sits_where_placement_reward_says(sets: tuple[str, ...], where: str,
                                                          first_bundle: set[str]) -> None:
    p = plan(with_overrides(preset("tiny-ppo"), list(sets)))
    assert pools(p)["reward"] == {where}
    pool = "critic" if "placement.colocate_critic=false" in sets else "policy"
    assert {s.role for s in p.slots if s.pool == pool and s.bundle == 0} == first_bundle
    reward = p.role("reward")
    assert reward.cpus == (1.0 if where == "reward" else REWARD_CPU_SHARE)
    # Whoever shares a bundle with it leaves exactly its share (`plan_placement` checks the
    # loads fit); a reward of its own takes nothing from the policy.
    policy = p.role("policy").cpus + p.role("critic").cpus * (pool == "policy")
    assert policy == pytest.approx(1.0 - REWARD_CPU_SHARE * (where == "policy"))


@pytest.mark.parametrize(("sets", "error"), [
    ((POOL,), r"'placement\.reference': 'pool' holds the reference for the KL term, but "
              r"algo\.kl_coef is 0"),
    (("placement.reference=gpu",), r"'placement\.reference': unknown placement 'gpu'; "
                                   r"allowed: policy, pool"),
    (("algo.kl_coef=0.05", POOL, "placement.reference_dp=0"),
     r"'placement\.reference_dp': must be > 0"),
    (("algo.name=grpo", "placement.reward=critic"),
     r"'placement\.reward': 'critic' puts the rule reward on the critic's first bundle, but "
     r"grpo has no critic"),
])
def test_bad_placements_are_refused_in_one_line(sets: tuple[str, ...], error: str) -> None:
    with pytest.raises(ValueError, match=error) as err:
        with_overrides(preset("tiny-ppo"), list(sets))
    assert "\n" not in str(err.value)


# ---- the same run, wherever the reference and the reward are -----------------------------------

SAME = {
    # serially: ref_logp on the pool instead of after old_logp on the policy's ranks; at a
    # sampling temperature other than 1, which the pool's log-probs must apply as well
    "ppo, kl in the reward": ("tiny-ppo", "algo.kl_coef=0.05", "algo.kl_in=reward",
                              "rollout.temperature=0.8"),
    # LoRA: the pool holds the base weights, which the actor computes with adapters off
    "ppo, lora, kl in the loss": ("tiny-ppo-lora", "algo.kl_coef=0.05"),
    # concurrently: ref_logp beside old_logp, values and reward; the reward on its own pool
    "grpo, concurrent, reward pool": ("tiny-grpo", "algo.kl_coef=0.05", CONCURRENT,
                                      "placement.reward=pool"),
    # chapter 6's learner (no engine) beside a rollout pool: the same call, the same pool
    "ppo, one-step-off": ("tiny-ppo", "algo.kl_coef=0.05", "pipeline.mode=one_step_off",
                          "pipeline.rollout_dp=1"),
}


def assert_pool_is_colocated(cfg: PPOConfig, tmp_path: Path, *pooled: str) -> None:
    colocated = run(with_overrides(cfg, [f"train.out_dir={tmp_path / 'colocated'}"]))
    pool = run(with_overrides(cfg, [*pooled, f"train.out_dir={tmp_path / 'pool'}"]))
    assert pool[0] == colocated[0]
    assert "actor/ref_kl" in pool[0][-1]  # the reference was used, wherever it ran
    assert_same_batches(pool[1], colocated[1])
    assert_same_weights(pool[2], colocated[2])


@pytest.mark.parametrize("case", SAME)
def test_a_reference_pool_gives_the_colocated_run_bit_for_bit(case: str,
                                                              tmp_path: Path) -> None:
    name, *sets = SAME[case]
    cfg = short(name, *sets)
    pooled = [POOL, *(s for s in sets if s.startswith("placement.reward"))]
    base = with_overrides(cfg, ["placement.reward=policy"])
    assert_pool_is_colocated(base, tmp_path, *pooled)


def test_with_a_reference_pool_the_policy_holds_no_reference(tmp_path: Path) -> None:
    cfg = short("tiny-ppo", "algo.kl_coef=0.05", POOL, f"train.out_dir={tmp_path}")
    with Trainer(cfg) as trainer:
        trainer.start()
        metrics, batch = trainer.train_step(0)
        timeline = {lane.label for lane in trainer.timeline.lanes}
        with pytest.raises(WorkerError, match="no reference model here: the policy builds one "
                                              "only when algo.kl_coef > 0 and placement."
                                              "reference='policy'"):
            run_shards(trainer.policy, PolicyWorker.compute_logprobs,
                       reads(batch, LOGPROBS_READS), trainer.dispatch, reference=True)
    assert "reference[0]" in timeline and metrics["time/ref_logp"] > 0


@pytest.mark.slow
# Quiet, 48 s; beside two busy loops on a slow day it ran past the 180 s default
# (2026-11-28): the limit catches hangs, not a loaded machine.
@pytest.mark.timeout(400)
def test_pools_of_their_own_give_the_colocated_run_on_ray(tmp_path: Path,
                                                          ray_cluster: None) -> None:
    cfg = short("tiny-ppo", "algo.kl_coef=0.05", "train.steps=1", inprocess=False)
    assert_pool_is_colocated(cfg, tmp_path, POOL, "placement.reference_dp=2",
                             "placement.reward=pool", CONCURRENT)


def test_with_a_reference_pool_ref_logp_runs_beside_old_logp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each log-prob call waits at a barrier until the other has been issued too: serially
    # (or with the reference on the policy's ranks) the first would wait alone and break it.
    import avrid.ppo.driver.concurrent as concurrent
    import avrid.ppo.driver.reference as reference

    both = threading.Barrier(2, timeout=30)
    met: list[str] = []

    def meeting(real):  # noqa: ANN001, ANN202
        def run_shards(group, method, batch, *args, **kwargs):  # noqa: ANN001, ANN202
            if method.__name__ == "compute_logprobs":
                both.wait()
                met.append(method.__qualname__)
            return real(group, method, batch, *args, **kwargs)
        return run_shards

    monkeypatch.setattr(concurrent, "run_shards", meeting(concurrent.run_shards))
    monkeypatch.setattr(reference, "run_shards", meeting(reference.run_shards))
    cfg = short("tiny-grpo", "algo.kl_coef=0.05", POOL, CONCURRENT, f"train.out_dir={tmp_path}")
    with Trainer(cfg) as trainer:
        trainer.start()
        trainer.train_step(0)
    assert sorted(met) == ["PolicyWorker.compute_logprobs", "ReferenceWorker.compute_logprobs"]


def test_the_memory_estimate_puts_a_pooled_reference_on_gpus_of_its_own() -> None:
    from avrid.ppo.setup.memory_estimate import estimate

    cfg = with_overrides(preset("tiny-ppo"), ["algo.kl_coef=0.05"])
    colocated = estimate(cfg)
    pooled = estimate(with_overrides(cfg, [POOL, "placement.reference_dp=3"]))
    assert colocated.gpus == {"policy": 2} and pooled.gpus == {"policy": 2, "reference": 3}
    assert any(ph.parts.get("ref") for ph in colocated.phases if ph.gpu == "policy")
    assert not any(ph.parts.get("ref") for ph in pooled.phases if ph.gpu == "policy")
    (ref,) = [ph for ph in pooled.phases if ph.gpu == "reference"]
    # A whole copy per rank, in model.dtype (fp32 here): twice a 2-rank policy's half.
    (half,) = {ph.parts["ref"] for ph in colocated.phases if ph.name == "old log-probs"}
    assert ref.name == "ref log-probs" and ref.parts["ref"] == 2 * half
