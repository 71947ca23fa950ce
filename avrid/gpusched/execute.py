"""Test tooling — the live run: the scheduler driven by real test processes as they end.

The same `Scheduler` (and so the same policy) that plans a run over expected durations here
decides on the real clock: at the start, and each time a test's process ends, it is asked what
starts now; what it starts is launched at once on the GPUs it chose. A test that failed for a
reason `runner.retry_reason` recognises goes back into the queue at its place in the policy's
order, at most `retries` times; every other end is final and handed to `on_done` at once, so
results appear as tests finish, not at the end.

Not here: processes (`runner.py`), the policy, or pytest (the plugin passes callables).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from avrid.gpusched.runner import Child, Exit, retry_reason
from avrid.gpusched.schedule import Job, Scheduler, Start

POLL_S = 0.02
"""How often running tests are polled: well under any test's start-up, and light on a CPU."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    """One run of one test's process (a retried test has several)."""

    job: Job
    gpus: tuple[str, ...]
    number: int
    """1 for the first attempt."""
    start: float
    end: float
    exit: Exit
    retried_because: str | None = None
    """Why another attempt followed (None: this attempt was the last)."""
    earlier: tuple[str, ...] = ()
    """Why each earlier attempt of the same test was retried."""


def execute(scheduler: Scheduler, launch: Callable[[Start, int], Child], *, retries: int,
            on_done: Callable[[Attempt], None], should_stop: Callable[[], bool] = lambda: False,
            clock: Callable[[], float] = time.monotonic,
            poll_s: float = POLL_S) -> list[Attempt]:
    """Run every test `scheduler` holds; return all attempts, in the order they ended.

    `launch(start, attempt_number)` starts one test's process. When `should_stop()` turns true
    (pytest's ``-x``, ``--maxfail``) nothing more starts and what runs is killed, unreported.
    The processes still running when this returns early (an exception, Ctrl-C) are killed too.
    """
    running: dict[str, tuple[Start, Child, int]] = {}
    reasons: dict[str, tuple[str, ...]] = {}
    attempts: list[Attempt] = []
    try:
        while not scheduler.done:
            for start in scheduler.starts(clock()):
                number = len(reasons.setdefault(start.job.name, ())) + 1
                running[start.job.name] = (start, launch(start, number), number)
            if not running:  # nothing runs and nothing could start: a policy bug
                raise RuntimeError(f"nothing running and {len(scheduler.waiting)} tests waiting")
            time.sleep(poll_s)
            for name, (start, child, number) in list(running.items()):
                exit = child.poll()
                if exit is None:
                    continue
                del running[name]
                end = clock()
                scheduler.finish(name, end)
                reason = (retry_reason(exit.output)
                          if exit.returncode != 0 and not exit.timed_out else None)
                again = reason is not None and number <= retries
                attempt = Attempt(job=start.job, gpus=start.gpus, number=number,
                                  start=child.started, end=end, exit=exit,
                                  retried_because=reason if again else None,
                                  earlier=reasons[name])
                attempts.append(attempt)
                if again:
                    reasons[name] += (str(reason),)
                    scheduler.retry(start.job)
                else:
                    on_done(attempt)
            if should_stop():
                break
    finally:
        for _, child, _ in running.values():
            child.kill()
    return attempts
