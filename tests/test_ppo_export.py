"""Chapter 5 — the Hugging Face export: a run's policy loads with `from_pretrained` and gives
the checkpoint's logits exactly; the command takes a run directory and refuses bad input; a
failure midway leaves nothing; bf16, tied embeddings and a real tokenizer come out right; and
(vllm venv only) vLLM serves the export with the same greedy tokens as the trainer's engine.

One seconds-long GRPO run (in-process, one rank) is shared by the module; the other exports
come from checkpoints written by hand with `save_checkpoint`, which costs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from avrid.cli import main
from avrid.ppo.driver.run import train
from avrid.ppo.engines.models import (
    ATTN_IMPLEMENTATION,
    TinyModelSpec,
    build_tiny_policy,
    tiny_spec,
)
from avrid.ppo.outputs import export as export_module
from avrid.ppo.outputs.checkpoint import load_checkpoint, save_checkpoint
from avrid.ppo.outputs.export import CHAR_TOKENIZER_FILE, WEIGHTS_FILE, export_checkpoint
from avrid.ppo.outputs.shards import read_model_weights
from avrid.ppo.roles import fsdp
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.config_file import config_to_dict
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.tokenizer import CharTokenizer

pytestmark = pytest.mark.chapter(5)

IDS = torch.tensor([[2, 5, 7, 12, 3, 1], [4, 4, 9, 2, 11, 6]])
DIGITS = CharTokenizer("0123456789=")  # the digits task's alphabet: vocab 13, eos 1, pad 0


def tiny(out: Path, *extra: str) -> PPOConfig:
    return with_overrides(preset("tiny-grpo"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.steps=1", "train.prompts_per_step=4", "algo.responses_per_prompt=2",
        "train.mini_batch_size=8", "train.val_prompts=4", "train.progress=false",
        f"train.out_dir={out}", *extra])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    train(tiny(out))
    return out


def hand_checkpoint(root: Path, config: PPOConfig, policy: torch.nn.Module, *,
                    sharded: bool = True) -> Path:
    """A checkpoint as `saving.save` writes it (the actor's shards, here from one process),
    without training and without the tokenizer record (as from before export existed: the
    export rebuilds the tokenizer from the config); `sharded=False`: whole weights, as a
    checkpoint written before sharding holds them."""
    state = {"step": 7, "config": config_to_dict(config)}
    if not sharded:
        weights = dict(policy.named_parameters())  # what fsdp.full_state_dict gathers
        return save_checkpoint(root, 7, weights={"actor": weights}, state=state)

    def write(tmp: Path) -> list[str]:
        fsdp.save_shards(policy, torch.optim.AdamW(policy.parameters()), tmp / "actor")
        return ["actor"]

    return save_checkpoint(root, 7, state=state, write_shards=write)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def test_a_runs_export_loads_and_gives_the_checkpoints_logits_exactly(run_dir: Path,
                                                                       tmp_path: Path) -> None:
    ckpt = load_checkpoint(run_dir / "checkpoints")
    dest = export_checkpoint(run_dir, tmp_path / "hf").dest
    # The run exported its final policy itself, the same bytes.
    assert (run_dir / "export" / WEIGHTS_FILE).read_bytes() == (dest / WEIGHTS_FILE).read_bytes()

    cfg = tiny(run_dir)
    rebuilt = build_tiny_policy(tiny_spec(cfg, DIGITS.vocab_size), seed=123, eos_token_id=1,
                                pad_token_id=0)
    rebuilt.load_state_dict(read_model_weights(ckpt.sharded["actor"]))  # the saved shards
    loaded = AutoModelForCausalLM.from_pretrained(dest, attn_implementation=ATTN_IMPLEMENTATION)
    assert loaded.dtype == torch.float32
    assert torch.equal(logits(loaded.eval()), logits(rebuilt))

    gen = GenerationConfig.from_pretrained(dest)
    assert (gen.eos_token_id, gen.pad_token_id) == ([1], 0)
    files = sorted(p.name for p in dest.iterdir())
    assert files == [CHAR_TOKENIZER_FILE, "config.json", "generation_config.json", WEIGHTS_FILE]
    vocab = json.loads((dest / CHAR_TOKENIZER_FILE).read_text())
    assert vocab["alphabet"] == DIGITS.alphabet and vocab["id_to_token"][:3] == ["<pad>",
                                                                                 "<eos>", "0"]
    config = json.loads((dest / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "float32"


def test_the_command_exports_a_run_dir_and_refuses_bad_input(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "out" / "policy"
    main(["export", str(run_dir), str(dest)])
    assert "step 1 of" in capsys.readouterr().out
    assert (dest / WEIGHTS_FILE).is_file()

    def refused(*args: str) -> str:
        with pytest.raises(SystemExit) as done:
            main(["export", *args])
        assert done.value.code == 2
        return capsys.readouterr().err

    # An existing export is not replaced without --overwrite; with it, it is.
    assert f"export destination {dest} exists and is not empty" in refused(str(run_dir),
                                                                           str(dest))
    main(["export", str(run_dir), str(dest), "--overwrite"])
    assert "step 1 of" in capsys.readouterr().out
    # A path that is not there, and a directory that is no checkpoint: both named, with
    # what is accepted.
    err = refused(str(tmp_path / "nope"), str(tmp_path / "d1"))
    assert f"{tmp_path / 'nope'} does not exist" in err and "a run directory" in err
    (tmp_path / "empty").mkdir()
    err = refused(str(tmp_path / "empty"), str(tmp_path / "d2"))
    assert f"{tmp_path / 'empty'} is not a checkpoint" in err and "step directory" in err
    assert not (tmp_path / "d1").exists() and not (tmp_path / "d2").exists()


def test_a_failure_midway_leaves_no_destination(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny(tmp_path / "unused")
    policy = build_tiny_policy(tiny_spec(cfg, DIGITS.vocab_size), seed=0)
    # No tokenizer record: rebuilt. Whole weights: a checkpoint from before sharding exports.
    ckpt = hand_checkpoint(tmp_path / "ckpt", cfg, policy, sharded=False)
    exports = tmp_path / "exports"
    exports.mkdir()
    good = export_checkpoint(ckpt, exports / "old").dest
    before = (good / WEIGHTS_FILE).read_bytes()

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(export_module, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(ckpt, exports / "new")
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(ckpt, exports / "old", overwrite=True)
    # No new directory, no temporary left over, the old export untouched.
    assert sorted(p.name for p in exports.iterdir()) == ["old"]
    assert (good / WEIGHTS_FILE).read_bytes() == before


def test_bf16_tied_pretrained_export_with_a_real_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A "pretrained" model directory as model.path names it: tied embeddings, own tokenizer.
    pretrained = tmp_path / "pretrained"
    words = ["<pad>", "<eos>", *"abcdefghijklmnopqrstuvwxyz"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                     pad_token="<pad>")
    hf_tok.save_pretrained(pretrained)
    spec = TinyModelSpec(vocab_size=len(words), tie_embeddings=True)
    build_tiny_policy(spec, seed=0, eos_token_id=1, pad_token_id=0).save_pretrained(pretrained)

    cfg = with_overrides(tiny(tmp_path / "unused"), [  # written by hand: never run
        f"model.path={pretrained}", "model.dtype=bfloat16", "placement.backend=ray"])
    policy = build_tiny_policy(spec, seed=1, eos_token_id=1, pad_token_id=0,
                               dtype=torch.bfloat16)
    # No tokenizer record: rebuilt from model.path, as for a checkpoint from before export.
    ckpt = hand_checkpoint(tmp_path / "ckpt", cfg, policy)
    dest = export_checkpoint(ckpt, tmp_path / "hf").dest

    config = json.loads((dest / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    from safetensors.torch import load_file

    written = load_file(str(dest / WEIGHTS_FILE))
    assert "lm_head.weight" not in written  # tied: written once
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(dest, attn_implementation=ATTN_IMPLEMENTATION)
    assert loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    # Every weight bit-equal. (Not logits: `.to(bfloat16)` on a built model also casts RoPE's
    # inv_freq buffer, which from_pretrained keeps in float32; the fp32 test compares logits.)
    want = dict(policy.named_parameters())
    for name, p in loaded.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, want[name]), name
    assert AutoTokenizer.from_pretrained(dest).encode("b c") == hf_tok.encode("b c")


@pytest.mark.vllm
def test_vllm_serves_the_export_with_the_trainers_greedy_tokens(tmp_path: Path) -> None:
    from avrid.ppo.engines.torch_engine import SamplingParams, TorchEngine
    from avrid.ppo.engines.vllm_engine import VllmEngine

    # hidden 256 / 4 heads: head dim 64, a size every vLLM attention backend supports.
    cfg = with_overrides(tiny(tmp_path / "unused"), ["model.hidden_size=256",
                                                     "model.num_heads=4"])
    policy = build_tiny_policy(tiny_spec(cfg, DIGITS.vocab_size), seed=0, eos_token_id=1,
                               pad_token_id=0)
    with torch.no_grad():  # far from argmax ties: two kernels must not break one differently
        policy.lm_head.weight.mul_(4.0)
    dest = export_checkpoint(hand_checkpoint(tmp_path / "ckpt", cfg, policy),
                             tmp_path / "hf").dest
    prompts = [DIGITS.encode(t) for t in ("47=", "9=", "123=", "80=")]
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    want = [c.token_ids for c in TorchEngine(policy, pad_token_id=0).generate(prompts, greedy)]
    # max_model_len 64: the tiny model's max_position_embeddings (vLLM refuses more).
    engine = VllmEngine(str(dest), max_model_len=64, seed=0, dtype="float32",
                        enable_sleep_mode=False, enforce_eager=True)
    try:
        assert [c.token_ids for c in engine.generate(prompts, greedy)] == want
    finally:
        engine.close()
