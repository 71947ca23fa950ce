"""The PPO loop with the real vLLM engine in every policy rank (`vllm` tier: `make test-vllm`).

`tiny-ppo-vllm` on tiny budgets, on Ray with two policy ranks (each its own process, each its
own in-process vLLM engine): every step loads the actor's weights into both engines through
chapter 4 and fingerprint-checks them (a mismatch raises and fails the run), and the rollout's
log-probs must equal the trainer's recomputation. A resumed run must generate its first step
with the checkpoint's weights: vLLM starts from random weights (``load_format="dummy"``) and
is loaded, checked, before anything is generated; the resumed run then matches an
uninterrupted one metric for metric.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from avrid.ppo.driver.run import train
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from tests.test_ppo_trainer import algorithmic

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("ray_cluster")]


def tiny_vllm(out: Path, *extra: str) -> PPOConfig:
    return with_overrides(preset("tiny-ppo-vllm"), [
        "train.steps=3", "train.prompts_per_step=8", "algo.responses_per_prompt=4",
        "train.mini_batch_size=16", "train.val_prompts=16", "train.val_every=2",
        "train.progress=false", "train.checkpoint_every=1", f"train.out_dir={out}", *extra])


def test_vllm_rollouts_match_the_trainer_and_sync_every_step(tmp_path: Path) -> None:
    run = train(tiny_vllm(tmp_path / "run"))
    steps = run.rows[1:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        # fp32 on both sides; measured max 1e-6 on CPU. A stale engine would show ~1e-1.
        assert row["rollout/logprob_gap_max"] < 1e-4
        assert row["sync/bytes_per_rank"] > 0  # a sync ran (and its check passed) each step
    assert (tmp_path / "run" / "export" / "config.json").is_file()


def test_a_resumed_vllm_run_generates_with_the_resumed_weights(tmp_path: Path) -> None:
    full = train(tiny_vllm(tmp_path / "full"))
    out = tmp_path / "resumed"
    train(tiny_vllm(out, "train.steps=1"))
    resumed = train(tiny_vllm(out, "train.resume=true"))
    # Step 2 is the first one generated after the restart: with the base weights in vLLM
    # its samples, rewards and losses would all differ from the uninterrupted run's. (Step 1
    # differs only by the validation the 1-step run did at its end.)
    assert [r["step"] for r in resumed.rows] == [0, 1, 2, 3]
    assert algorithmic(resumed.rows)[2:] == algorithmic(full.rows)[2:]
    step1 = [{k: v for k, v in r.items() if not k.startswith("val/")}
             for r in (algorithmic(resumed.rows)[1], algorithmic(full.rows)[1])]
    assert step1[0] == step1[1]
