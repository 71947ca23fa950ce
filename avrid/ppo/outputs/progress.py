"""Chapter 5 — the run on screen: a progress bar that keeps printed lines off its own line.

`Progress` is a thin tqdm bar over training steps. Two things make it more than
``tqdm(total=steps)``:

- its clock starts with the first step (`Progress.start`), not when it is made: a run makes
  it before Ray and the workers start, and their start-up is not a step;
- while it is shown, stdout and stderr go through it (`_ThroughBar`): a line printed by the
  run, a warning, or a worker's output that Ray relays to the driver (``(PolicyWorker
  pid=...) ...``) is written above the bar instead of onto the bar's line.

Where the bar's stream is not a terminal (a CI log, a batch job's file, a pipe) a bar redrawn
in place is one line of hundreds of carriage-return updates; there `Progress` writes a plain
line instead (`_LogLines`), every `every_steps` steps or `every_s` seconds, whichever comes
first, and at the last step. A notebook's streams are not terminals either, but draw the bar
in place: it keeps the bar.

`avrid.ppo.outputs.metrics.format_step` is the plain-text alternative, one line per step.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Mapping
from typing import IO, Any, Self


class Progress:
    """A tqdm progress bar over training steps with a short postfix: train reward, val
    reward (when that step has one) and seconds per step.

    Nothing is drawn until `start` (or the first `update`); from then until `close`, stdout
    and stderr go through the bar. In a notebook the bar is a widget if ipywidgets is
    installed, else plain text (tqdm's own choice would warn "IProgress not found" in red).
    Where `file` is not a terminal (nor a notebook's stream) there is no bar: a plain line
    every `every_steps` steps or `every_s` seconds, whichever comes first, and at the end.

    Args:
        total: the number of steps of the run.
        initial: steps already done (on resume).
        enabled: False prints nothing at all (e.g. on non-zero ranks or in tests).
        file: where the bar is drawn (default stderr).
        every_steps: steps between two plain lines (not a terminal); > 0.
        every_s: seconds after which a step gets a plain line all the same; >= 0.
    """

    def __init__(self, total: int, *, initial: int = 0, enabled: bool = True,
                 file: IO[str] | None = None, every_steps: int = 10,
                 every_s: float = 60.0) -> None:
        if every_steps < 1 or every_s < 0:
            raise ValueError(f"Progress: every_steps must be >= 1 and every_s >= 0, got "
                             f"{every_steps!r} and {every_s!r}")
        self._args = {"total": total, "initial": initial, "disable": not enabled}
        self._file = file
        self._every = every_steps, every_s
        self._bar: Any = None
        self._streams: tuple[Any, Any] | None = None  # sys.stdout/stderr while redirected
        self._done = initial

    def start(self) -> None:
        """Draw the bar and start its clock (once; `update` calls it if need be)."""
        if self._bar is not None:
            return
        # Lines printed before the bar go above it: a piped stdout is block-buffered, the
        # bar's stderr is not.
        sys.stdout.flush()
        file = self._file if self._file is not None else sys.stderr
        if not self._args["disable"] and not _redraws_in_place(file):
            # Plain lines: nothing is redrawn, so printed lines need not go through anything.
            self._bar = _LogLines(file, self._args["total"], self._args["initial"], *self._every)
            return
        self._bar = _bar_class()(**self._args, unit="step", dynamic_ncols=True, file=file)
        if not self._bar.disable:
            self._streams = sys.stdout, sys.stderr
            sys.stdout = _ThroughBar(self._bar, sys.stdout)
            sys.stderr = _ThroughBar(self._bar, sys.stderr)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move the bar to `step` steps done and show `metrics`' headline numbers."""
        self.start()
        short = {"reward": "train/reward", "val": "val/reward", "s/step": "time/step"}
        post = {k: f"{metrics[m]:.3g}" for k, m in short.items()
                if isinstance((metrics or {}).get(m), int | float)}
        if isinstance(self._bar, _LogLines):
            self._bar.update(step, post)
            return
        if step > self._done:
            self._bar.update(step - self._done)
            self._done = step
        if metrics:
            self._bar.set_postfix(post, refresh=True)

    def close(self) -> None:
        """Leave the bar as it last was and put stdout and stderr back; safe to call twice."""
        if self._streams is not None:
            for name, original in zip(("stdout", "stderr"), self._streams, strict=True):
                through = getattr(sys, name)
                if isinstance(through, _ThroughBar) and through.bar is self._bar:
                    through.flush_pending()  # (a stream swapped since by others stays)
                    setattr(sys, name, original)
            self._streams = None
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ThroughBar:
    """Stands in for sys.stdout or sys.stderr while a bar is shown: each whole line is
    written above the bar (a part line waits for its newline, which `print` writes
    separately). Ray's thread that relays the workers' output writes here too, hence the
    bar's lock."""

    def __init__(self, bar: Any, stream: IO[str]) -> None:
        self.bar, self.stream, self._pending = bar, stream, ""

    def write(self, text: str) -> int:
        lines, newline, self._pending = (self._pending + text).rpartition("\n")
        if newline:
            with self.bar.get_lock():
                self.bar.clear(nolock=True)
                self.stream.write(lines + newline)
                self.stream.flush()
                self.bar.refresh(nolock=True)
        return len(text)

    def flush_pending(self) -> None:
        text, self._pending = self._pending, ""
        if text:
            self.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


class _LogLines:
    """The progress of a run where its stream is not a terminal: a plain line ("step 20/300
    (7%) | reward=0.6 val=0.53 s/step=0.4 | 00:09 elapsed, 02:05 left") every `every_steps`
    steps or `every_s` seconds, whichever comes first, and at the last step (or at `close`,
    where the run stopped). Each headline number is the latest one given (the validation
    reward is measured only every `val_every` steps)."""

    def __init__(self, file: IO[str], total: int, initial: int, every_steps: int,
                 every_s: float) -> None:
        self.file, self.total, self.initial = file, total, initial
        self.every_steps, self.every_s = every_steps, every_s
        self.started = self.last_time = time.monotonic()
        self.done = self.last_step = initial
        self.numbers: dict[str, str] = {}

    def update(self, step: int, post: Mapping[str, str]) -> None:
        """`step` steps done, with these headline numbers; a line if one is due."""
        self.numbers.update(post)
        if step <= self.done:
            return
        self.done = step
        now = time.monotonic()
        if (step - self.last_step >= self.every_steps or now - self.last_time >= self.every_s
                or step == self.total):
            self._line(now)

    def _line(self, now: float) -> None:
        from tqdm.std import tqdm

        elapsed, steps = now - self.started, self.done - self.initial
        left = elapsed / steps * (self.total - self.done) if steps > 0 else 0.0
        numbers = " ".join(f"{k}={v}" for k, v in self.numbers.items())
        self.file.write(f"step {self.done}/{self.total} ({100 * self.done // max(self.total, 1)}%)"
                        f" | {numbers} | {tqdm.format_interval(elapsed)} elapsed, "
                        f"{tqdm.format_interval(left)} left\n")
        self.file.flush()
        self.last_step, self.last_time = self.done, now

    def close(self) -> None:
        """A last line for steps done since the last one (a run that stopped early)."""
        if self.done != self.last_step:
            self._line(time.monotonic())


def _redraws_in_place(file: IO[str]) -> bool:
    """Whether a bar drawn on `file` is redrawn in place: a terminal, or a notebook's stream
    (not a terminal, but the notebook shows carriage returns, or the widget, in place)."""
    try:
        if file.isatty():
            return True
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        pass
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _bar_class() -> Any:
    """tqdm's notebook widget where it can work (ipywidgets installed), else its text bar."""
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm
