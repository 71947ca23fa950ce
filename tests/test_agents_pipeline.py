"""Chapter 7 in chapter 6's modes: a rollout pool running episodes. K = 0 is the synchronous
run of episodes bit for bit; one-step-off trains on episodes one version old, every policy
token stamped with the version that generated it, and nothing is dropped."""

from __future__ import annotations

import pytest
import torch

from avrid.agents import AgentPipelinedTrainer, AgentTrainer, make_trainer
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

pytestmark = pytest.mark.chapter(7)

MACHINE = ("time/", "perf/", "sync/", "pipeline/", "agent/engine_busy_s", "agent/rollout_s",
           "agent/tool_s")
"""Timings (and the pipeline's own metrics) differ between the two loops by design."""


def config(*extra: str) -> PPOConfig:
    # turn_sync: which episodes share an engine call must not depend on tool timing, so
    # two runs can be compared bit for bit.
    return with_overrides(preset("tiny-agent"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.prompts_per_step=4", "algo.responses_per_prompt=4", "train.mini_batch_size=16",
        "train.val_prompts=8", "train.steps=3", "rollout.agent_schedule=turn_sync", *extra])


def run(cfg: PPOConfig) -> tuple[list[dict], list, object]:
    rows, batches = [], []
    with make_trainer(cfg) as tr:
        tr.start()
        rows.append(tr.validate())
        for step in range(cfg.train.steps):
            metrics, batch = tr.train_step(step)
            rows.append(metrics)
            batches.append(batch)
        rows.append(tr.validate())
        weights = tr.state().weights
    return rows, batches, (tr, weights)


def algorithmic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MACHINE)} for r in rows]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_k0_episodes_are_the_sync_run_bit_for_bit(algo: str) -> None:
    sync_rows, sync_batches, (sync_tr, sync_w) = run(config(f"algo.name={algo}"))
    k0_rows, k0_batches, (k0_tr, k0_w) = run(config(
        f"algo.name={algo}", "pipeline.mode=async", "pipeline.max_staleness=0",
        "pipeline.rollout_dp=1"))
    assert type(sync_tr) is AgentTrainer and type(k0_tr) is AgentPipelinedTrainer
    assert algorithmic(k0_rows) == algorithmic(sync_rows)
    for a, b in zip(sync_batches, k0_batches, strict=True):
        for name in ("tokens", "action_mask", "token_version", "rollout_logp"):
            assert torch.equal(a.packed[name].values, b.packed[name].values), name
    assert all(torch.equal(sync_w[m][n], k0_w[m][n]) for m in sync_w for n in sync_w[m])
    assert [r["pipeline/staleness_token_max"] for r in k0_rows[1:-1]] == [0.0] * 3


def test_one_step_off_episodes_are_one_version_old_token_by_token() -> None:
    rows, batches, _ = run(config("pipeline.mode=one_step_off", "pipeline.rollout_dp=1"))
    steps = rows[1:-1]
    # Step 0 trains on the initial weights' episodes; from step 1 on, on episodes made by the
    # weights one update behind — every policy token says so, and no episode is dropped.
    assert [r["pipeline/staleness_token_max"] for r in steps] == [0.0, 1.0, 1.0]
    assert [r["pipeline/spanning_share"] for r in steps] == [0.0] * 3  # pushes waited
    for half in ("short", "long"):  # a batch of one version is as old at every length
        assert [r[f"pipeline/staleness_token_mean_{half}"] for r in steps] == [0.0, 1.0, 1.0]
    for step, batch in enumerate(batches):
        mask = batch.packed["action_mask"].values == 1
        versions = batch.packed["token_version"].values
        assert set(versions[mask].tolist()) == {max(0, step - 1)}
        assert len(batch) == 16


def test_concurrent_phases_on_episodes_are_the_serial_run_bit_for_bit() -> None:
    # `train.concurrent_phases` keeps chapter 7's scoring: the environment's, no reward call.
    serial_rows, serial_batches, (_, serial_w) = run(config("train.steps=2"))
    rows, batches, (tr, weights) = run(config("train.steps=2", "train.concurrent_phases=true"))
    assert type(tr) is AgentTrainer
    assert algorithmic(rows) == algorithmic(serial_rows)
    for a, b in zip(serial_batches, batches, strict=True):
        assert list(a.packed) == list(b.packed) and list(a.scalars) == list(b.scalars)
        assert all(torch.equal(a.packed[n].values, b.packed[n].values) for n in a.packed)
        assert all(torch.equal(a.scalars[n], b.scalars[n]) for n in a.scalars)
    assert all(torch.equal(serial_w[m][n], weights[m][n]) for m in weights for n in weights[m])
