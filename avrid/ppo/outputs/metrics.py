"""Chapter 5 — what a training run writes down: metrics, sample dumps and a progress bar.

- `MetricsLogger` appends one JSON line per step to ``metrics.jsonl`` (the source of truth,
  read back by `read_metrics` and plotted by `avrid.ppo.outputs.plots`), and optionally mirrors the
  numbers to TensorBoard and/or Weights & Biases;
- `SampleDump` appends a few (prompt, response, reward) rows per step to ``samples.jsonl``,
  because a reward curve alone does not show *what* the policy learned (or how it hacked the
  reward);
- `Progress` is a thin tqdm bar, and `format_step` a one-line text summary for logs and
  notebooks.

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
wandb (both optional).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Self

from avrid.ppo.outputs.outdir import writing
from avrid.results.timeline import atomic_write

PROGRESS_KEYS = ("train/reward", "val/reward", "time/step")
"""The metrics `Progress` and `format_step` show by default."""


class _ClosedOnExit:
    """``with Writer(...) as w:`` closes `w` on the way out, after an error too."""

    def close(self) -> None:
        raise NotImplementedError

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
        wandb_project: also log to this W&B project (needs ``pip install wandb``).
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
                 wandb_project: str | None = None,
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
                self._wandb = _wandb_run(wandb_project, config, resume_step)
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


class Progress(_ClosedOnExit):
    """A tqdm progress bar over training steps with a short postfix: train reward, val
    reward (when that step has one) and seconds per step.

    Args:
        total: the number of steps of the run.
        initial: steps already done (on resume).
        enabled: False prints nothing at all (e.g. on non-zero ranks or in tests).
        file: where the bar is drawn (default stderr).
    """

    def __init__(self, total: int, *, initial: int = 0, enabled: bool = True,
                 file: IO[str] | None = None) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                         dynamic_ncols=True, file=file if file is not None else sys.stderr)
        self._done = initial

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move the bar to `step` steps done and show `metrics`' headline numbers."""
        if step > self._done:
            self._bar.update(step - self._done)
            self._done = step
        if metrics:
            short = {"reward": "train/reward", "val": "val/reward", "s/step": "time/step"}
            post = {k: f"{metrics[m]:.3g}" for k, m in short.items()
                    if isinstance(metrics.get(m), int | float)}
            self._bar.set_postfix(post, refresh=True)

    def close(self) -> None:
        self._bar.close()



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


def _summary_writer(log_dir: str | os.PathLike[str], resume_step: int | None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("tensorboard_dir was given but TensorBoard is not installed: "
                          "pip install tensorboard") from e
    # purge_step makes TensorBoard hide events past the resumed step, like the JSONL file.
    purge = None if resume_step is None else resume_step + 1
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge)


def _wandb_run(project: str, config: dict[str, Any], resume_step: int | None) -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ImportError("wandb_project was given but Weights & Biases is not installed: "
                          "pip install wandb") from e
    # A resumed run starts a new W&B run; its steps continue from resume_step + 1.
    return wandb.init(project=project, config=config,
                      notes=None if resume_step is None else f"resumed at step {resume_step}")

