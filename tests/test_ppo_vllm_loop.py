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

pytestmark = [pytest.mark.chapter(5), pytest.mark.vllm, pytest.mark.usefixtures("ray_cluster")]


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


def test_a_lora_actor_syncs_its_merged_weights_into_vllm(tmp_path: Path) -> None:
    """LoRA with lora.sync=merged: vLLM is sent W + (alpha / r) B A each step, fingerprint-
    checked, and its log-probs are the adapted trainer's (the adapters do move: B != 0)."""
    run = train(tiny_vllm(tmp_path / "lora", "lora.rank=8", "lora.sync=merged",
                          "train.actor_lr=1e-2"))
    for row in run.rows[1:]:
        assert row["rollout/logprob_gap_max"] < 1e-4
        assert row["sync/bytes_per_rank"] > 0
    assert (tmp_path / "lora" / "export" / "adapter" / "adapter_config.json").is_file()


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


def test_vllm_in_a_rollout_pool_k0_is_the_hybrid_run_and_one_step_off_is_one_stale(
        tmp_path: Path) -> None:
    """Chapter 6 with the real engine: two rollout workers, each its own vLLM, fed by pushes
    across pools (chapter 4's plan, fingerprints checked on the driver). K = 0 reproduces the
    hybrid-engine run metric for metric; one-step-off is one version stale after step 1."""
    from avrid.pipeline import train as pipeline_train

    hybrid = train(tiny_vllm(tmp_path / "hybrid"))
    k0 = pipeline_train(tiny_vllm(tmp_path / "k0", "pipeline.mode=async",
                                  "pipeline.max_staleness=0"))
    pipelined = ("pipeline/", "sync/")  # the pipeline's own metrics, a push's bytes
    assert ([{k: v for k, v in r.items() if not k.startswith(pipelined)}
             for r in algorithmic(k0.rows)] == algorithmic(hybrid.rows))
    off = pipeline_train(tiny_vllm(tmp_path / "off", "pipeline.mode=one_step_off"))
    steps = off.rows[1:]
    assert [r["pipeline/staleness_max"] for r in steps] == [0.0, 1.0, 1.0]
    assert all(r["sync/bytes_per_rank"] > 0 for r in steps)
