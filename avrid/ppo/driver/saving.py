"""Chapter 5 — what the driver puts into a checkpoint and takes back out on resume.

`save` writes one checkpoint of a running `Trainer`: every rank of each trained role writes
its own shards of the model and of AdamW straight into the checkpoint's temporary directory
(`write_shards`, `shards.py`), and the driver adds only what it holds itself — the step, the
data position, the config, the tokenizer, its global RNG states and, for a pipelined run,
its pipeline's state. No tensor of a model travels to the driver. `resume_weights` turns a
loaded `Checkpoint` back into what `Trainer.start` hands each role's `setup`, and
`saved_config` reads the run's config back (``avrid ppo --resume --out DIR`` resumes with it,
so the user need not type the run's command again).

The workers write and read the checkpoint directory themselves, so every node of a
multi-node run must see ``train.out_dir`` at the same path: a shared filesystem (NFS, Lustre,
...). Paths are made absolute first: a Ray worker's working directory is not the driver's.

Not here: the directory's layout, atomicity and checksums (`checkpoint.py`, `manifest.py`),
when to save and how a resume is checked (`run.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.outputs.checkpoint import Checkpoint, save_checkpoint
from avrid.ppo.outputs.export import tokenizer_record
from avrid.ppo.roles.trained import TrainedWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.config_file import config_from_dict, config_to_dict


def save(trainer: Trainer, root: Path, step: int) -> Path:
    """The trainer's models (each rank's shards, `write_shards`), the run's position and, for
    a pipelined run, what its pipeline holds (in the extras as "pipeline":
    `Trainer.pipeline_state`), written atomically."""
    cfg = trainer.config
    # First: it waits for a generation still in flight, so that nothing runs in any worker
    # while the models and the RNG states below are read.
    held = trainer.pipeline_state()
    # Every random draw of the loop is seeded from (train.seed, step), so the step IS the RNG
    # state and the data position; the driver's global RNGs are saved too (and restored on
    # resume) for code that draws from them, e.g. a plug-in task's reward.
    state = {"step": step, "data_position": step * cfg.train.prompts_per_step,
             "rng": {"seed": cfg.train.seed, "derived_from": "(seed, step)"},
             "config": config_to_dict(cfg), "tokenizer": tokenizer_record(trainer.tokenizer)}
    extra = rng_states() if held is None else {**rng_states(), "pipeline": held}
    return save_checkpoint(root, step, state=state, extra=extra,
                           write_shards=lambda tmp: write_shards(trainer, tmp),
                           keep_last=cfg.train.keep_checkpoints)


def write_shards(trainer: Trainer, directory: Path) -> list[str]:
    """Have every rank of each trained role ("actor", and "critic" for PPO) write its shards
    into ``directory/<name>``; returns the names. A collective within each role; the roles
    write one after the other (a colocated critic shares the actor's GPUs and host)."""
    trained = [("actor", trainer.policy)] + ([] if trainer.critic is None
                                             else [("critic", trainer.critic)])
    for name, group in trained:
        group.call(TrainedWorker.save_shards, str((directory / name).resolve()))
    return [name for name, _ in trained]


def resume_weights(ck: Checkpoint) -> tuple[dict[str, Any], dict[str, Any]]:
    """What `Trainer.start` takes from a checkpoint: per model name its directory of shards
    (an absolute path, as a `str`, for `TrainedWorker.setup`) and no optimizer states (they
    are in the shards); from a checkpoint written before sharding, the whole weights and the
    per-rank optimizer states it holds."""
    weights: dict[str, Any] = dict(ck.weights)
    weights.update({name: str(path.resolve()) for name, path in ck.sharded.items()})
    return weights, dict(ck.optimizers)


def saved_config(out_dir: str | os.PathLike[str]) -> PPOConfig | None:
    """The config of the run in `out_dir` as its newest readable checkpoint recorded it
    (``state.json``, written by `save`), set to resume that run: ``train.resume`` on,
    ``train.out_dir`` = `out_dir`, and ``train.resume_from`` cleared (a resumed run records
    where IT started; the next resume goes on from the latest checkpoint). None when no
    checkpoint there has a readable state: the resume itself then refuses, saying why.

    Raises:
        ValueError: the recorded config is not one this avrid reads (a field since removed),
            naming the file.
    """
    root = Path(out_dir) / "checkpoints"
    # Newest first, past a damaged one: its config is the run's all the same, and `train`
    # names the damage and the intact checkpoint to resume from.
    steps = sorted(((int(p.name[5:]), p) for p in root.glob("step_*") if p.name[5:].isdigit()),
                   reverse=True) if root.is_dir() else []
    for _, step_dir in steps:
        path = step_dir / "state.json"
        try:
            recorded = json.loads(path.read_text(encoding="utf-8"))["config"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            config = config_from_dict(recorded)
        except ValueError as e:
            raise ValueError(f"{path}: the run's recorded config cannot be read ({e}); resume "
                             f"it with the --preset or --config (and --set options) it was "
                             f"started with") from None
        return dataclasses.replace(config, train=dataclasses.replace(
            config.train, resume=True, resume_from=None, out_dir=str(out_dir)))
    return None


def rng_states() -> dict[str, Any]:
    """The driver's global RNG states: torch (CPU), Python's `random`, numpy's legacy
    global generator; what `save` puts in a checkpoint's extras.

    Example:
        >>> saved = rng_states()
        >>> a = torch.rand(1).item(), random.random()
        >>> restore_rng_states(saved)
        >>> (torch.rand(1).item(), random.random()) == a
        True
    """
    return {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state()}


def restore_rng_states(extra: Mapping[str, Any]) -> None:
    """Put back the RNG states `rng_states` returned (those present: a checkpoint of an
    older avrid has only torch's)."""
    if "torch_rng" in extra:
        torch.set_rng_state(extra["torch_rng"])
    if "python_rng" in extra:
        random.setstate(extra["python_rng"])
    if "numpy_rng" in extra:
        np.random.set_state(extra["numpy_rng"])
