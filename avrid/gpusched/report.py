"""Test tooling — a test's result across the process boundary, back into pytest's reports.

Two halves of one format:

- In the test's own process this module is a pytest plugin (``-p avrid.gpusched.report``,
  active only where ``AVRID_GPUSCHED_REPORT`` names a file). After each phase (setup, call,
  teardown) it rewrites that file, atomically, with every report so far in pytest's own
  serialised form (``pytest_report_to_serializable``, what pytest-xdist sends its workers'
  reports in): tracebacks, captured output, skip reasons and xfail survive whole, and a test
  killed in its call phase still leaves its setup report behind.
- In the scheduling process, `read_reports` and `complete_reports` read them back
  (``pytest_report_from_serializable``) and complete what is missing: a phase cut short by
  the time limit or a crash becomes a failed report whose message says what happened, with
  the tail of the process's output; a test that cannot run on the inventory becomes a skip.
  The result is always a whole setup, call, teardown sequence, so the terminal, junitxml and
  ``-x`` see what they would have seen without the scheduler.

Not here: running the process (`runner.py`) or calling the report hooks (`plugin.py`).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from avrid.gpusched.runner import REPORT_ENV, Exit

PHASES = ("setup", "call", "teardown")
SECTION = "gpusched"
"""The heading under which a report says where and how its test ran."""


# --- the test's own process: write every report as it comes ---


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        config.pluginmanager.register(_Recorder(config, Path(path)), "avrid-gpusched-recorder")


class _Recorder:
    """Keeps the serialised reports of this process and rewrites the file after each."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config, self.path, self.reports = config, path, []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._keep(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:  # why the test never ran: an import error, a bad parametrisation
            self._keep(report)

    def _keep(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        self.reports.append(self.config.hook.pytest_report_to_serializable(
            config=self.config, report=report))
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.reports, f)
        os.replace(tmp, self.path)


# --- the scheduling process: read them back and make the sequence whole ---


def read_reports(path: Path, config: pytest.Config) -> list[Any]:
    """The reports a test's process wrote (none if it wrote no file or a torn one)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    for d in data:  # JSON has no tuples; a skip's (path, line, reason) must be one again
        for key in ("longrepr", "location"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
    return [config.hook.pytest_report_from_serializable(config=config, data=d) for d in data]


def _report(item: pytest.Item, when: str, outcome: str, longrepr: Any = None,
            sections: tuple[tuple[str, str], ...] = (), duration: float = 0.0) -> Any:
    return pytest.TestReport(
        nodeid=item.nodeid, location=item.location,
        keywords={k: 1 for k in item.keywords}, outcome=outcome,  # type: ignore[arg-type]
        longrepr=longrepr, when=when, sections=sections, duration=duration)  # type: ignore[arg-type]


def skip_reports(item: pytest.Item, reason: str) -> list[Any]:
    """A test the inventory can never run, reported as skipped (setup) with `reason`."""
    path, line, _ = item.location
    return [_report(item, "setup", "skipped", (path, (line or 0) + 1, f"Skipped: {reason}")),
            _report(item, "teardown", "passed")]


def describe_exit(exit: Exit, phase: str, timeout_s: float, grace_s: float) -> str:
    """What cut a test's `phase` short, as the first lines of its failure."""
    if exit.timed_out:
        return (f"timed out after {timeout_s:g} s in its {phase}: its process group "
                f"{exit.pgid} was killed (SIGTERM, then SIGKILL to whatever was left at once "
                f"the test's process had exited, or after {grace_s:g} s)")
    how = (f"was killed by signal {-exit.returncode}" if exit.returncode < 0
           else f"exited with status {exit.returncode}")
    return (f"the test's process {how} without reporting its {phase} (a crash, an "
            f"interpreter exit, or no test collected under this node id)")


def complete_reports(item: pytest.Item, exit: Exit, reports: list[Any], *, timeout_s: float,
                 grace_s: float, note: str) -> list[Any]:
    """The setup, call and teardown reports of `item`, its process's own where it wrote
    them, a failure in the first phase it did not report, and `note` (where it ran) as a
    section of the report that matters (the failed one, else the call)."""
    own = [r for r in reports if isinstance(r, pytest.TestReport) and r.nodeid == item.nodeid]
    by_phase = {r.when: r for r in own}
    out: list[Any] = []
    for phase in PHASES:
        if phase in by_phase:
            out.append(by_phase[phase])
            continue
        if phase == "call" and out and out[-1].outcome != "passed":
            continue  # a failed or skipped setup: pytest runs no call either
        collect = [r for r in reports if isinstance(r, pytest.CollectReport)]
        detail = "\n".join(str(r.longrepr) for r in collect if r.longrepr)
        message = describe_exit(exit, phase, timeout_s, grace_s)
        text = "\n\n".join(p for p in (message, detail, f"its output (tail):\n{exit.output}")
                           if p)
        out.append(_report(item, phase, "failed", text))
        if phase != "teardown":
            out.append(_report(item, "teardown", "passed"))
        break
    target = next((r for r in out if r.failed), None) or next(
        (r for r in out if r.when == "call"), out[0])
    target.sections = [*target.sections, (SECTION, note)]
    return out
