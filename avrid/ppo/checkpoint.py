"""Chapter 5 — the trainer's checkpoints: one directory per step, written so a crash never
leaves a half-written one behind.

The driver gathers everything from the workers (full state dicts, per-rank optimizer states,
data position, RNG states, config) and hands it to `save_checkpoint`; `load_checkpoint` gives
it back for a resume. A checkpoint directory looks like this::

    root/
      latest                 text: the name of the newest complete step directory
      step_000012/
        manifest.json        what the directory holds (written last, checked on load)
        actor.safetensors    one full state dict per model name (safetensors.torch)
        critic.safetensors
        actor.optim.pt       one torch.save'd object per optimizer name
        state.json           JSON-able driver state: step, data position, config, ...
        extra.pt             torch.save'd extras, e.g. tensor RNG states (only if given)

Why the care: a run killed while saving must still resume from the previous step. So every
file goes into a hidden ``.tmp-step_000012-*`` directory first, is fsynced, and only then is
the directory renamed into place (one atomic rename) and `latest` replaced (one atomic
replace). A failure midway removes the temporary directory and changes nothing else. The
steps are public (`write_file`, `fsync_dir`, `move_into_place`, `savable`) because the HF
export (`export.py`) publishes its directory the same way.

This file does not gather state from workers, shard or reshard anything, or import Ray. The
``.pt`` files are pickles: load only checkpoints you wrote yourself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from avrid.results.timeline import _atomic_write

LATEST = "latest"
"""Name of the pointer file in the checkpoint root."""
FORMAT_VERSION = 1
"""Bumped when the layout changes; `load_checkpoint` refuses versions it does not know."""

_STEP_DIR = re.compile(r"step_(\d+)")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """One loaded step directory."""

    path: Path
    """The step directory, e.g. ``root/step_000012``."""
    step: int
    weights: dict[str, dict[str, torch.Tensor]]
    """Full CPU state dict per model name. Tied weights come back as separate equal tensors:
    `load_state_dict` copies into the model's own (still tied) parameters, so that is fine."""
    optimizers: dict[str, Any]
    """What was passed as `optimizers`, per name (loaded onto the CPU)."""
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
                    weights: Mapping[str, Mapping[str, torch.Tensor]],
                    optimizers: Mapping[str, Any], state: Mapping[str, Any],
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
    for name in (*weights, *optimizers):
        if not _NAME.fullmatch(name):
            raise ValueError(f"model/optimizer name {name!r} is not a plain file name "
                             "(letters, digits, _ . -)")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
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
        manifest = {"format": FORMAT_VERSION, "step": step, "weights": sorted(weights),
                    "optimizers": sorted(optimizers), "extra": extra is not None}
        write_file(tmp / "manifest.json", lambda p: p.write_text(json.dumps(manifest)))
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only
        fsync_dir(tmp)
        move_into_place(tmp, root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write(root / LATEST, lambda f: f.write(f"{name}\n".encode()))
    fsync_dir(root)
    if keep_last is not None:
        _prune(root, step, keep_last)
    return root / name


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete step directory under `root`, or None if there is none.

    Reads `latest`; if it is missing or names a directory that is gone, falls back to the
    highest-numbered ``step_*`` directory. Temporary (``.tmp-*``) directories never count.
    """
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if _STEP_DIR.fullmatch(target.name) and (target / "manifest.json").is_file():
            return target
    steps = _step_dirs(root)
    return steps[-1][1] if steps else None


def load_checkpoint(path: str | os.PathLike[str], *, models: Collection[str] | None = None,
                    training_state: bool = True) -> Checkpoint:
    """Load a step directory, or the latest one if `path` is a checkpoint root.

    Args:
        path: a step directory or a checkpoint root.
        models: load only these weights (None: all the manifest lists).
        training_state: False skips the optimizer states and extras (they come back empty):
            an export needs only the actor's weights, not gigabytes of AdamW moments.

    Raises:
        FileNotFoundError: no checkpoint there, or a file the manifest lists is missing.
        ValueError: a file is corrupt or of an unknown format version (the file is named).
    """
    path = Path(path)
    if not (path / "manifest.json").is_file():
        found = latest_checkpoint(path) if path.is_dir() else None
        if found is None:
            raise FileNotFoundError(f"no checkpoint at {path}: neither a step directory "
                                    "(with manifest.json) nor a root holding one")
        path = found
    manifest = _read(path / "manifest.json", lambda p: json.loads(p.read_text()))
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path / 'manifest.json'}: format {manifest.get('format')!r}, "
                         f"this code reads format {FORMAT_VERSION}")
    # weights_only=False: optimizer and extra objects may hold arbitrary picklable values
    # (e.g. numpy RNG state); the module docstring says to load only your own checkpoints.
    def torch_load(p: Path) -> Any:
        return torch.load(p, map_location="cpu", weights_only=False)

    wanted = manifest["weights"] if models is None else list(models)
    unknown = sorted(set(wanted) - set(manifest["weights"]))
    if unknown:
        raise FileNotFoundError(f"{path} holds no weights named {', '.join(unknown)}; it has "
                                f"{', '.join(manifest['weights']) or 'none'}")
    weights = {m: _read(path / f"{m}.safetensors", lambda p: load_file(str(p), device="cpu"))
               for m in wanted}
    optimizers = ({o: _read(path / f"{o}.optim.pt", torch_load)
                   for o in manifest["optimizers"]} if training_state else {})
    state = _read(path / "state.json", lambda p: json.loads(p.read_text()))
    extra = (_read(path / "extra.pt", torch_load)
             if manifest["extra"] and training_state else {})
    return Checkpoint(path=path, step=int(manifest["step"]), weights=weights,
                      optimizers=optimizers, state=state, extra=extra)


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


def write_file(path: Path, write: Callable[[Path], object]) -> None:
    """Run `write(path)`, then fsync the file so the rename that follows publishes data that
    is on disk, not just in the page cache."""
    write(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (POSIX); a no-op where directories cannot be
    opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def move_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. An existing `final` (the same step saved again after a
    resume) is first renamed aside and deleted only once the new one is in place; a crash
    in between leaves `latest` pointing at the old name, which then falls back to the
    highest remaining step."""
    if not final.exists():
        os.rename(tmp, final)
        return
    trash = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".trash-{final.name}-"))
    os.rename(final, trash / final.name)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(trash / final.name, final)  # put the old one back; the caller drops tmp
        shutil.rmtree(trash, ignore_errors=True)
        raise
    shutil.rmtree(trash, ignore_errors=True)


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


def _read(path: Path, read: Callable[[Path], Any]) -> Any:
    """`read(path)`, with errors that name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    try:
        return read(path)
    except Exception as e:
        raise ValueError(f"checkpoint file {path} is unreadable or corrupt: {e}") from e
