"""`avrid ppo --estimate-memory` for the layouts issue 41 found it wrong about: the pipeline
modes (a trainer GPU without an engine, a rollout GPU of its own, the push's buckets), the
setup that builds the models (offloaded: one FSDP unit on the GPU at a time), LoRA (gradients
and AdamW for the adapters only), the suggestions' order and ``--gpus``. The figures are the
code's sizes, worked out by hand here from Qwen2.5-7B's shape.

Not here: the step phases' formulas (test_ppo_memory_estimate.py), the engine's sleep level
(test_ppo_engine_sleep.py), the setup itself (test_ppo_offload_setup.py).
"""

from __future__ import annotations

import math
import re

import pytest

from avrid.cli import main
from avrid.ppo.setup.memory_estimate import GiB, estimate
from avrid.ppo.setup.memory_pipeline import PUSH_BUCKET_BYTES, PUSH_BUCKETS_HELD
from avrid.ppo.setup.memory_report import _ladder, suggest
from avrid.ppo.setup.memory_shapes import KNOWN_SHAPES, adapter_params
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.rollout import COLOCATED_GPU_SHARE, OWN_POOL_GPU_SHARE

pytestmark = pytest.mark.chapter(5)

SEVEN_B = "model.path=/nonexistent/Qwen2.5-7B-Instruct"
Q7 = KNOWN_SHAPES["qwen2.5-7b"]
ROOT_7B = 2 * Q7.vocab * Q7.hidden + Q7.hidden  # embedding, untied head, final norm
ONE_STEP_OFF = ["pipeline.mode=one_step_off", "placement.actor_dp=4"]


def qwen7b(*sets: str):  # noqa: ANN201 (PPOConfig)
    return with_overrides(preset("qwen-gsm8k"), [SEVEN_B, *sets])


def phases(config, gpu: str, **kwargs) -> dict:  # noqa: ANN001
    return {p.name: p.parts for p in estimate(config, **kwargs).phases if p.gpu == gpu}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    try:
        main(["ppo", "--preset", "qwen-gsm8k", "--estimate-memory", "--set", SEVEN_B, *args])
    except SystemExit as done:
        assert not done.code, capsys.readouterr().err
    return capsys.readouterr().out


def row(out: str, table: str, name: str) -> dict[str, float]:
    """One printed row of one GPU kind's table, by column."""
    block = out.split(f": {table} rank")[1]
    lines = block.splitlines()
    head = lines[1].split()[2:]
    cells = next(line for line in lines if line.startswith(name + " ")).removeprefix(name)
    return dict(zip(head, map(float, cells.split()), strict=True))


def test_one_step_off_puts_no_engine_on_the_trainer_and_models_the_rollout_gpu() -> None:
    est = estimate(qwen7b(*ONE_STEP_OFF), gpu_bytes=80 * GiB)
    assert est.gpus == {"policy": 4, "rollout": 4}
    trainer = {p.name: p.parts for p in est.phases if p.gpu == "policy"}
    assert "generate" not in trainer and all(p["engine"] == 0 for p in trainer.values())
    # Rank 0's push: two 64 MiB buckets, and the largest fp32 tensor gathered plus its cast.
    largest = max(Q7.vocab * Q7.hidden, Q7.hidden * Q7.intermediate)
    assert trainer["weight push (rank 0)"]["sync"] == (PUSH_BUCKETS_HELD * PUSH_BUCKET_BYTES
                                                       + (4 + 2) * largest)
    rollout = {p.name: p.parts for p in est.phases if p.gpu == "rollout"}
    share = int(OWN_POOL_GPU_SHARE * 80 * GiB)
    assert rollout["generate"]["engine"] == rollout["receive"]["engine"] == share
    # Three buckets and the embedding (larger than a bucket: put together whole), no model copy.
    received = 3 * PUSH_BUCKET_BYTES + 2 * Q7.vocab * Q7.hidden
    assert rollout["receive"]["sync"] == received
    assert est.peak() == share + received + GiB <= 80 * GiB


def test_the_push_bucket_is_the_pipelines() -> None:
    from avrid.pipeline.transfer import BUCKET_BYTES, POSTED_BUCKETS

    assert PUSH_BUCKET_BYTES == BUCKET_BYTES and PUSH_BUCKETS_HELD == POSTED_BUCKETS


def test_the_7b_one_step_off_table_shows_a_rollout_gpu_and_fits(
        capsys: pytest.CaptureFixture[str]) -> None:
    out = cli(capsys, *[a for s in ONE_STEP_OFF for a in ("--set", s)], "--gpus", "8")
    print(out)
    assert "per GPU: rollout rank (one of 4)" in out and "4 policy + 4 rollout GPUs" in out
    assert "fits with" in out and "does NOT fit" not in out
    assert row(out, "rollout", "receive")["engine"] == pytest.approx(0.85 * 80, abs=0.01)
    out = cli(capsys, *[a for s in ONE_STEP_OFF for a in ("--set", s)], "--gpus", "6")
    assert "does NOT fit: the layout takes 8 GPUs (4 policy + 4 rollout GPUs), --gpus gives 6" \
        in out


def test_setup_holds_one_unit_offloaded_and_the_whole_model_otherwise() -> None:
    off = phases(qwen7b("memory.cpu_offload=true"), "policy")["setup"]
    # dp 1: the root unit (the largest) whole on the GPU, beside its shard; vLLM's share.
    assert off["params"] == 4 * (ROOT_7B + ROOT_7B) and off["ref"] == 0
    assert off["engine"] == int(COLOCATED_GPU_SHARE * 80 * GiB)
    whole = phases(qwen7b(), "policy")["setup"]
    assert whole["params"] == 4 * (Q7.params + ROOT_7B) and whole["ref"] == 2 * Q7.params
    assert whole["engine"] == off["engine"]
    # Sharded from a checkpoint on Ray (meta init): the shards and one broadcast tensor.
    meta = phases(qwen7b("placement.actor_dp=4"), "policy")["setup"]
    assert meta["params"] == 4 * (math.ceil(Q7.params / 4) + Q7.vocab * Q7.hidden)
    # The pipeline's trainer builds no engine.
    assert phases(qwen7b(*ONE_STEP_OFF), "policy")["setup"]["engine"] == 0


def test_the_offload_table_shows_its_setup(capsys: pytest.CaptureFixture[str]) -> None:
    out = cli(capsys, "--set", "memory.cpu_offload=true")
    print(out)
    setup = row(out, "policy", "setup")
    assert setup["params"] == pytest.approx(8 * ROOT_7B / GiB, abs=0.01)
    assert "setup moves one FSDP unit at a time to the GPU" in out


def test_lora_trains_adapters_only() -> None:
    adapters = adapter_params(Q7, qwen7b("lora.rank=16").lora)
    assert adapters == 28 * 16 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))
    full = phases(qwen7b(), "policy", gpu_bytes=80 * GiB)["actor update"]
    lora = phases(qwen7b("lora.rank=16"), "policy", gpu_bytes=80 * GiB)["actor update"]
    assert full["optim"] == 8 * Q7.params and lora["optim"] == 8 * adapters
    assert full["grads"] == 4 * Q7.params + 2 * Q7.layer_params
    assert lora["grads"] == 4 * adapters + 2 * (adapters // Q7.layers)
    assert lora["ref"] == 0 < full["ref"]  # the reference is the actor with adapters off
    some = qwen7b("lora.rank=8", "lora.target_modules=q_proj,v_proj").lora
    assert adapter_params(Q7, some) == 28 * 8 * ((3584 + 3584) + (3584 + 512))
    with pytest.raises(ValueError, match="lora.target_modules: qkv is not a linear layer.*"
                                         "allowed: all-linear or any of q_proj"):
        adapter_params(Q7, qwen7b("lora.rank=8", "lora.target_modules=qkv").lora)


def test_the_lora_table_differs_in_gradients_and_adamw(
        capsys: pytest.CaptureFixture[str]) -> None:
    full, lora = cli(capsys), cli(capsys, "--set", "lora.rank=16")
    print(lora)
    a, b = row(full, "policy", "actor update"), row(lora, "policy", "actor update")
    assert b["grads"] < a["grads"] / 100 and b["optim"] < a["optim"] / 100
    assert b["activ"] == a["activ"] and b["logits"] == a["logits"]
    assert "LoRA rank 16 (all-linear)" in lora and "40.4M adapter parameters" in lora


def test_the_suggestions_try_cheap_knobs_before_more_gpus() -> None:
    config = qwen7b("train.gradient_checkpointing=false")
    ladder = _ladder(config, None)
    assert ladder[0] == ["train.gradient_checkpointing=true"]
    first = {k: next(i for i, s in enumerate(ladder) if any(x.startswith(k) for x in s))
             for k in ("train.micro_batch_tokens", "lora.rank", "memory.cpu_offload",
                       "placement.actor_dp")}
    assert (first["train.micro_batch_tokens"] < first["lora.rank"]
            < first["memory.cpu_offload"] < first["placement.actor_dp"])
    # 7B full fine-tuning on one 80 GB GPU: LoRA there, not eight GPUs.
    sets, _ = suggest(qwen7b(), 80 * GiB)
    assert sets == ["lora.rank=16"]
    # --gpus bounds the ranks: one GPU, no LoRA wanted: offload on that GPU or nothing.
    ladder = _ladder(qwen7b("lora.rank=16"), 1)
    assert not any(s.startswith("placement.actor_dp") for sets in ladder for s in sets)


def test_a_full_fine_tune_that_does_not_fit_is_offered_the_same_run_and_lora_apart(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Offload keeps the run as configured; LoRA trains something else: both are offered,
    the same run first, LoRA labelled as the different run it is."""
    tries = [line for line in cli(capsys, "--gpus", "1").splitlines()
             if line.startswith("  try (")]
    assert len(tries) == 2, tries
    assert "--set memory.cpu_offload=true" in tries[0] and "lora" not in tries[0]
    assert "--set lora.rank=16" in tries[1] and "a different run" in tries[1]
    # A LoRA run is offered no LoRA.
    tries = [line for line in cli(capsys, "--gpus", "1", "--set", "lora.rank=16",
                                  "--set", "train.micro_batch_tokens=131072").splitlines()
             if line.startswith("  try (")]
    assert tries and not any("a different run" in t for t in tries), tries


def test_gpus_must_be_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "eight", "-1"):
        with pytest.raises(SystemExit):
            main(["ppo", "--preset", "qwen-gsm8k", "--estimate-memory", "--gpus", bad])
        assert "allowed: a whole number >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ppo", "--preset", "qwen-gsm8k", "--gpus", "8"])
    assert re.search(r"--gpus counts the GPUs of --estimate-memory", capsys.readouterr().err)
