"""Chapter 5 — the run on screen: a progress bar that keeps printed lines off its own line.

`Progress` is a thin tqdm bar over training steps. Two things make it more than
``tqdm(total=steps)``:

- its clock starts with the first step (`Progress.start`), not when it is made: a run makes
  it before Ray and the workers start, and their start-up is not a step;
- while it is shown, stdout and stderr go through it (`_ThroughBar`): a line printed by the
  run, a warning, or a worker's output that Ray relays to the driver (``(PolicyWorker
  pid=...) ...``) is written above the bar instead of onto the bar's line.

`avrid.ppo.outputs.metrics.format_step` is the plain-text alternative, one line per step.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from typing import IO, Any, Self


class Progress:
    """A tqdm progress bar over training steps with a short postfix: train reward, val
    reward (when that step has one) and seconds per step.

    Nothing is drawn until `start` (or the first `update`); from then until `close`, stdout
    and stderr go through the bar. In a notebook the bar is a widget if ipywidgets is
    installed, else plain text (tqdm's own choice would warn "IProgress not found" in red).

    Args:
        total: the number of steps of the run.
        initial: steps already done (on resume).
        enabled: False prints nothing at all (e.g. on non-zero ranks or in tests).
        file: where the bar is drawn (default stderr).
    """

    def __init__(self, total: int, *, initial: int = 0, enabled: bool = True,
                 file: IO[str] | None = None) -> None:
        self._args = {"total": total, "initial": initial, "disable": not enabled}
        self._file = file
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
        self._bar = _bar_class()(**self._args, unit="step", dynamic_ncols=True,
                                 file=self._file if self._file is not None else sys.stderr)
        if not self._bar.disable:
            self._streams = sys.stdout, sys.stderr
            sys.stdout = _ThroughBar(self._bar, sys.stdout)
            sys.stderr = _ThroughBar(self._bar, sys.stderr)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move the bar to `step` steps done and show `metrics`' headline numbers."""
        self.start()
        if step > self._done:
            self._bar.update(step - self._done)
            self._done = step
        if metrics:
            short = {"reward": "train/reward", "val": "val/reward", "s/step": "time/step"}
            post = {k: f"{metrics[m]:.3g}" for k, m in short.items()
                    if isinstance(metrics.get(m), int | float)}
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


def _bar_class() -> Any:
    """tqdm's notebook widget where it can work (ipywidgets installed), else its text bar."""
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm
