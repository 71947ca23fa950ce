"""Chapter 5: a LoRA run's export loads on its own (issue 42, item 5).

`avrid export` of a LoRA run writes three folders: ``merged/`` (the policy), ``adapter/``
(PEFT's adapter) and ``base/`` (the model the adapter goes onto; a pretrained run records its
``model.path`` instead). Here: PEFT loads the adapter onto the base the adapter's config
names, from the export directory alone (the run deleted), and gets the trained policy's
logits; the adapter cannot be put onto the merged model by following the layout (that adds
the update twice: the export used to hold the merged model at its top with ``adapter/``
inside it); an adapter-only export and a pretrained run's export load the same way; and
``--overwrite`` still replaces only an export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from avrid.cli import main
from avrid.ppo.driver.run import train
from avrid.ppo.engines.models import ATTN_IMPLEMENTATION
from avrid.ppo.outputs.checkpoint import latest_checkpoint, load_checkpoint
from avrid.ppo.outputs.export import CHAR_TOKENIZER_FILE, WEIGHTS_FILE, export_checkpoint
from avrid.ppo.outputs.export_dest import ExportDestError
from avrid.ppo.outputs.shards import read_model_weights
from avrid.ppo.roles import lora
from tests.test_ppo_lora import policy_like, tiny

pytestmark = pytest.mark.chapter(5)

TOKENS = torch.tensor([[2, 5, 9, 3, 12, 4], [7, 7, 2, 11, 3, 6]])
"""Token ids inside the digits task's vocabulary, for the logits compared."""


def load(path: Path | str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation=ATTN_IMPLEMENTATION).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def trained_policy(run: Path, tmp_path: Path) -> torch.nn.Module:
    """The policy as the trainer holds it at the run's last step: the base rebuilt from the
    seed, PEFT's adapters put in, and the checkpoint's adapters loaded into them."""
    cfg = tiny(tmp_path / "unused")
    model = lora.attach(policy_like(tmp_path), cfg.lora, seed=cfg.train.seed)
    ckpt = load_checkpoint(latest_checkpoint(run / "checkpoints"), models=("actor",),
                           training_state=False)
    adapters = read_model_weights(ckpt.sharded["actor"])
    assert adapters and all(lora.is_adapter(n) for n in adapters)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and not [n for n in missing if lora.is_adapter(n)]
    return model.eval()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step tiny GRPO run with LoRA on the actor (its own export/ written at the end)."""
    out = tmp_path_factory.mktemp("lora") / "run"
    train(tiny(out))
    return out


def test_peft_loads_the_adapter_onto_the_base_it_names_from_the_export_alone(
        lora_run: Path, tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM, PeftModel

    want = logits(trained_policy(lora_run, tmp_path))
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)  # a copy: the run is deleted below
    hf = tmp_path / "hf"
    main(["export", str(run), str(hf), "--merged"])
    shutil.rmtree(run)  # nothing of the run is left but its export

    config = json.loads((hf / "adapter" / "adapter_config.json").read_text())
    base_path = config["base_model_name_or_path"]
    assert Path(base_path) == (hf / "base").resolve()  # absolute, inside the export
    assert (hf / "base" / WEIGHTS_FILE).is_file() and (hf / "base" / CHAR_TOKENIZER_FILE).is_file()
    adapted = PeftModel.from_pretrained(load(base_path), str(hf / "adapter")).eval()
    assert (logits(adapted) - want).abs().max().item() < 1e-5
    assert (logits(load(hf / "merged")) - want).abs().max().item() < 1e-5
    # PEFT's one-call loader follows base_model_name_or_path itself.
    auto = AutoPeftModelForCausalLM.from_pretrained(str(hf / "adapter"), dtype=torch.float32,
                                                    attn_implementation=ATTN_IMPLEMENTATION)
    assert (logits(auto.eval()) - want).abs().max().item() < 1e-5


def test_the_adapter_cannot_be_put_onto_the_merged_model_by_following_the_layout(
        lora_run: Path, tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM, PeftModel

    export = lora_run / "export"  # what `avrid ppo` publishes
    assert sorted(p.name for p in export.iterdir()) == ["adapter", "base", "merged"]
    merged = logits(load(export / "merged"))
    # The top of the export is no model: nothing there to take for the adapter's base.
    assert not (export / "config.json").exists() and not (export / WEIGHTS_FILE).exists()
    with pytest.raises((OSError, ValueError)):  # transformers: no config.json / no model_type
        load(export)
    # The adapter names the base, and the merged model is not around the adapter.
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == (export / "base").resolve()
    assert not (export / "adapter").is_relative_to(export / "merged")
    auto = AutoPeftModelForCausalLM.from_pretrained(str(export / "adapter"), dtype=torch.float32,
                                                    attn_implementation=ATTN_IMPLEMENTATION)
    assert (logits(auto.eval()) - merged).abs().max().item() < 1e-5
    # What the layout keeps from happening: the adapter onto the merged model adds the
    # update twice (the logits move by far more than rounding).
    doubled = PeftModel.from_pretrained(load(export / "merged"), str(export / "adapter"))
    assert (logits(doubled.eval()) - merged).abs().max().item() > 1e-3


def test_an_adapter_only_export_and_overwrite_keep_the_layout(lora_run: Path,
                                                              tmp_path: Path) -> None:
    from peft import PeftModel

    merged = logits(load(lora_run / "export" / "merged"))
    only = tmp_path / "only"
    done = export_checkpoint(lora_run, only, merged=False)  # `avrid export` without --merged
    assert done.files == ("adapter", "base")
    adapted = PeftModel.from_pretrained(load(only / "base"), str(only / "adapter")).eval()
    assert (logits(adapted) - merged).abs().max().item() < 1e-5
    # An adapter-only export is an earlier export: --overwrite replaces it with a merged one.
    done = export_checkpoint(lora_run, only, overwrite=True, merged=True)
    assert done.files == ("adapter", "base", "merged")
    # So is one in the layout before this one (a run resumed after upgrading rewrites it).
    old = tmp_path / "old"
    shutil.copytree(only / "merged", old)
    shutil.copytree(only / "adapter", old / "adapter")
    done = export_checkpoint(lora_run, old, overwrite=True, merged=False)
    assert done.files == ("adapter", "base")
    # A folder of the user's that holds an adapter/ beside other things is not an export.
    mine = tmp_path / "mine"
    shutil.copytree(only / "adapter", mine / "adapter")
    (mine / "notes.txt").write_text("mine\n")
    with pytest.raises(ExportDestError, match="is not an earlier export"):
        export_checkpoint(lora_run, mine, overwrite=True)
    assert (mine / "notes.txt").read_text() == "mine\n"


def test_a_pretrained_runs_adapter_names_its_model_path(tmp_path: Path) -> None:
    from peft import PeftModel

    pretrained = tmp_path / "pretrained"
    policy_like(tmp_path).save_pretrained(pretrained)  # the tiny base, as a local checkpoint
    out = tmp_path / "run"
    train(tiny(out, f"model.path={pretrained}", "model.tokenizer=char", "train.steps=1"))
    export = out / "export"
    assert sorted(p.name for p in export.iterdir()) == ["adapter", "merged"]  # no copy
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(pretrained.resolve())
    adapted = PeftModel.from_pretrained(load(pretrained), str(export / "adapter")).eval()
    assert (logits(adapted) - logits(load(export / "merged"))).abs().max().item() < 1e-5
