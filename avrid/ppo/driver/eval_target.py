"""Chapter 5 — what `avrid eval TARGET` evaluates: a checkpoint, an export, or the initial model.

`resolve_target` reads what the path names and returns an `EvalTarget`: the weights
`Trainer.start` takes, the config the target brings (a checkpoint's run recorded it in
``state.json``; an export inside a run's directory has that run's), its step, and where its
evaluation goes by default. The accepted targets:

    run directory        ``runs/x`` (holding checkpoints/): its latest checkpoint
    checkpoint           ``runs/x/checkpoints`` (its latest step) or ``.../step_000050``
    export               an ``avrid export`` (or a run's ``export/``) directory, Hugging Face
                         format; a LoRA run's: its ``merged/`` policy
    initial model        no path (`initial_target`): the config's model as at step 0

A checkpoint is loaded as a resume loads it (`saving.resume_weights`: each rank reads its
own shards); an export is loaded as a pretrained model, ``model.path`` set to it (its own
tokenizer files, or the char tokenizer its ``avrid_tokenizer.json`` describes).

Not here: running the evaluation (`evaluate.py`), the command line (`avrid/commands/eval.py`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from avrid.ppo.driver.saving import resume_weights, saved_config
from avrid.ppo.outputs.checkpoint import load_checkpoint
from avrid.ppo.outputs.export import CHAR_TOKENIZER_FILE, resolve_checkpoint
from avrid.ppo.outputs.export_dest import (
    ADAPTER_DIR,
    EXPORT_MARKERS,
    MERGED_DIR,
    RUN_EXPORT,
    is_run_directory,
    run_directory,
)
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.config_file import config_from_dict

TargetKind = Literal["checkpoint", "export", "initial"]

ACCEPTED = ("a run directory (holding checkpoints/: its latest checkpoint), a checkpoint "
            "root (holding step_* directories) or step directory (holding manifest.json), "
            "an export directory (config.json and model.safetensors; a LoRA run's: merged/ "
            "beside adapter/), or --initial for the config's model before training")
"""What `avrid eval` takes, for the error that names a target it does not."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalTarget:
    """A resolved evaluation target."""

    kind: TargetKind
    path: Path | None
    """The step directory or the export's model directory; None for the initial model."""
    step: int | None
    """The training step of a checkpoint; None for an export or the initial model."""
    config: PPOConfig | None
    """The config the target brings (its run's), or None: then a preset or file gives it."""
    weights: dict[str, Any]
    """What `Trainer.start` takes as `weights`: a checkpoint's actor (its shard directory, as
    a resume hands it over); none for an export, whose weights come in through
    ``model.path``, or for the initial model."""
    default_out: Path | None
    """Where the evaluation is written without --out; None: the config decides
    (`default_out_dir`)."""
    char_alphabet: str | None = None
    """A checkpoint or export with the char tokenizer: its alphabet, which the task's must
    equal (the model's vocabulary is one token per character of it)."""

    def prepared(self, config: PPOConfig) -> PPOConfig:
        """`config` set to load this target: an export becomes ``model.path`` (its tokenizer:
        its own files, or "char"), a plain model (the merged policy, not adapters)."""
        if self.kind != "export":
            return config
        m = dataclasses.replace(config.model, path=str(self.path), critic_path=None,
                                tokenizer="char" if self.char_alphabet is not None else None)
        lora = dataclasses.replace(config.lora, rank=0) if config.lora.enabled else config.lora
        return dataclasses.replace(config, model=m, lora=lora)


def resolve_target(target: str | Path) -> EvalTarget:
    """The `EvalTarget` a path names (see the module docstring).

    Raises:
        FileNotFoundError: `target` does not exist, or a run holds no complete checkpoint.
        ValueError: `target` is none of the accepted kinds (the message says what was found
            there and what is accepted), or its recorded config cannot be read.
    """
    path = Path(target)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; avrid eval takes {ACCEPTED}")
    if not path.is_dir():
        raise ValueError(f"{path} is a file, not a directory; avrid eval takes {ACCEPTED}")
    if (model := _export_model(path)) is not None:
        return _export_target(path, model)
    try:
        step_dir = resolve_checkpoint(path)
    except ValueError:
        found = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())[:8]
        raise ValueError(f"{path} is not something avrid eval can evaluate (it holds "
                         f"{', '.join(found) or 'nothing'}); avrid eval takes "
                         f"{ACCEPTED}") from None
    ck = load_checkpoint(step_dir, training_state=False)
    if "config" not in ck.state:
        raise ValueError(f"{step_dir / 'state.json'} has no 'config': not written by "
                         f"`avrid ppo`, so the model and task are unknown")
    # The policy alone: evaluation places no critic (`evaluate.eval_config`), so a PPO
    # run's critic is not read back.
    weights = {"actor": resume_weights(ck)[0]["actor"]}
    run = run_directory(step_dir) or step_dir.parent
    tokenizer = ck.state.get("tokenizer") or {}
    return EvalTarget(kind="checkpoint", path=step_dir, step=ck.step,
                      config=_recorded(ck.state["config"], step_dir / "state.json"),
                      weights=weights, default_out=run / "eval" / step_dir.name,
                      char_alphabet=tokenizer.get("alphabet") if tokenizer.get("kind") == "char"
                      else None)


def initial_target() -> EvalTarget:
    """The initial model of whatever config is given (a preset, a file, --set)."""
    return EvalTarget(kind="initial", path=None, step=None, config=None, weights={},
                      default_out=None)


def default_out_dir(target: EvalTarget, config: PPOConfig) -> Path:
    """Where an evaluation goes without --out: beside its target (``<run>/eval/step_N``,
    ``<run>/eval/export``, ``<export>-eval``), and for the initial model
    ``<train.out_dir>/eval/initial``, beside the run the config would train."""
    if target.default_out is not None:
        return target.default_out
    return Path(config.train.out_dir) / "eval" / "initial"


def _export_model(path: Path) -> Path | None:
    """The model directory of an export at `path` (a LoRA run's: ``merged/``), or None."""
    if all((path / name).is_file() for name in EXPORT_MARKERS):
        return path
    if (path / ADAPTER_DIR).is_dir():
        merged = path / MERGED_DIR
        if not all((merged / name).is_file() for name in EXPORT_MARKERS):
            raise ValueError(f"{path} is a LoRA run's export without the merged policy "
                             f"({MERGED_DIR}/); avrid eval evaluates that one: export again "
                             f"with `avrid export --merged`")
        return merged
    return None


def _export_target(path: Path, model: Path) -> EvalTarget:
    """An export: its run's config when it is that run's ``export/``, else none."""
    top = path.parent if path.name == MERGED_DIR and model == path else path
    run = top.parent if top.name == RUN_EXPORT and is_run_directory(top.parent) else None
    config = saved_config(run) if run is not None else None
    char = model / CHAR_TOKENIZER_FILE
    alphabet = json.loads(char.read_text(encoding="utf-8"))["alphabet"] if char.is_file() else None
    default = run / "eval" / RUN_EXPORT if run is not None else top.parent / f"{top.name}-eval"
    return EvalTarget(kind="export", path=model, step=None, config=config, weights={},
                      default_out=default, char_alphabet=alphabet)


def _recorded(config: dict[str, Any], where: Path) -> PPOConfig:
    try:
        return config_from_dict(config)
    except ValueError as e:
        raise ValueError(f"{where}: the run's recorded config cannot be read ({e}); evaluate "
                         f"it with the avrid version that trained it") from None
