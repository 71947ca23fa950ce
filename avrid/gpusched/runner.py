"""Test tooling — one test in a process of its own: start it, watch its clock, kill its group.

Each scheduled test runs as ``python -m pytest <nodeid>`` in the rootdir, with

- ``CUDA_VISIBLE_DEVICES`` set to the GPUs it was given (so it sees exactly those, numbered
  from 0) and ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (unless already set), so the numbers mean what
  ``nvidia-smi`` calls them;
- ``OMP_NUM_THREADS`` set to its share of the cores, by its share of the GPUs (at least 1): with
  every GPU busy, the threads of all running tests add up to the core count instead of each
  test starting one thread per core;
- a session of its own (``start_new_session=True``), so that it and everything it starts
  (Ray, vLLM's engine core, a stray ``sleep``) form one process group. A test over its time
  limit gets SIGTERM on the whole group, then SIGKILL on the whole group as soon as its own
  process has exited or `KILL_GRACE_S` has passed; a test that ends has any process it left
  behind killed at once: nothing outlives its test to hold a GPU the next test is given.

Its output goes to a file (no pipe to fill and block on), and its reports come back through
`report.py`'s small plugin, which writes them as JSON where ``AVRID_GPUSCHED_REPORT`` says.
`retry_reason` classifies the failures worth a second attempt: CUDA out of memory and
"address already in use", both usually left by another process at start-up, not by the test.

Not here: deciding what runs (`schedule.py`) or turning results into pytest reports.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPORT_ENV = "AVRID_GPUSCHED_REPORT"
"""Where a test's process writes its reports; set only in scheduled tests' processes."""
REPORT_PLUGIN = "avrid.gpusched.report"
"""The plugin (passed with ``-p``) that writes them."""
KILL_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL to a timed-out test's process group."""
OUTPUT_TAIL = 20_000
"""Characters of a test's output kept for its report and the retry check."""

RETRYABLE: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("CUDA out of memory", re.compile(
        r"CUDA out of memory|CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY|"
        r"torch\.(?:cuda\.)?OutOfMemoryError", re.IGNORECASE)),
    ("address already in use", re.compile(
        r"address already in use|EADDRINUSE|\[Errno 98\]", re.IGNORECASE)),
)
"""(reason, pattern) of the failures that are retried: another process held the memory or
the port, so the same test may well pass a moment later. Anything else is the test's own."""


def retry_reason(output: str) -> str | None:
    """Why a failed test's output makes it worth another attempt, or None.

    >>> retry_reason("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    'CUDA out of memory'
    >>> retry_reason("RuntimeError: The server socket has failed to listen on any local "
    ...              "network address. ... [Errno 98] Address already in use")
    'address already in use'
    >>> retry_reason("AssertionError: assert 1 == 2") is None
    True
    """
    for reason, pattern in RETRYABLE:
        if pattern.search(output):
            return reason
    return None


def omp_threads(gpus: int, total_gpus: int, cores: int | None = None) -> int:
    """A test's ``OMP_NUM_THREADS``: its share of the cores by its share of the GPUs, >= 1.

    >>> omp_threads(1, 8, cores=16), omp_threads(4, 8, cores=16), omp_threads(1, 8, cores=2)
    (2, 8, 1)
    """
    cores = cores or os.cpu_count() or 1
    return max(1, cores * gpus // max(1, total_gpus))


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildSpec:
    """Everything needed to start one attempt of one test."""

    nodeid: str
    devices: str
    """Its ``CUDA_VISIBLE_DEVICES``."""
    omp_threads: int
    timeout_s: float
    rootdir: Path
    inifile: Path | None
    """The parent's configuration file, so the test is configured the same way."""
    workdir: Path
    """A fresh folder of this attempt's own: output, reports, the test's basetemp."""

    @property
    def output_path(self) -> Path:
        return self.workdir / "output.txt"

    @property
    def report_path(self) -> Path:
        return self.workdir / "reports.json"

    def command(self) -> list[str]:
        """``python -m pytest <nodeid>`` with the reporting plugin and no cache writes.
        ``-m ""`` undoes an ``-m "not gpu"`` in the ini's addopts: the node id selects."""
        ini = ["-c", str(self.inifile)] if self.inifile is not None else []
        return [sys.executable, "-m", "pytest", self.nodeid, "-p", "no:cacheprovider",
                "-p", REPORT_PLUGIN, "--rootdir", str(self.rootdir), *ini,
                "--basetemp", str(self.workdir / "tmp"), "-m", ""]

    def environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        env = dict(environ)
        env.update(CUDA_VISIBLE_DEVICES=self.devices, OMP_NUM_THREADS=str(self.omp_threads))
        env[REPORT_ENV] = str(self.report_path)
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        return env


@dataclass(frozen=True, slots=True, kw_only=True)
class Exit:
    """How one attempt ended."""

    returncode: int
    """The pytest process's exit status (negative: killed by that signal)."""
    timed_out: bool
    wall_s: float
    """From start to exit, start-up included."""
    output: str
    """The tail of its output (stdout and stderr)."""
    pgid: int
    """Its process group (= its pid), killed whole when it timed out."""


def kill_group(pgid: int, sig: int) -> bool:
    """Send `sig` to every process of group `pgid`; False if none is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


class Child:
    """One running attempt of one test; `poll` it until it returns its `Exit`."""

    def __init__(self, spec: ChildSpec, *, environ: Mapping[str, str] | None = None,
                 grace_s: float = KILL_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec, self.grace_s, self._clock = spec, grace_s, clock
        spec.workdir.mkdir(parents=True, exist_ok=True)
        with open(spec.output_path, "wb") as out:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                spec.command(), cwd=spec.rootdir, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env=spec.environment(os.environ if environ is None else environ))
        self.started = clock()
        self.pgid = self.process.pid  # a session leader's group id is its pid
        self._term_sent: float | None = None
        self._kill_sent = False

    @property
    def timed_out(self) -> bool:
        return self._term_sent is not None

    def poll(self) -> Exit | None:
        """The `Exit` once the process has ended, else None; enforces the time limit (never
        blocks: SIGTERM now, SIGKILL at a later poll once the grace has passed)."""
        now = self._clock()
        returncode = self.process.poll()
        if returncode is not None:
            kill_group(self.pgid, signal.SIGKILL)  # whatever it left behind
            return Exit(returncode=returncode, timed_out=self.timed_out,
                        wall_s=now - self.started, output=self._output(), pgid=self.pgid)
        if self._term_sent is None and now - self.started > self.spec.timeout_s:
            self._term_sent = now
            kill_group(self.pgid, signal.SIGTERM)
        elif (self._term_sent is not None and not self._kill_sent
              and now - self._term_sent > self.grace_s):
            self._kill_sent = True
            kill_group(self.pgid, signal.SIGKILL)
        return None

    def kill(self) -> None:
        """Stop it now, whole group, and wait for it (the run is being abandoned)."""
        kill_group(self.pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=self.grace_s)
        kill_group(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=self.grace_s)

    def _output(self) -> str:
        try:
            with open(self.spec.output_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4 * OUTPUT_TAIL))
                text = f.read().decode(errors="replace")
        except OSError as err:
            return f"(its output could not be read: {err})"
        return text[-OUTPUT_TAIL:]
