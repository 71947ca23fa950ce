"""Chapter 7 — the step pool: environments' steps on a few daemon threads, each under a time
limit, all abandoned at the first failure.

The episode loop hands every `env.step` to this pool and goes back to the engine. A step
runs on one of at most `threads` worker threads (started as needed, fed by a queue), inside
a copy of the submitter's `contextvars` context (a ContextVar the caller set, e.g. which
tool backend to use, is seen by the step). What the pool guarantees the loop:

    a step raises            no queued step starts after it; the loop gets the error
    a step runs past wall_s  reported as overdue at its deadline (the loop raises then)
    the loop stops (close)   queued steps never start; idle threads end and are joined;
                             a thread still inside a step is abandoned

Python cannot stop a thread from outside, so a hung step is abandoned, not killed: its
thread is a daemon (neither the caller nor interpreter exit waits for it) and ends by itself
if the step ever returns (its result is dropped). The cost is bounded: a pool never has
more than `threads` threads, so one `run_episodes` call leaves at most `tool_threads`
threads behind, each counted in `StepPool.abandoned`, and only while its step still runs.
That is why `concurrent.futures.ThreadPoolExecutor` is not used: leaving its `with` block
waits for every running step, and its threads are joined at interpreter exit, so one hung
step would hang the caller and then the process.

Not here: what a step is and what it must return (`env.py`), the loop and its errors
(`episodes.py`). Killing a runaway tool is the sandbox's job (`sandbox.py`): the pool only
stops waiting.
"""

from __future__ import annotations

import contextvars
import itertools
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

THREAD_NAME = "avrid-env"
"""Every pool thread's name starts with it (`avrid-env-3.0`: pool 3, its first thread)."""

_pool_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class Finished:
    """One step's outcome: its value, or the error it raised, or `overdue` (still running
    after the pool's `wall_s`: abandoned, no value will come)."""

    key: Hashable
    value: Any = None
    error: BaseException | None = None
    overdue: bool = False


@dataclass(slots=True)
class _Job:
    key: Hashable
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    context: contextvars.Context
    started: float = 0.0  # time.monotonic() when a thread took it


@dataclass(slots=True)
class _State:
    """What the threads and the submitter share, under `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    stopped: bool = False  # a step failed or the pool closed: no queued step starts
    unfinished: int = 0  # submitted, not yet finished (queued or running)
    running: dict[threading.Thread, _Job] = field(default_factory=dict)


class StepPool:
    """Runs steps on at most `threads` daemon threads; `finished` reports what ended (see
    the module docstring). Use it as a context manager: leaving it closes the pool without
    waiting for steps still running.

    Example:
        >>> with StepPool(threads=2, wall_s=5.0) as pool:
        ...     pool.submit("a", pow, 2, 10)
        ...     [(f.key, f.value) for f in pool.finished(wait=True)]
        [('a', 1024)]
    """

    def __init__(self, threads: int, *, wall_s: float) -> None:
        if threads < 1:
            raise ValueError(f"a StepPool needs threads >= 1, got {threads!r}")
        self.max_threads = threads
        self.wall_s = wall_s
        self.abandoned = 0
        """Threads left inside a step when the pool closed (each ends if its step returns)."""
        self._name = f"{THREAD_NAME}-{next(_pool_ids)}"
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self._state = _State()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> StepPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)`, run in a copy of the caller's context; its outcome comes back
        from `finished` under `key`. Once the pool has stopped it is dropped: it would never
        start, and `finished` reports the failure that stopped the pool."""
        job = _Job(key, fn, args, contextvars.copy_context())
        s = self._state
        with s.lock:
            if s.stopped:
                return
            s.unfinished += 1
            # A new thread only while there are more steps than threads: never more than
            # `max_threads`, and none for a step an idle thread will take.
            start = s.unfinished > len(self._threads) and len(self._threads) < self.max_threads
            if start:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._name}.{len(self._threads)}")
                self._threads.append(thread)
        self._jobs.put(job)
        if start:
            thread.start()

    def finished(self, *, wait: bool) -> list[Finished]:
        """Outcomes of the steps that ended since the last call, in the order they ended;
        with `wait`, blocks until there is at least one. A step still running `wall_s`
        after it started comes back as `overdue` at its deadline, and stops the pool."""
        out: list[Finished] = []
        s = self._state
        while True:
            with s.lock:
                now = time.monotonic()
                late = [j for j in s.running.values() if now - j.started >= self.wall_s]
                if late:
                    s.stopped = True
                    first = min(late, key=lambda j: j.started)
                    return [*out, Finished(first.key, overdue=True)]
                deadline = min((j.started + self.wall_s for j in s.running.values()),
                               default=now + self.wall_s)
                idle = s.unfinished == 0  # every outcome is in `_done` already
            block = wait and not out and not (idle and self._done.empty())
            try:
                # Wake at the next deadline at the latest (a step that starts later has a
                # later one: waking after wall_s and looking again is soon enough).
                out.append(self._done.get(timeout=max(0.0, deadline - now)) if block
                           else self._done.get_nowait())
            except queue.Empty:
                if not block:
                    return out

    def close(self) -> int:
        """Stop: queued steps never start, idle threads end (joined here), a thread inside a
        step is abandoned (not waited for). Returns how many were abandoned."""
        s = self._state
        with s.lock:
            s.stopped = True
            busy = set(s.running)
            self.abandoned = len(busy)
        for _ in self._threads:  # one wake-up per thread, whatever it is doing
            self._jobs.put(None)
        for thread in self._threads:
            # A thread outside a step now never starts one again (it checks `stopped`
            # under the lock before it does): joining it takes no longer than a wake-up.
            if thread not in busy and thread.ident is not None:
                thread.join()
        return self.abandoned

    def _work(self) -> None:
        me = threading.current_thread()
        s = self._state
        while True:
            job = self._jobs.get()
            with s.lock:
                if job is None or s.stopped:
                    return
                job.started = time.monotonic()
                s.running[me] = job
            try:
                result = Finished(job.key, value=job.context.run(job.fn, *job.args))
            except BaseException as e:  # noqa: BLE001 - any failure is the loop's to report
                result = Finished(job.key, error=e)
            with s.lock:
                del s.running[me]
                if result.error is not None:
                    s.stopped = True  # fail fast: no queued step starts after a failure
            self._done.put(result)
            with s.lock:
                s.unfinished -= 1
