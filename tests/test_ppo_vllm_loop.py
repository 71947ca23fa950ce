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
import torch

from avrid.ppo.driver.run import RunSummary, train
from avrid.ppo.outputs.checkpoint import latest_checkpoint, load_checkpoint
from avrid.ppo.outputs.shards import read_model_weights
from avrid.ppo.roles import lora
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from tests.test_ppo_trainer import algorithmic

pytestmark = [pytest.mark.chapter(5), pytest.mark.vllm, pytest.mark.usefixtures("ray_cluster"),
              pytest.mark.timeout(500)]
"""500 s each, not the suite's 180: whole vLLM runs on Ray. Measured alone on a quiet 2-core
Xeon (2026-11-28), the two LoRA runs took 165 s and 159 s (86-128 s on the machine of issue
44's report); in a full `make test-vllm` on the same machine both ran past 180 s. With the
tier in two processes (`make test-vllm`, JOBS=2) the slowest took 151 s quiet and 306 s
beside two busy loops: 500 s leaves a 39 % margin there, and still bounds a hang. The runs
several tests compare against (the plain hybrid run, the LoRA hybrid run) are made once per
module (`hybrid`, `lora_hybrid`), which takes three whole runs out of the tier, and each run
is two steps (resumed after the first: all the resume tests need; the one-step-off runs take
three)."""

LORA = ("lora.rank=8", "train.actor_lr=1e-2")


def tiny_vllm(out: Path, *extra: str) -> PPOConfig:
    return with_overrides(preset("tiny-ppo-vllm"), [
        "train.steps=2", "train.prompts_per_step=8", "algo.responses_per_prompt=4",
        "train.mini_batch_size=16", "train.val_prompts=16", "train.val_every=2",
        "train.progress=false", "train.checkpoint_every=1", f"train.out_dir={out}", *extra])


@pytest.fixture(scope="module")
def hybrid(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> RunSummary:
    """The hybrid-engine run on `tiny_vllm`'s budget, made once for the module's tests."""
    return train(tiny_vllm(tmp_path_factory.mktemp("hybrid")))


@pytest.fixture(scope="module")
def lora_hybrid(ray_session: None,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[RunSummary, Path]:
    """The hybrid-engine LoRA run (adapter sync) and its directory, made once."""
    out = tmp_path_factory.mktemp("adapter")
    return train(tiny_vllm(out, *LORA)), out


def test_vllm_rollouts_match_the_trainer_and_sync_every_step(hybrid: RunSummary) -> None:
    run = hybrid
    steps = run.rows[1:]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        # fp32 on both sides; measured max 1e-6 on CPU. A stale engine would show ~1e-1.
        assert row["rollout/logprob_gap_max"] < 1e-4
        assert row["sync/bytes_per_rank"] > 0  # a sync ran (and its check passed) each step
    assert (Path(run.out_dir) / "export" / "config.json").is_file()


def test_lora_adapters_served_to_vllm_train_as_the_merged_sync_and_resume_exactly(
        lora_hybrid: tuple[RunSummary, Path], tmp_path: Path) -> None:
    """LoRA on two policy ranks (FSDP2): with lora.sync=adapter each engine holds the base
    once and is sent only the gathered adapters, read back and fingerprint-checked each
    step; with lora.sync=merged it is sent W + (alpha / r) B A. Both give the trainer's
    log-probs and the very same run (same tokens, rewards, losses); the adapter sync loads
    about a tenth of the bytes on this tiny model. A run stopped after step 1 and resumed
    is the uninterrupted one, down to the adapters' bits."""
    lo = LORA
    adapter, adapter_dir = lora_hybrid
    merged = train(tiny_vllm(tmp_path / "merged", *lo, "lora.sync=merged"))
    for a, m in zip(adapter.rows[1:], merged.rows[1:], strict=True):
        assert a["rollout/logprob_gap_max"] < 1e-4 and m["rollout/logprob_gap_max"] < 1e-4
        assert 0 < 5 * a["sync/engine_bytes"] < m["sync/engine_bytes"]  # measured: 10.5 %
    # The engines' log-probs differ from each other in the last bits (LoRA kernels vs one
    # matmul), so their gap to the trainer does too; everything the run computed is equal.
    assert [{k: v for k, v in r.items() if not k.startswith("rollout/logprob_gap")}
            for r in algorithmic(adapter.rows)] == [
        {k: v for k, v in r.items() if not k.startswith("rollout/logprob_gap")}
        for r in algorithmic(merged.rows)]
    assert adapter.rows[-1]["actor/grad_norm"] > 0  # the adapters did train

    out = tmp_path / "resumed"
    train(tiny_vllm(out, *lo, "train.steps=1"))
    resumed = train(tiny_vllm(out, *lo, "train.resume=true"))
    assert algorithmic(resumed.rows)[2:] == algorithmic(adapter.rows)[2:]
    wa, wb = (read_model_weights(load_checkpoint(latest_checkpoint(d / "checkpoints"))
                                 .sharded["actor"]) for d in (adapter_dir, out))
    assert wa and all(lora.is_adapter(n) for n in wa)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    served_export_equals_merged_export(adapter_dir, tiny_vllm(tmp_path / "x", *lo))


def served_export_equals_merged_export(run_dir: Path, config: PPOConfig) -> None:
    """The run's exported PEFT adapter (`export/adapter`), served by a LoRA engine over the
    exported base (`export/base`), generates what the exported merged model (`export/merged`)
    does in an engine without LoRA, and PEFT's own loading of it onto the run's base, rebuilt,
    scores those tokens the same."""
    import json

    from peft import PeftModel

    from avrid.ppo.engines.models import initial_policy
    from avrid.ppo.engines.torch_engine import SamplingParams
    from avrid.ppo.engines.vllm_engine import VllmEngine
    from avrid.ppo.engines.vllm_lora import read_adapter_dir
    from tests.helpers import trainer_logprobs

    export = run_dir / "export"
    tok = json.loads((export / "merged" / "avrid_tokenizer.json").read_text())
    base = initial_policy(config, vocab_size=len(tok["id_to_token"]), eos_id=tok["eos_token_id"],
                          pad_id=tok["pad_token_id"])
    prompts = [[2, 3, 12], [5, 9, 4, 12], [7, 12]]
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    done = {}
    for name, path, rank in (("adapter", export / "base", 8), ("merged", export / "merged", 0)):
        engine = VllmEngine(str(path), max_model_len=32, dtype="float32", lora_rank=rank)
        try:
            if rank:
                engine.load_adapter(*read_adapter_dir(str(export / "adapter")), version=0)
            done[name] = engine.generate(prompts, greedy)
        finally:
            engine.close()
    assert [c.token_ids for c in done["adapter"]] == [c.token_ids for c in done["merged"]]
    peft = PeftModel.from_pretrained(base, str(export / "adapter")).eval()
    ref = trainer_logprobs(peft, prompts, done["adapter"], temperature=1.0,
                           pad_id=tok["pad_token_id"])
    for completion, r in zip(done["adapter"], ref, strict=True):
        assert (torch.tensor(completion.logprobs) - r).abs().max() < 1e-4


def test_a_resumed_vllm_run_generates_with_the_resumed_weights(hybrid: RunSummary,
                                                               tmp_path: Path) -> None:
    full = hybrid
    out = tmp_path / "resumed"
    train(tiny_vllm(out, "train.steps=1"))
    resumed = train(tiny_vllm(out, "train.resume=true"))
    # Step 2 is the first one generated after the restart: with the base weights in vLLM
    # its samples, rewards and losses would all differ from the uninterrupted run's. (Step 1
    # differs only by the validation the 1-step run did at its end.)
    assert [r["step"] for r in resumed.rows] == [0, 1, 2]
    assert algorithmic(resumed.rows)[2:] == algorithmic(full.rows)[2:]
    step1 = [{k: v for k, v in r.items() if not k.startswith("val/")}
             for r in (algorithmic(resumed.rows)[1], algorithmic(full.rows)[1])]
    assert step1[0] == step1[1]


def test_vllm_in_a_rollout_pool_k0_is_the_hybrid_run_and_one_step_off_is_one_stale(
        hybrid: RunSummary, tmp_path: Path) -> None:
    """Chapter 6 with the real engine: two rollout workers, each its own vLLM, fed by pushes
    across pools (chapter 4's plan, fingerprints checked on the driver). K = 0 reproduces the
    hybrid-engine run metric for metric; one-step-off is one version stale after step 1."""
    from avrid.pipeline import train as pipeline_train

    k0 = pipeline_train(tiny_vllm(tmp_path / "k0", "pipeline.mode=async",
                                  "pipeline.max_staleness=0"))
    pipelined = ("pipeline/", "sync/")  # the pipeline's own metrics, a push's bytes
    assert ([{k: v for k, v in r.items() if not k.startswith(pipelined)}
             for r in algorithmic(k0.rows)] == algorithmic(hybrid.rows))
    # Three steps, as this check has always run: a push is reported in the step whose
    # generation it preceded, and with two steps the last push has no generation after it.
    off = pipeline_train(tiny_vllm(tmp_path / "off", "pipeline.mode=one_step_off",
                                   "train.steps=3"))
    steps = off.rows[1:]
    assert [r["pipeline/staleness_max"] for r in steps] == [0.0, 1.0, 1.0]
    assert all(r["sync/bytes_per_rank"] > 0 for r in steps)


def test_lora_adapters_pushed_to_a_vllm_rollout_pool(lora_hybrid: tuple[RunSummary, Path],
                                                     tmp_path: Path) -> None:
    """Chapter 6 with LoRA and the real engine: each rollout worker builds the base itself
    (checked by fingerprint) and is pushed the adapters alone, each served under a new id and
    read back; the driver compares the read-back with the trainer ranks' partial fingerprints.
    K = 0 is the hybrid adapter run metric for metric; one-step-off is one version stale."""
    from avrid.pipeline import train as pipeline_train

    lo = LORA
    hybrid = lora_hybrid[0]
    k0 = pipeline_train(tiny_vllm(tmp_path / "k0", *lo, "pipeline.mode=async",
                                  "pipeline.max_staleness=0"))
    pipelined = ("pipeline/", "sync/")
    assert ([{k: v for k, v in r.items() if not k.startswith(pipelined)}
             for r in algorithmic(k0.rows)] == algorithmic(hybrid.rows))
    merged = pipeline_train(tiny_vllm(tmp_path / "merged", *lo, "pipeline.mode=async",
                                      "pipeline.max_staleness=0", "lora.sync=merged"))
    for a, m in zip(k0.rows[1:], merged.rows[1:], strict=True):  # a push: adapters vs model
        assert 0 < 5 * a["sync/bytes_per_rank"] < m["sync/bytes_per_rank"]
    off = pipeline_train(tiny_vllm(tmp_path / "off", *lo, "pipeline.mode=one_step_off",
                                   "train.steps=3"))
    assert [r["pipeline/staleness_max"] for r in off.rows[1:]] == [0.0, 1.0, 1.0]

