"""Chapter 7 — partial rollouts: new weights that arrive while episodes are being generated.

In chapter 6 a weight push waits for the generation in flight: a long episode holds every
update back, and the engine holds old weights for as long as the slowest episode runs. Here a
push lands in the middle: the rollout rank receives the trainer's weights on a thread of its
own (a worker lane, `Worker.lanes`) while its episode loop keeps generating, and hands them
over through a `WeightMailbox`:

    receiving thread (lane)                    generating thread (the episode loop)
    ───────────────────────                    ────────────────────────────────────
    receive every bucket (no engine needed)    ... engine call ...
    mailbox.deliver(install) ──── waits ─┐     mailbox.poll()  before the next engine call:
                                         └──── runs install: load, fingerprint, new version
    returns the engine's fingerprints ◄──      next engine call: tokens of the new version

The engine is never written while it generates: weights load only between two engine calls
(the episodes go on from their tokens so far: "abort and resume" at a call boundary, which a
segmented turn, `rollout.agent_segment_tokens`, makes frequent), or at once when no
generation runs. Every token records the version `poll` returned before the call that made
it (`episodes.py`), so a trajectory's staleness is its oldest token's.

Not here: receiving the buckets (chapter 6's `RolloutWorker.receive_weights`), the lanes
(`avrid.workers`), when the driver pushes (`avrid.pipeline.driver`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class WeightMailbox:
    """Hands received weights from the receiving thread to the generating one (a
    `WeightSource` for `run_episodes`).

    Example (one thread plays both parts: no generation runs, so a delivery installs at once):
        >>> box = WeightMailbox(version=0)
        >>> box.deliver(1, lambda: "loaded", timeout_s=1.0)
        'loaded'
        >>> box.version
        1
    """

    def __init__(self, version: int | None = None) -> None:
        self.version = version
        """The version the engine holds (None: none received yet)."""
        self._lock = threading.Lock()
        self._loaded = threading.Condition(self._lock)  # notified whenever a version loads
        self._generating = False
        self._staged: _Delivery | None = None

    @property
    def waiting(self) -> int | None:
        """The version delivered and not yet loaded (None: nothing waits)."""
        staged = self._staged
        return None if staged is None else staged.version

    def begin(self, min_version: int, *, timeout_s: float) -> None:
        """A generation launched after the push of `min_version` starts: first wait until
        that push has loaded (it is received on another thread, so it may still be on its
        way), then from now on a delivery waits for a call boundary."""
        with self._lock:
            ok = self._loaded.wait_for(
                lambda: self.version is not None and self.version >= min_version, timeout_s)
            if not ok:
                raise TimeoutError(f"the generation was launched after the push of version "
                                   f"{min_version}, which did not load within {timeout_s} s "
                                   f"(the engine holds version {self.version})")
            self._generating = True

    def poll(self) -> int:
        """Before an engine call: install what was delivered, if anything; the version the
        engine now holds."""
        with self._lock:
            self._install_staged()
            if self.version is None:
                raise RuntimeError("no weights received yet; the driver pushes them before "
                                   "the first generation")
            return self.version

    def end(self) -> None:
        """The generation ended (or failed): install what is waiting, so no delivery waits
        for a call that will not come."""
        with self._lock:
            self._generating = False
            self._install_staged()

    def deliver(self, version: int, install: Callable[[], Any], *, timeout_s: float) -> Any:
        """Have `install` (load the received weights into the engine) run where it is safe:
        now if no generation runs, else on the generating thread before its next engine
        call; return what it returned (or raise what it raised). Waits at most `timeout_s`
        for that call boundary."""
        delivery = _Delivery(version=version, install=install)
        with self._lock:
            if self._staged is not None:
                raise RuntimeError(f"weights of version {self._staged.version} are still "
                                   f"waiting to load; pushes land one at a time")
            if not self._generating:
                self._load(delivery)
                return delivery.result()
            self._staged = delivery
        if not delivery.done.wait(timeout_s):
            with self._lock:
                if self._staged is delivery:  # withdrawn: the engine keeps its weights
                    self._staged = None
            raise TimeoutError(f"weights of version {version} were received but the "
                               f"generation in flight reached no engine-call boundary within "
                               f"{timeout_s} s, where they could load")
        return delivery.result()

    def _install_staged(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            self._load(staged)

    def _load(self, delivery: _Delivery) -> None:
        """Run a delivery's install (the caller holds the lock); on success the engine holds
        its version, and whoever waits for a version is woken."""
        try:
            delivery.value = delivery.install()
            self.version = delivery.version
            self._loaded.notify_all()
        except BaseException as e:  # the receiving thread's caller reports it
            delivery.error = e
        delivery.done.set()


class _Delivery:
    """One push's weights, waiting to be installed; `done` is set once they were (or failed)."""

    def __init__(self, *, version: int, install: Callable[[], Any]) -> None:
        self.version, self.install = version, install
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value
