"""GPU tier for chapter 5 (skips cleanly without CUDA or vllm): the PPO/GRPO loop on real GPUs.

- one GPU: the tiny PPO run with the torch engine on CUDA, one rank per role;
- two GPUs: the same with the actor and the critic FSDP2-sharded over dp = 2, over NCCL;
  and chapter 6's one-step-off with the rollout worker on the second GPU (NCCL push);
- one GPU + vllm: a short GSM8K GRPO run served by vLLM, with a tiny random Qwen2 and a tiny
  word-level tokenizer written into tmp_path in code (no download); the same run on vLLM's
  CPU build (marked vllm only) runs in the vllm tier here;
- optionally, the `qwen-gsm8k` preset on a real checkpoint and data file named by
  ``AVRID_QWEN_PATH`` and ``AVRID_GSM8K_PATH`` (skipped, saying so, when they are unset).

Every run goes through `avrid.ppo.driver.run.train`, so validation, the metrics file, a checkpoint
(a collective over the group) and the plots are exercised too. What this file does not test:
the RL math and the loop's determinism and resume (CPU tests cover those, device-independent),
or speed. Configs are kept small: seconds of GPU work, most of a test's time is start-up.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from avrid.ppo.driver.run import train
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

pytestmark = [pytest.mark.chapter(5), pytest.mark.usefixtures("ray_cluster")]

# The tiny PPO preset cut to one step of 8 prompts x 4 responses on CUDA with the torch engine.
TINY_CUDA = ("placement.device=cuda", "rollout.engine=torch", "train.steps=1",
             "train.prompts_per_step=8", "algo.responses_per_prompt=4",
             "train.mini_batch_size=16", "train.val_prompts=16", "train.progress=false")


def metric_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_tiny_cuda_run(out: Path, dp: int) -> None:
    config = with_overrides(preset("tiny-ppo"), [
        *TINY_CUDA, f"placement.actor_dp={dp}", f"placement.critic_dp={dp}",
        f"train.out_dir={out}"])
    summary = train(config)
    rows = metric_lines(out)
    assert [r["step"] for r in rows] == [0, 1]  # the untrained validation, then the step
    step = rows[1]
    # float32 on both sides, the same weights (the engine's copy and the FSDP shards): the
    # rollout's log-probs are the trainer's up to kernel rounding.
    assert step["rollout/logprob_gap"] < 1e-3, step["rollout/logprob_gap"]
    for key in ("actor/loss", "critic/loss", "actor/grad_norm", "critic/grad_norm"):
        assert math.isfinite(step[key]), (key, step[key])
    if dp > 1:  # each rank received the other ranks' shards over NCCL
        assert step["sync/bytes_per_rank"] > 0
    assert math.isfinite(summary.final_val_reward)
    assert (out / "checkpoints").is_dir()


@pytest.mark.gpu(count=1, duration_s=120, memory_gb=4)
@pytest.mark.timeout(600)
def test_tiny_ppo_step_on_one_gpu(tmp_path: Path) -> None:
    check_tiny_cuda_run(tmp_path / "run", dp=1)


@pytest.mark.gpu(count=2, duration_s=150, memory_gb=4)
@pytest.mark.timeout(600)
def test_tiny_ppo_step_fsdp2_over_two_gpus_with_nccl(tmp_path: Path) -> None:
    check_tiny_cuda_run(tmp_path / "run", dp=2)


@pytest.mark.gpu(count=2, duration_s=150, memory_gb=4)
@pytest.mark.timeout(600)
def test_one_step_off_pushes_over_nccl_to_a_rollout_gpu(tmp_path: Path) -> None:
    """Chapter 6 on GPUs: the trainer on one GPU, a rollout worker on another, weights
    pushed between them over NCCL (a group of their own) and fingerprint-checked."""
    from avrid.pipeline import train as pipeline_train

    out = tmp_path / "run"
    config = with_overrides(preset("tiny-ppo"), [
        *TINY_CUDA, "train.steps=3", "placement.actor_dp=1", "placement.critic_dp=1",
        "pipeline.mode=one_step_off", f"train.out_dir={out}"])
    pipeline_train(config)
    steps = metric_lines(out)[1:]
    assert [r["pipeline/staleness_max"] for r in steps] == [0.0, 1.0, 1.0]
    assert all(r["sync/bytes_per_rank"] > 0 for r in steps)


# --- GSM8K GRPO with vLLM, on a tiny model and tokenizer written in code ---

WORDS = ("<pad>", "<eos>", "<unk>", "user", "assistant", ":", "####", *"0123456789",
         "Tom", "has", "apples", "and", "more", ".", "How", "many", "?", "answer")
PROBLEMS = [{"question": f"Tom has {a} apples and {b} more . How many ?",
             "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a, b in
            [(1, 2), (3, 4), (2, 2), (5, 1), (4, 4), (6, 3), (7, 1), (2, 8), (3, 3), (9, 0)]]
VOCAB = 128  # the words above, then fillers: the model's vocabulary is the tokenizer's size


def save_tiny_tokenizer(path: Path) -> int:
    """A word-level tokenizer with a chat template (no download); returns its size."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*WORDS, *(f"w{i}" for i in range(VOCAB - len(WORDS)))]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    # No decoder: tokens are joined with spaces, so "#### 7" decodes as it was written (a
    # WordPiece decoder would read "##" as a continuation prefix and eat the marker).
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
    fast.save_pretrained(str(path))
    return len(fast)


def save_tiny_model(path: Path, vocab: int) -> None:
    """A random Qwen2 with head dim 64 (every vLLM attention backend supports it) and room
    for prompt + response positions, saved like a downloaded checkpoint."""
    from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy

    spec = TinyModelSpec(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_positions=256)
    build_tiny_policy(spec, seed=0, eos_token_id=1, pad_token_id=0).save_pretrained(path)


def gsm8k_run_config(model: Path, data: Path, out: Path, *extra: str) -> PPOConfig:
    """The `qwen-gsm8k` preset (GRPO, KL in the loss, vLLM, chat template) on a short budget."""
    return with_overrides(preset("qwen-gsm8k"), [
        f"model.path={model}", f"task.path={data}", f"train.out_dir={out}",
        "train.steps=2", "train.prompts_per_step=4", "algo.responses_per_prompt=4",
        "train.mini_batch_size=16", "train.val_every=1", "train.val_prompts=4",
        "train.checkpoint_every=0", "train.progress=false", *extra])


@pytest.mark.vllm
@pytest.mark.timeout(900)  # vLLM's start-up (engine core, CUDA graphs) dominates
@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=pytest.mark.gpu(count=1, duration_s=240)),
    # The same preset and code path on vLLM's CPU build: bf16, chat template, KL, GRPO.
    "cpu"])
def test_gsm8k_grpo_with_vllm_on_a_tiny_model(tmp_path: Path, device: str) -> None:
    model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
    # Two directories: beside a Qwen2 config.json, transformers' AutoTokenizer picks the Qwen2
    # tokenizer class by model type, which re-reads a word-level vocabulary as byte-level BPE
    # and garbles it. A real checkpoint ships its own Qwen2 tokenizer, so it does not care.
    save_tiny_model(model, save_tiny_tokenizer(tokenizer))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    out = tmp_path / "run"
    # Prompts are ~30 tokens with the template and the instruction; 96 + 16 <= 256 positions.
    train(gsm8k_run_config(model, data, out, f"model.tokenizer={tokenizer}",
                           "rollout.max_prompt_tokens=96",
                           "rollout.max_response_tokens=16",
                           "rollout.gpu_memory_utilization=0.3",
                           f"placement.device={device}", "placement.cpus_per_worker=1"))
    rows = metric_lines(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert math.isfinite(row["rollout/logprob_gap"]), row["rollout/logprob_gap"]
        assert math.isfinite(row["actor/loss"]) and math.isfinite(row["actor/ref_kl"])
        assert 0.0 <= row["train/reward"] <= 1.0


# --- optional: the real checkpoint and data, from the environment ---


REAL_MODEL = os.environ.get("AVRID_QWEN_PATH")
REAL_DATA = os.environ.get("AVRID_GSM8K_PATH")


# skipif, not a skip inside: decided before the Ray fixture starts anything.
@pytest.mark.skipif(not (REAL_MODEL and REAL_DATA), reason=(
    "set AVRID_QWEN_PATH (a local Qwen2.5-0.5B-Instruct directory) and AVRID_GSM8K_PATH "
    "(a local GSM8K .jsonl or .parquet) to run the real-checkpoint test"))
@pytest.mark.gpu(count=1, duration_s=600)
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_qwen_gsm8k_preset_on_a_real_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    summary = train(gsm8k_run_config(Path(str(REAL_MODEL)), Path(str(REAL_DATA)), out,
                                     "train.prompts_per_step=8", "train.mini_batch_size=32",
                                     "rollout.max_response_tokens=300", "train.val_prompts=32"))
    rows = metric_lines(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        # bfloat16 on both sides: vLLM's kernels and the trainer's round differently, but a
        # mean gap near 0.1 would mean they compute different functions (template, temperature).
        assert row["rollout/logprob_gap"] < 0.1, row["rollout/logprob_gap"]
        assert math.isfinite(row["actor/loss"])
    # An instruction-tuned 0.5B model solves a good share of GSM8K greedily; none right out of
    # 32 would point at the prompt, the chat template or the reward, not at the model.
    assert summary.initial_val_reward > 0.0
