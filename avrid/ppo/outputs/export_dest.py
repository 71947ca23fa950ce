"""Chapter 5 — where an export may be written: never over a run, never over the user's files.

``avrid export SRC DEST --overwrite`` replaces DEST. Before this check existed, a destination
that *was* the source run (``avrid export runs/r runs/r --overwrite``) replaced the whole run by
the four export files, a parent of it (``avrid export proj/run proj``) deleted the user's
project, and ``runs/r/checkpoints`` wiped every checkpoint. `check_export_dest` refuses all of
these before anything is read or written, naming the destination and the reason:

- DEST is, contains or lies inside the source checkpoint's run (its step directory, its
  checkpoint root, the run directory around them);
- DEST is, or lies inside, any run directory: a directory holding ``.avrid.lock`` (a run's
  lock file) or ``checkpoints/``. The one place inside a run an export may go is the run's own
  ``export/`` (`RUN_EXPORT`), where ``avrid ppo`` publishes its final policy;
- DEST exists, is not empty, and `overwrite` was not given;
- DEST exists, is not empty, and is not an earlier export (``config.json`` and
  ``model.safetensors`` with no sub-directory; a LoRA run's ``adapter/`` with ``merged/`` and
  ``base/`` models beside it, or the earlier LoRA layout, the merged model with ``adapter/``
  inside): ``--overwrite`` replaces an export, never a folder of anything else, since avrid
  deletes nothing it did not create.

Paths are compared after resolving symlinks and ``..``, so ``.``, a relative path and a
symlink to the run are caught alike.

Not here: writing the export (`export.py`) or publishing a directory atomically (`outdir.py`).
"""

from __future__ import annotations

from pathlib import Path

from avrid.ppo.outputs.checkpoint import LATEST
from avrid.ppo.outputs.outdir import LOCK_FILE

RUN_EXPORT = "export"
"""The sub-directory of a run where ``avrid ppo`` writes its final policy."""
EXPORT_MARKERS = ("config.json", "model.safetensors")
"""Files a model export holds (and each model folder of a LoRA run's export)."""
ADAPTER_DIR, ADAPTER_CONFIG, ADAPTER_WEIGHTS = (
    "adapter", "adapter_config.json", "adapter_model.safetensors")
"""A LoRA run's export holds its PEFT adapter directory (`export_lora.py`)."""
ADAPTER_FILES = frozenset({ADAPTER_CONFIG, ADAPTER_WEIGHTS})
"""The files of the adapter directory, and nothing else."""
MERGED_DIR, BASE_DIR = "merged", "base"
"""A LoRA run's export: the merged model and the base the adapter goes onto, each a model
folder beside ``adapter/`` (`export.py`)."""


class ExportDestError(FileExistsError, ValueError):
    """The export destination is refused; the message names it and says why. A ValueError
    too: bad input, reported in one line without a traceback hint."""


def run_directory(step_dir: Path) -> Path | None:
    """The run directory a checkpoint step directory belongs to (``run/checkpoints/step_N``),
    or None for a step directory that sits in a checkpoint root of its own."""
    root = step_dir.parent
    if root.name == "checkpoints":
        return root.parent
    return None


def is_run_directory(path: Path) -> bool:
    """Whether `path` holds a run: its lock file or a ``checkpoints/`` directory."""
    return (path / LOCK_FILE).is_file() or (path / "checkpoints").is_dir()


def _is_checkpoint_root(path: Path) -> bool:
    return (path / LATEST).is_file() or any(path.glob("step_*"))


def _inside(path: Path, other: Path) -> bool:
    """`path` is `other` or lies somewhere below it."""
    return path == other or path.is_relative_to(other)


def check_export_dest(dest: Path, step_dir: Path | None, *, overwrite: bool) -> Path:
    """Refuse a destination that would destroy a run or a user's files (see the module
    docstring); returns `dest` resolved, the path to write to. `step_dir` is the checkpoint
    the export comes from (None: weights from elsewhere, only the other rules apply).

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp())
        >>> (run / "checkpoints" / "step_000001").mkdir(parents=True)
        >>> try:
        ...     check_export_dest(run, run / "checkpoints" / "step_000001", overwrite=True)
        ... except ExportDestError as e:
        ...     print("refused:", "the source run" in str(e))
        refused: True
        >>> check_export_dest(run / "export", run / "checkpoints" / "step_000001",
        ...                   overwrite=True) == (run / "export").resolve()
        True
    """
    target = dest.resolve()
    protected: list[Path] = []
    run = None
    if step_dir is not None:
        step = step_dir.resolve()
        protected.append(step)
        if _is_checkpoint_root(step.parent):
            protected.append(step.parent)
        run = run_directory(step)
        if run is not None:
            protected.append(run)
    own_export = run / RUN_EXPORT if run is not None else None
    # The closest relation first: the run itself, then inside it, then around it.
    clash = ([("is", p) for p in protected if target == p]
             + [("lies inside", p) for p in protected if _inside(target, p)]
             + [("contains", p) for p in protected if _inside(p, target)])
    if clash and target != own_export:
        how, p = clash[0]
        raise ExportDestError(
            f"export destination {dest} {how} the source run ({p}); writing there would "
            f"replace the run's checkpoints and logs. Choose a directory outside it"
            + (f" (the run's own export is {own_export})" if own_export else ""))
    for above in (target, *target.parents) if target != own_export else ():
        if is_run_directory(above):
            where = "is" if above == target else f"lies inside {above},"
            raise ExportDestError(
                f"export destination {dest} {where} a run directory (it holds "
                f"{LOCK_FILE} or checkpoints/); choose a directory outside any run")
    if target.exists() and not target.is_dir():
        raise ExportDestError(f"export destination {dest} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise ExportDestError(f"export destination {dest} exists and is not empty; "
                                  "choose a new directory or pass overwrite (--overwrite) "
                                  "to replace an earlier export there")
        if not _looks_like_export(target):
            raise ExportDestError(
                f"export destination {dest} is not an earlier export (an export holds "
                f"{EXPORT_MARKERS[0]} with {EXPORT_MARKERS[1]}, or a LoRA run's "
                f"{ADAPTER_DIR}/ with {MERGED_DIR}/ and {BASE_DIR}/, and no other folder); "
                f"--overwrite replaces only an export, never other files: choose a new or "
                f"empty directory")
    return target


def _looks_like_export(path: Path) -> bool:
    """A model export, a LoRA run's (adapter/ with merged/ and base/ beside it), or a LoRA
    run's from before that layout (the merged model, or its config only, with adapter/)."""
    names = {p.name for p in path.iterdir()}
    if names and names <= {ADAPTER_DIR, MERGED_DIR, BASE_DIR} and ADAPTER_DIR in names:
        return _is_adapter(path / ADAPTER_DIR) and all(
            _is_model(path / n) for n in names - {ADAPTER_DIR})
    folders = {p.name for p in path.iterdir() if p.is_dir()}
    model, adapter = EXPORT_MARKERS[1], ADAPTER_DIR
    return EXPORT_MARKERS[0] in names and (model in names or adapter in names) and (
        folders <= {ADAPTER_DIR} and (not folders or _is_adapter(path / ADAPTER_DIR)))


def _is_adapter(path: Path) -> bool:
    """A folder holding nothing but the PEFT adapter's two files."""
    return path.is_dir() and all(q.name in ADAPTER_FILES and q.is_file() for q in path.iterdir())


def _is_model(path: Path) -> bool:
    """A model folder an export writes: its config and weights, no sub-folder."""
    names = {q.name for q in path.iterdir()} if path.is_dir() else set()
    return set(EXPORT_MARKERS) <= names and not any(q.is_dir() for q in path.iterdir())
