"""The seed's three layouts as config files (`chapters/ch05_ppo/configs/layout_*.yaml`, read as
``avrid ppo --config FILE`` reads them): each places every role in the pool its layout says
(DeepSpeed-Chat: all on the policy's bundles; OpenRLHF: each model on bundles of its own;
NeMo-Aligner: actor + reference on the policy's, critic + rule reward on the critic's), and
each runs a step; the three differ in placement only, so that step's metrics are the same
on all three, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from avrid.ppo.driver.placement import build_placement
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.config_file import read_config
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.tokenizer import make_tokenizer
from avrid.workers import PlacementPlan
from tests.test_ppo_trainer import algorithmic

pytestmark = pytest.mark.chapter(5)

CONFIGS = Path(__file__).resolve().parents[1] / "chapters" / "ch05_ppo" / "configs"

LAYOUTS = {
    # role -> the pool its ranks are in
    "deepspeed_chat": {"policy": "policy", "critic": "policy", "reward": "policy"},
    "openrlhf": {"policy": "policy", "critic": "critic", "reference": "reference",
                 "reward": "reward"},
    "nemo_aligner": {"policy": "policy", "critic": "critic", "reward": "critic"},
}


def layout(name: str) -> PPOConfig:
    return read_config(CONFIGS / f"layout_{name}.yaml")


def plan(cfg: PPOConfig) -> PlacementPlan:
    task = load_task(cfg.task.name, **cfg.task.kwargs)
    return build_placement(cfg, make_tokenizer(cfg, task), max_response_tokens=4)


def test_the_layout_files_are_the_three_of_the_seed() -> None:
    assert sorted(p.name for p in CONFIGS.glob("layout_*.yaml")) == sorted(
        f"layout_{name}.yaml" for name in LAYOUTS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_puts_each_role_in_its_pool(name: str) -> None:
    cfg = layout(name)
    p = plan(cfg)
    assert {r.role: {s.pool for s in p.slots_of(r.role)} for r in p.roles} == {
        role: {pool} for role, pool in LAYOUTS[name].items()}
    # The reference: in the policy's processes, or (OpenRLHF) ranks of its own.
    assert cfg.algo.kl_coef > 0
    assert (cfg.placement.reference == "pool") == ("reference" in LAYOUTS[name])
    # Who shares a bundle with whom: the layout's picture, bundle by bundle.
    first = {pool: {s.role for s in p.slots if s.pool == pool and s.bundle == 0}
             for pool in {s.pool for s in p.slots}}
    expected = {
        "deepspeed_chat": {"policy": {"policy", "critic", "reward"}},
        "openrlhf": {"policy": {"policy"}, "critic": {"critic"},
                     "reference": {"reference"}, "reward": {"reward"}},
        "nemo_aligner": {"policy": {"policy"}, "critic": {"critic", "reward"}},
    }[name]
    assert first == expected


def test_the_layouts_differ_in_placement_alone() -> None:
    # Everything but where the roles run (and whether the phases overlap) is one config.
    def algorithm(cfg: PPOConfig) -> PPOConfig:
        return with_overrides(cfg, ["placement.colocate_critic=true",
                                    "placement.reference=policy", "placement.reward=policy",
                                    "placement.reference_dp=1", "reward_model.placement=pool",
                                    "train.out_dir=runs/x",
                                    "train.concurrent_phases=false"])

    first, *others = [algorithm(layout(name)) for name in LAYOUTS]
    assert all(cfg == first for cfg in others)


def test_each_layout_runs_a_step_with_the_same_metrics(tmp_path: Path) -> None:
    rows = {}
    for name in LAYOUTS:
        cfg = with_overrides(layout(name), [
            "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
            "placement.reference_dp=1", "train.steps=1", "train.prompts_per_step=4",
            "algo.responses_per_prompt=4", "train.mini_batch_size=16", "train.progress=false",
            f"train.out_dir={tmp_path / name}"])
        with Trainer(cfg) as trainer:
            trainer.start()
            metrics, _ = trainer.train_step(0)
        assert metrics["actor/ref_kl"] == 0.0  # the untrained actor is its reference
        rows[name] = algorithmic([metrics])
    first, *others = rows.values()
    assert all(row == first for row in others)
