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
  ``model.safetensors`` with no sub-directory): ``--overwrite`` replaces an export, never a
  folder of anything else, since avrid deletes nothing it did not create.

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
"""Files an export holds; a LoRA export without the merged model has its adapter/ instead of
model.safetensors."""
ADAPTER_DIR, ADAPTER_CONFIG, ADAPTER_WEIGHTS = (
    "adapter", "adapter_config.json", "adapter_model.safetensors")
"""A LoRA run's export also holds its PEFT adapter directory (`export_lora.py`)."""
ADAPTER_FILES = frozenset({ADAPTER_CONFIG, ADAPTER_WEIGHTS})
"""Files every export holds: a non-empty directory without them is not one."""


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
                f"{EXPORT_MARKERS[0]} with {EXPORT_MARKERS[1]} or a LoRA {ADAPTER_DIR}/, and "
                f"no other folder); "
                f"--overwrite replaces only "
                f"an export, never other files: choose a new or empty directory")
    return target


def _looks_like_export(path: Path) -> bool:
    entries = list(path.iterdir())
    names = {p.name for p in entries}
    # The one folder an export may hold: a LoRA run's PEFT adapter (`export_lora.py`), with
    # nothing in it but the adapter's two files.
    folders = [p for p in entries if p.is_dir()]
    model, adapter = EXPORT_MARKERS[1], ADAPTER_DIR
    return EXPORT_MARKERS[0] in names and (model in names or adapter in names) and all(
        p.name == ADAPTER_DIR and {q.name for q in p.iterdir()} <= ADAPTER_FILES
        and not any(q.is_dir() for q in p.iterdir()) for p in folders)
