"""Chapter 5 — what a training run writes down: metrics, sample dumps and a progress bar.

- `MetricsLogger` appends one JSON line per step to ``metrics.jsonl`` (the source of truth,
  read back by `read_metrics` and plotted by `avrid.ppo.outputs.plots`), and optionally mirrors the
  numbers to TensorBoard and/or Weights & Biases;
- `SampleDump` appends a few (prompt, response, reward) rows per step to ``samples.jsonl``,
  because a reward curve alone does not show *what* the policy learned (or how it hacked the
  reward);
- `format_step` is a one-line text summary for logs and notebooks (the progress bar lives in
  `avrid.ppo.outputs.progress`; `Progress` is importable from here too).

Resume semantics: both JSONL writers take `resume_step`. Lines of steps after it were written
by the crashed run past its last checkpoint and will be written again, so they are dropped
(the file is rewritten atomically); the resumed run's file then equals an uninterrupted one.
Without `resume_step` the file starts empty.

Every line is written whole and flushed at once, so a crash leaves only whole lines (at worst
a torn last line after an OS crash, which `read_metrics` skips). Non-finite floats (NaN, inf)
are written as JSON ``null``: strict JSON has no NaN, and null reads as "no value" everywhere.
A failed write (a full disk, a permission) raises `avrid.ppo.outputs.outdir.WriteError`: "could not
write <file>: <cause>". Whether a directory's earlier files may be truncated at all is
`run.py`'s decision (it refuses to, unless resuming).

This file computes no metrics and imports neither Ray nor, unless asked for, tensorboard or
wandb (both optional; `require_backends` checks for them before a run creates anything).
"""

from __future__ import annotations

import abc
import importlib
import json
import math
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Self

from avrid.ppo.outputs.outdir import writing
from avrid.ppo.outputs.progress import Progress
from avrid.results.timeline import atomic_write

__all__ = ["PROGRESS_KEYS", "MetricsLogger", "Progress", "SampleDump", "format_step",
           "read_metrics", "require_backends"]

PROGRESS_KEYS = ("train/reward", "val/reward", "time/step")
"""The metrics `format_step` shows by default (the progress bar shows the same three)."""


class _ClosedOnExit(abc.ABC):
    """``with Writer(...) as w:`` closes `w` on the way out, after an error too."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release what the writer holds."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _JsonlAppender:
    """An append-only JSONL file with the resume semantics of the module docstring."""

    def __init__(self, path: str | os.PathLike[str], resume_step: int | None) -> None:
        self.path = Path(path)
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] \
            if resume_step is not None and self.path.exists() else []
        with writing(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is None:
                self.path.write_bytes(b"")
            else:
                text = "".join(_line(r) for r in kept)
                atomic_write(self.path, lambda f: f.write(text.encode()))
            self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def append(self, rows: Sequence[Mapping[str, Any]]) -> None:
        if self._file is None:
            raise ValueError(f"{self.path} is closed")
        text = "".join(_line(r) for r in rows)  # a bad value fails here, not as an I/O error
        # One write per call: the rows of a step land together or (on a crash) not at all.
        with writing(self.path):
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with writing(self.path):  # the last buffered bytes are written here
                file.close()


class MetricsLogger(_ClosedOnExit):
    """Per-step metrics to a JSONL file, plus optional TensorBoard / W&B mirrors.

    Args:
        path: the JSONL file (e.g. ``run/metrics.jsonl``).
        resume_step: when resuming from the checkpoint of step k: keep lines of steps <= k,
            drop the rest. None: start an empty file.
        tensorboard_dir: also write scalars there (needs ``pip install tensorboard``).
        wandb_project: also log to this W&B project (needs ``pip install wandb``). The W&B
            run's id is kept in ``wandb_id.txt`` next to `path`, so a resumed run (one given
            `resume_step`) continues the same W&B run instead of starting a new one.
        wandb_name: the W&B run's display name (default: the name of `path`'s directory).
        wandb_mode: ``"offline"`` logs to local files only (``wandb sync`` uploads them
            later), ``"disabled"`` logs nothing; None: W&B's default, which honours the
            ``WANDB_MODE`` environment variable.
        run_config: the run's config, given to W&B and written as TensorBoard text.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = Path(tmp.name) / "metrics.jsonl"
        >>> with MetricsLogger(path) as log:
        ...     log.log(1, {"train/reward": 0.5, "loss": float("nan")})
        >>> read_metrics(path)
        [{'step': 1, 'train/reward': 0.5, 'loss': None}]
        >>> tmp.cleanup()
    """

    def __init__(self, path: str | os.PathLike[str], *, resume_step: int | None = None,
                 tensorboard_dir: str | os.PathLike[str] | None = None,
                 wandb_project: str | None = None, wandb_name: str | None = None,
                 wandb_mode: str | None = None,
                 run_config: Mapping[str, Any] | None = None) -> None:
        config = dict(run_config or {})
        # Optional backends first: a missing package must fail before the file is touched.
        self._tb: Any = None
        self._wandb: Any = None
        try:
            if tensorboard_dir is not None:
                self._tb = _summary_writer(tensorboard_dir, resume_step)
                if config:
                    self._tb.add_text("config", json.dumps(config, indent=2, default=str))
            if wandb_project is not None:
                self._wandb = _wandb_run(Path(path).resolve().parent, project=wandb_project,
                                         name=wandb_name, mode=wandb_mode, config=config,
                                         resume=resume_step is not None)
            self._out = _JsonlAppender(path, resume_step)
        except BaseException:
            self._close_backends()
            raise

    @property
    def path(self) -> Path:
        return self._out.path

    def log(self, step: int, metrics: Mapping[str, float | int | None]) -> None:
        """Append ``{"step": step, **metrics}`` as one line and flush; mirror to the optional
        backends (non-finite values are skipped there)."""
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; rename that metric")
        row = {"step": int(step), **{k: _scalar(k, v) for k, v in metrics.items()}}
        self._out.append([row])
        finite = {k: v for k, v in row.items() if k != "step" and v is not None}
        if self._tb is not None:
            for k, v in finite.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(finite, step=step)

    def close(self) -> None:
        """Close the file and the optional backends; safe to call twice."""
        self._out.close()
        self._close_backends()

    def _close_backends(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None



class SampleDump(_ClosedOnExit):
    """A few generated samples per step, one JSON line each: ``{"step", "prompt",
    "response", "reward", ...}`` (whatever keys the rows carry). Same resume semantics as
    `MetricsLogger`; tensors and numpy values are converted with ``.tolist()``."""

    def __init__(self, path: str | os.PathLike[str], *,
                 resume_step: int | None = None) -> None:
        self._out = _JsonlAppender(path, resume_step)

    @property
    def path(self) -> Path:
        return self._out.path

    def write(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append one line per row, tagged with `step`, and flush."""
        self._out.append([{"step": int(step), **{k: _jsonable(v) for k, v in r.items()
                                                 if k != "step"}} for r in rows])

    def close(self) -> None:
        self._out.close()



def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every line of a JSONL file written by `MetricsLogger` or `SampleDump`, in order.

    A torn last line (no newline, not valid JSON: an OS crash mid-write) is skipped; a bad
    line anywhere else raises ValueError naming the file and line.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):  # the last piece has no newline after it: torn, skip it
                break
            raise ValueError(f"{path}:{i}: not a JSON line: {e}") from e
    return rows


def format_step(step: int, metrics: Mapping[str, Any],
                keys: Sequence[str] = PROGRESS_KEYS) -> str:
    """A one-line summary of `keys` (those present) for plain-text logs and notebooks.

    Example:
        >>> format_step(7, {"train/reward": 0.51234, "time/step": 3.2, "loss": 1.0})
        'step 7 | train/reward 0.5123 | time/step 3.2'
        >>> format_step(8, {"val/reward": None}, keys=["val/reward"])
        'step 8 | val/reward nan'
    """
    parts = [f"step {step}"]
    for k in keys:
        if k in metrics:
            v = metrics[k]
            text = "nan" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
            parts.append(f"{k} {text}")
    return " | ".join(parts)


def _scalar(key: str, value: Any) -> float | int | None:
    """A metric value as a JSON number (bools and 0-d tensors included), None if
    non-finite."""
    if value is None:
        return None
    if hasattr(value, "item"):  # 0-d tensor or numpy scalar
        value = value.item()
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r} is {type(value).__name__}, not a number")


def _jsonable(value: Any) -> Any:
    """`value` made strict-JSON-able: non-finite floats to None, tensors/arrays to lists."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _line(row: Mapping[str, Any]) -> str:
    # allow_nan=False: a NaN that slipped through fails loudly rather than writing non-JSON.
    return json.dumps(row, allow_nan=False, ensure_ascii=False) + "\n"


def require_backends(*, tensorboard: str | None = None, wandb: str | None = None) -> None:
    """Raise ImportError now if an optional backend that was asked for is not installed.

    Each argument is how the user asked for that backend (e.g. ``"train.tensorboard=true"``),
    named in the error; None: not asked for. A run calls this before it creates anything, so
    a missing package costs nothing but the message.

    Example:
        >>> require_backends(wandb=None)  # nothing asked for: nothing to check
    """
    for asked, module, package in ((tensorboard, "torch.utils.tensorboard", "tensorboard"),
                                   (wandb, "wandb", "wandb")):
        if asked is not None:
            _import(module, package, asked)


def _import(module: str, package: str, asked: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{asked} needs the {package} package, which is not installed: "
                          f"pip install {package}") from e


def _summary_writer(log_dir: str | os.PathLike[str], resume_step: int | None) -> Any:
    writer = _import("torch.utils.tensorboard", "tensorboard", "tensorboard_dir").SummaryWriter
    # purge_step makes TensorBoard hide events past the resumed step, like the JSONL file.
    purge = None if resume_step is None else resume_step + 1
    return writer(log_dir=str(log_dir), purge_step=purge)


WANDB_ID_FILE = "wandb_id.txt"
"""Where, in a run's directory, `MetricsLogger` keeps the id of the run's W&B run."""


def _wandb_run(run_dir: Path, *, project: str, name: str | None, mode: str | None,
               config: dict[str, Any], resume: bool) -> Any:
    wandb = _import("wandb", "wandb", "wandb_project")
    # One W&B run per training run, however often it is resumed: a fresh run draws an id and
    # stores it (atomically: a crash leaves the old id or the new one); a resumed run reads
    # it back, and resume="allow" continues that W&B run (or starts it, if it never reached
    # W&B). Steps the crashed run logged past its checkpoint are logged again: W&B drops them
    # with a warning, keeping the crashed run's values (metrics.jsonl has the resumed run's).
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
    if not run_id:
        run_id = uuid.uuid4().hex[:16]
        with writing(id_file):
            atomic_write(id_file, lambda f: f.write(f"{run_id}\n".encode()))
    options = {"mode": mode} if mode is not None else {}  # None: W&B reads WANDB_MODE
    return wandb.init(project=project, name=name or run_dir.name, id=run_id, resume="allow",
                      dir=str(run_dir), config=config, **options)
