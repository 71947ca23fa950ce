"""Chapter 5 — the trainer's checkpoints: one directory per step, written so a crash never
leaves a half-written one behind, and checked on load so a damaged one is never resumed.

The trained models are saved sharded: `save_checkpoint` calls `write_shards` with the
temporary step directory, and the driver has every rank of each trained role write its own
shards of the model and of AdamW there (`shards.py`): no tensor of theirs reaches the driver.
The driver hands over the rest itself (data position, RNG states, config); `load_checkpoint`
gives it back for a resume with the models' shard directories, which the workers read. A
checkpoint directory looks like this::

    root/
      latest                 text: the name of the newest complete step directory
      step_000012/
        manifest.json        what the directory holds and the sha256 of every other file,
                             the shards' too (written last, checked on load: `manifest.py`)
        actor/model/         DCP shards of the weights: .metadata, __0_0.distcp (rank 0), ...
        actor/optim/         DCP shards of AdamW's state, alike
        critic/model/ ...
        state.json           JSON-able driver state: step, data position, config, ...
        extra.pt             torch.save'd extras (only if given): RNG states, and a
                             pipelined run's queue and versions (chapter 6's resume.py)

Whole models can still be handed over as state dicts (`weights`: ``<name>.safetensors``,
`optimizers`: ``<name>.optim.pt``), and a checkpoint written before sharding (format 2, only
those) still loads and resumes: its `Checkpoint.weights` and `optimizers` are filled instead.

Why the care: a run killed while saving must still resume from the previous step. So every
file goes into a hidden ``.tmp-step_000012-*`` directory first, is fsynced, and only then is
the directory renamed into place (one atomic rename) and `latest` replaced (one atomic
replace). A failure midway removes the temporary directory and changes nothing else; a
process killed midway cannot, so the next run removes such leftovers at start. Those steps
(`write_file`, `fsync_dir`, `move_into_place`, `remove_stale_temp_dirs`) live in `outdir.py`,
because the HF export (`export.py`) publishes its directory the same way; a failed write
raises `avrid.ppo.outputs.outdir.WriteError`: "could not write <file>: <cause>".

Integrity: the manifest carries a sha256 per file, and `load_checkpoint` refuses a file that
does not match (changed in place, truncated, bit rot), naming it. Writing, reading and
checking the manifest (`write_manifest`, `verify_checkpoint`, the format version) live in
`manifest.py`; this file decides what to do when a check fails. Loading the *latest*
checkpoint of a root that turns out to be damaged raises `CorruptCheckpointError` naming it
and the newest intact earlier step directory, which can then be loaded by its path. A
`latest` pointer that is unreadable is refused the same way rather than guessed around.

This file does not talk to workers, shard anything (`shards.py`), or import Ray. The ``.pt``
files are pickles: load only checkpoints you wrote yourself (the checksums catch damage, not
a forger, who can rewrite the manifest too).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from avrid.ppo.outputs.manifest import (
    read_manifest,
    read_verified,
    verify_checkpoint,
    write_manifest,
)
from avrid.ppo.outputs.outdir import fsync_dir, move_into_place, write_file, writing
from avrid.ppo.outputs.shards import METADATA, MODEL_DIR, OPTIM_DIR
from avrid.results.timeline import atomic_write

LATEST = "latest"
"""Name of the pointer file in the checkpoint root."""

_STEP_DIR = re.compile(r"step_(\d+)")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class CorruptCheckpointError(ValueError):
    """The latest checkpoint of a root (or its `latest` pointer) is damaged.

    `path` is the damaged step directory or pointer; `intact` the newest earlier step
    directory that passed `verify_checkpoint` (None if there is none), which the message
    names so a run can go on from there.
    """

    def __init__(self, message: str, *, path: Path, intact: Path | None) -> None:
        super().__init__(message)
        self.path = path
        self.intact = intact


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """One loaded step directory."""

    path: Path
    """The step directory, e.g. ``root/step_000012``."""
    step: int
    weights: dict[str, dict[str, torch.Tensor]]
    """Full CPU state dict per model saved whole (none for sharded ones). Tied weights come
    back as separate equal tensors: `load_state_dict` copies into the model's own (still tied)
    parameters, so that is fine."""
    optimizers: dict[str, Any]
    """What was passed as `optimizers`, per name (loaded onto the CPU)."""
    sharded: dict[str, Path] = field(default_factory=dict)
    """Model name -> its directory of per-rank shards (checksums verified; read them with
    `fsdp.load_shards` on every rank, or `shards.read_model_weights` in one process)."""
    state: dict[str, Any]
    """The JSON state, as saved."""
    extra: dict[str, Any]
    """The torch-saved extras (empty if none were saved)."""


def step_dir_name(step: int) -> str:
    """The directory name of `step`; zero-padded so a plain `ls` lists steps in order.

    Example:
        >>> step_dir_name(12)
        'step_000012'
    """
    return f"step_{step:06d}"


def save_checkpoint(root: str | os.PathLike[str], step: int, *,
                    state: Mapping[str, Any],
                    weights: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
                    optimizers: Mapping[str, Any] | None = None,
                    write_shards: Callable[[Path], Collection[str]] | None = None,
                    extra: Mapping[str, Any] | None = None,
                    keep_last: int | None = None) -> Path:
    """Write the checkpoint of `step` under `root` atomically and point `latest` at it.

    Args:
        root: the checkpoint root (created if missing).
        step: the training step (>= 0) this state is *after*.
        weights: per model name (e.g. ``actor``, ``critic``) a full state dict; tensors may be
            on any device, non-contiguous or share memory (tied embeddings).
        optimizers: per name any `torch.save`-able object, e.g. a list of per-rank optimizer
            state dicts.
        write_shards: called once with the temporary step directory; writes a ``<name>/``
            directory of shards per model (`fsdp.save_shards` on every rank) and returns
            the names. The run's way: `driver.saving.write_shards`.
        state: JSON-able driver state (step, data position, config, Python RNG state as ints).
        extra: optional `torch.save`-able mapping for what JSON cannot hold (RNG tensors).
        keep_last: if given (>= 1), afterwards delete older step directories so that only the
            `keep_last` newest up to and including `step` remain. Directories of later steps
            (left by a run that was resumed from an earlier step) are never deleted.

    Returns:
        The final step directory. Saving a step that already exists replaces it.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> root = tmp.name
        >>> path = save_checkpoint(root, 3, weights={"actor": {"w": torch.ones(2)}},
        ...                        optimizers={}, state={"step": 3})
        >>> path.name, latest_checkpoint(root).name, load_checkpoint(root).state
        ('step_000003', 'step_000003', {'step': 3})
        >>> tmp.cleanup()
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    weights, optimizers = weights or {}, optimizers or {}
    for name in (*weights, *optimizers):
        if not _NAME.fullmatch(name):
            raise ValueError(f"model/optimizer name {name!r} is not a plain file name "
                             "(letters, digits, _ . -)")
    root = Path(root)
    name = step_dir_name(step)
    with writing(root):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
        sharded = _write_shards(tmp, write_shards, taken=set(weights) | set(optimizers))
        for model, sd in weights.items():
            write_file(tmp / f"{model}.safetensors",
                        lambda p, sd=sd: save_file(savable(sd), str(p)))
        for opt, obj in optimizers.items():
            write_file(tmp / f"{opt}.optim.pt", lambda p, obj=obj: torch.save(obj, p))
        # allow_nan=False: NaN is not JSON; fail here, before anything is in place.
        state_text = json.dumps(dict(state), indent=2, allow_nan=False)
        write_file(tmp / "state.json", lambda p: p.write_text(state_text))
        if extra is not None:
            write_file(tmp / "extra.pt", lambda p: torch.save(dict(extra), p))
        # Last: hashes the files above as they are on disk, and marks the directory complete.
        write_manifest(tmp, step=step, weights=weights, optimizers=optimizers,
                       extra=extra is not None, sharded=sharded)
        with writing(root / name):
            os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only
            fsync_dir(tmp)
            move_into_place(tmp, root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with writing(root / LATEST):
        atomic_write(root / LATEST, lambda f: f.write(f"{name}\n".encode()))
    fsync_dir(root)
    if keep_last is not None:
        _prune(root, step, keep_last)
    return root / name


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete step directory under `root`, or None if there is none.

    Reads `latest`; if it is missing or names a directory that is gone (a crash between
    the two renames of a re-save), falls back to the highest-numbered ``step_*`` directory.
    Temporary (``.tmp-*``) directories never count.

    Raises:
        CorruptCheckpointError: `latest` exists but cannot be read or does not hold a step
            directory name (binary garbage, a torn write on a broken disk).
    """
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        try:
            text = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise _bad_pointer(root, f"cannot be read as text ({e})") from e
        if not _STEP_DIR.fullmatch(text):
            raise _bad_pointer(root, f"holds {text[:40]!r}, not a step directory name")
        target = root / text
        if (target / "manifest.json").is_file():
            return target
    steps = _step_dirs(root)
    return steps[-1][1] if steps else None


def load_checkpoint(path: str | os.PathLike[str], *, models: Collection[str] | None = None,
                    training_state: bool = True) -> Checkpoint:
    """Load a step directory, or the latest one if `path` is a checkpoint root.

    Every file read is checked against the sha256 the manifest recorded for it.

    Args:
        path: a step directory or a checkpoint root.
        models: load only these weights (None: all the manifest lists).
        training_state: False skips the optimizer states and extras (they come back empty):
            an export needs only the actor's weights, not gigabytes of AdamW moments.

    Raises:
        FileNotFoundError: no checkpoint there, or a file the manifest lists is missing.
        ValueError: a file is corrupt, does not match its checksum, or is of an unknown
            format version (the file is named).
        CorruptCheckpointError: (a ValueError) `path` is a root and its latest checkpoint is
            damaged; the message names the newest intact earlier one.
    """
    path = Path(path)
    if (path / "manifest.json").is_file():
        return _load(path, models, training_state)
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise FileNotFoundError(f"no checkpoint at {path}: neither a step directory "
                                "(with manifest.json) nor a root holding one")
    try:
        return _load(found, models, training_state)
    except (ValueError, OSError) as e:
        try:
            verify_checkpoint(found)
        except (ValueError, OSError):
            pass  # damaged indeed: offer the newest intact one
        else:
            raise  # the checkpoint is fine; the request was not (e.g. an unknown model)
        intact = newest_intact_checkpoint(path, before=_step_of(found))
        offer = (f"the newest intact earlier checkpoint is {intact}: load that step "
                 f"directory by its path to go on from there" if intact is not None else
                 f"no earlier intact checkpoint is left under {path}")
        raise CorruptCheckpointError(f"the latest checkpoint {found} is damaged ({e}); "
                                     f"{offer}", path=found, intact=intact) from e


def newest_intact_checkpoint(root: str | os.PathLike[str], *,
                             before: int | None = None) -> Path | None:
    """The highest step directory under `root` (below step `before`, if given) that passes
    `verify_checkpoint`, or None. Reads every file of each candidate: for error paths."""
    for step, p in reversed(_step_dirs(Path(root))):
        if before is not None and step >= before:
            continue
        try:
            verify_checkpoint(p)
        except (ValueError, OSError):
            continue
        return p
    return None


def savable(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU, contiguous, storage-disjoint copy of a state dict for safetensors.

    safetensors refuses tensors that share memory (tied embedding and LM head, views of one
    buffer), so every tensor whose storage an earlier one already uses is cloned. Only those:
    cloning everything would double the peak host memory of a large model.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {key!r} is {type(t).__name__}, not a Tensor")
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        elif t.numel():
            seen.add(ptr)
        out[key] = t
    return out


def _write_shards(tmp: Path, write: Callable[[Path], Collection[str]] | None, *,
                  taken: set[str]) -> list[str]:
    """Have `write` put the shards into the temporary step directory `tmp` (a failure midway
    removes them with it), check what it wrote, fsync its directories; returns the names."""
    if write is None:
        return []
    names = sorted(write(tmp))
    for name in names:
        if not _NAME.fullmatch(name) or name in taken:
            raise ValueError(f"sharded model name {name!r} is not a plain file name or is also "
                             f"saved whole")
        for part in (MODEL_DIR, OPTIM_DIR):
            if not (tmp / name / part / METADATA).is_file():
                raise FileNotFoundError(f"the shards of {name!r} are incomplete: no "
                                        f"{tmp / name / part / METADATA}")
    for directory in sorted(p for p in tmp.rglob("*") if p.is_dir()):
        fsync_dir(directory)  # the files are (DCP fsyncs each); their names too
    return names


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete step directories (those with a manifest), sorted by step."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and (p / "manifest.json").is_file()]
    return sorted(found)


def _prune(root: Path, step: int, keep_last: int) -> None:
    older = [p for s, p in _step_dirs(root) if s <= step]
    for p in older[:-keep_last]:
        shutil.rmtree(p)


def _load(path: Path, models: Collection[str] | None, training_state: bool) -> Checkpoint:
    """Load one step directory, verifying each file it reads."""
    manifest = read_manifest(path)
    digests: dict[str, str] = manifest.get("files", {})

    # weights_only=False: optimizer and extra objects may hold arbitrary picklable values
    # (e.g. numpy RNG state); the module docstring says to load only your own checkpoints.
    def torch_load(p: Path) -> Any:
        return torch.load(p, map_location="cpu", weights_only=False)

    def read(name: str, reader: Callable[[Path], Any]) -> Any:
        return read_verified(path / name, reader, digests.get(name))

    held = [*manifest["weights"], *manifest["sharded"]]
    wanted = held if models is None else list(models)
    unknown = sorted(set(wanted) - set(held))
    if unknown:
        raise FileNotFoundError(f"{path} holds no weights named {', '.join(unknown)}; it has "
                                f"{', '.join(held) or 'none'}")
    weights = {m: read(f"{m}.safetensors", lambda p: load_file(str(p), device="cpu"))
               for m in wanted if m in manifest["weights"]}
    sharded = {m: path / m for m in wanted if m in manifest["sharded"]}
    # The workers read the shards; their checksums are checked here, before any worker starts.
    parts = tuple(f"{m}/" if training_state else f"{m}/{MODEL_DIR}/" for m in sharded)
    for name in (n for n in digests if parts and n.startswith(parts)):
        read(name, lambda p: None)
    optimizers = ({o: read(f"{o}.optim.pt", torch_load)
                   for o in manifest["optimizers"]} if training_state else {})
    state = read("state.json", lambda p: json.loads(p.read_text()))
    extra = (read("extra.pt", torch_load)
             if manifest["extra"] and training_state else {})
    return Checkpoint(path=path, step=int(manifest["step"]), weights=weights,
                      optimizers=optimizers, state=state, extra=extra, sharded=sharded)


def _step_of(path: Path) -> int:
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else 0


def _bad_pointer(root: Path, problem: str) -> CorruptCheckpointError:
    steps = _step_dirs(root)
    newest = steps[-1][1] if steps else None
    fix = (f"delete it and the newest complete step directory, {newest}, is used (or load "
           f"a step directory by its path)" if newest is not None
           else "no complete step directory is left beside it")
    return CorruptCheckpointError(f"checkpoint pointer {root / LATEST} is unreadable or "
                                  f"corrupt: it {problem}; {fix}", path=root / LATEST,
                                  intact=newest)

