"""Test tooling — the pytest plugin: ``--gpus`` runs the GPU tier side by side, scheduled.

Installed with avrid as a ``pytest11`` entry point (``avrid-gpusched``), so any project with
avrid installed has it. Without ``--gpus`` it does nothing at all: pytest runs as before.
With it, e.g. ``pytest -m "gpu or vllm" --gpus 0,1,2,3``:

1. every collected test with a ``gpu`` or ``vllm`` marker becomes a job (`needs.py`), with
   an expected duration (`durations.py`); tests the inventory can never run are reported
   skipped, with the reason;
2. the policy is played out once over the expected durations (`plan.py`) and the planned
   makespan printed;
3. the same policy then runs them live (`execute.py`): each test in its own process on the
   GPUs it was given (`runner.py`), its reports replayed into this process's pytest as it ends
   (`report.py`), so the terminal, ``-x``, junitxml and the exit status work as usual;
4. tests with neither marker run afterwards in this process, one after another, as usual;
5. measured durations go back to the cache, and the summary (`summary.py`) is printed.

Options: ``--gpus`` (ids, ``all`` or ``fake:N``: see `inventory.py`), ``--gpu-timeout``
(seconds per test; a marker's ``timeout_s`` overrides it), ``--gpu-retries`` (extra attempts
for CUDA out-of-memory and address-in-use failures) and ``--gpu-durations`` (the cache file,
in a folder that exists: the plugin writes that one file and creates no folder). A test with
two ``gpu`` markers at one level (two stacked decorators) is refused, naming it: which of the
two counts would be a guess.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from avrid.gpusched.durations import DEFAULT_PATH, Durations, load_durations, save_durations
from avrid.gpusched.execute import Attempt, execute
from avrid.gpusched.inventory import Inventory, InventoryError, parse_gpus
from avrid.gpusched.needs import GpuNeeds, MarkerError, needs_of
from avrid.gpusched.plan import simulate
from avrid.gpusched.report import complete_reports, read_reports, skip_reports
from avrid.gpusched.runner import KILL_GRACE_S, REPORT_ENV, Child, ChildSpec, omp_threads
from avrid.gpusched.schedule import Fcfs, Job, LongestFirstBackfill, Scheduler, Start
from avrid.gpusched.summary import RunStats, measured_times, run_stats, summary_lines

DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_RETRIES = 1
MARKERS = {
    "gpu": "gpu(count=1, memory_gb=None, duration_s=None, timeout_s=None): needs `count` "
           "whole GPUs (with `memory_gb` free on each); `duration_s` and `timeout_s` guide "
           "the --gpus scheduler",
    "vllm": "vllm: needs the vllm package; under --gpus, one GPU",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpusched", "GPU test scheduling (avrid.gpusched)")
    group.addoption("--gpus", default=None, metavar="IDS|all|fake:N",
                    help="run gpu/vllm-marked tests side by side, each in its own process on "
                         "the GPUs it needs: comma-separated ids, 'all' (nvidia-smi), or "
                         "'fake:N' / 'fake:NxM' (N simulated GPUs of M GiB, for CPU hosts)")
    group.addoption("--gpu-timeout", default=str(DEFAULT_TIMEOUT_S), metavar="SECONDS",
                    help=f"per-test time limit under --gpus, after which its whole process "
                         f"group is killed (default {DEFAULT_TIMEOUT_S:g}; a marker's "
                         f"timeout_s overrides it)")
    group.addoption("--gpu-retries", default=str(DEFAULT_RETRIES), metavar="N",
                    help=f"extra attempts for a test failing with CUDA out of memory or "
                         f"'address already in use' (default {DEFAULT_RETRIES})")
    group.addoption("--gpu-durations", default=DEFAULT_PATH, metavar="PATH",
                    help=f"cache of measured test durations, relative to the rootdir "
                         f"(default {DEFAULT_PATH})")


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """The plugin's options, checked."""

    inventory: Inventory
    timeout_s: float
    retries: int
    durations: Path


def read_options(config: pytest.Config) -> Options:
    """The options of this run; a bad value is a `pytest.UsageError` saying what is allowed."""
    try:
        inventory = parse_gpus(str(config.getoption("gpus")))
    except InventoryError as err:
        raise pytest.UsageError(str(err)) from None
    timeout, retries = config.getoption("gpu_timeout"), config.getoption("gpu_retries")
    try:
        timeout_s = float(timeout)
        assert math.isfinite(timeout_s) and timeout_s > 0
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--gpu-timeout {timeout!r}: give a number of seconds > 0 "
                                f"(default {DEFAULT_TIMEOUT_S:g})") from None
    if not str(retries).isdigit():
        raise pytest.UsageError(f"--gpu-retries {retries!r}: give a whole number >= 0 "
                                f"(default {DEFAULT_RETRIES})")
    given = config.getoption("gpu_durations")
    path = Path(given) if Path(given).is_absolute() else config.rootpath / given
    # The cache is one file, written beside itself: the plugin creates that file and nothing
    # else, so a folder that does not exist (a typo, or a path from another machine) is
    # refused here, before any test runs, rather than made.
    if path.is_dir() or not path.parent.is_dir():
        what = (f"{path} is a folder" if path.is_dir() else
                f"its folder {path.parent} does not exist, and the plugin makes none")
        raise pytest.UsageError(f"--gpu-durations {given!r}: {what}; give a file in an "
                                f"existing folder (default {DEFAULT_PATH} in the rootdir)")
    return Options(inventory=inventory, timeout_s=timeout_s, retries=int(retries),
                   durations=path)


def pytest_configure(config: pytest.Config) -> None:
    # A project that uses the plugin without declaring the markers gets them described here
    # (with --strict-markers, undeclared markers are errors); declared ones are left alone.
    declared = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for name, text in MARKERS.items():
        if name not in declared:
            config.addinivalue_line("markers", text)
    # A scheduled test's own process must never schedule again (PYTEST_ADDOPTS=--gpus ...).
    if config.getoption("gpus") is None or os.environ.get(REPORT_ENV):
        return
    config.pluginmanager.register(GpuRun(config, read_options(config)), "avrid-gpusched-run")


class GpuRun:
    """One scheduled session: takes over the run loop, then prints the summary."""

    def __init__(self, config: pytest.Config, options: Options) -> None:
        self.config, self.options = config, options
        self.stats: RunStats | None = None
        self.sources: dict[str, int] = {}
        self.warning = ""
        self.notes: list[str] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        if session.testsfailed and not session.config.option.continue_on_collection_errors:
            raise session.Interrupted(f"{session.testsfailed} errors during collection")
        scheduled, local, errors = [], [], []
        for item in session.items:
            try:
                needs = needs_of(item)
            except MarkerError as err:
                errors.append(str(err))
                continue
            (local if needs is None else scheduled).append((item, needs))
        if errors:
            raise pytest.UsageError("\n".join(errors))
        if session.config.option.collectonly:  # the plan alone: what would start when, where
            if scheduled:
                self._show_plan(scheduled)
            return True
        if scheduled:
            self._run_scheduled(session, scheduled)
        for i, (item, _) in enumerate(local):
            nextitem = local[i + 1][0] if i + 1 < len(local) else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            self._raise_if_stopping(session)
        return True

    def _jobs(self, scheduled: list[tuple[pytest.Item, GpuNeeds]]
              ) -> tuple[Durations, dict[str, tuple[pytest.Item, GpuNeeds]], list[Job]]:
        """The durations cache, the tests by job name, and their jobs."""
        durations, self.warning = load_durations(self.options.durations)
        items: dict[str, tuple[pytest.Item, GpuNeeds]] = {}
        jobs = []
        for item, needs in scheduled:
            seconds, source = durations.estimate(item.nodeid, needs.duration_s)
            self.sources[source] = self.sources.get(source, 0) + 1
            # (node ids repeat only under --keep-duplicates; job names may not)
            name = item.nodeid if item.nodeid not in items else f"{item.nodeid}#{len(items)}"
            items[name] = (item, needs)
            jobs.append(Job(name=name, gpus=needs.gpus, duration_s=seconds,
                            memory_gb=needs.memory_gb))
        return durations, items, jobs

    def _show_plan(self, scheduled: list[tuple[pytest.Item, GpuNeeds]]) -> None:
        """Print the planned schedule (``--collect-only``): nothing runs."""
        _, _, jobs = self._jobs(scheduled)
        gpus = self.options.inventory.gpus
        plan, fcfs = simulate(jobs, gpus), simulate(jobs, gpus, Fcfs())
        self._write(f"gpusched plan on {_describe(self.options.inventory)}: planned makespan "
                    f"{plan.makespan:.2f} s (FCFS {fcfs.makespan:.2f} s, lower bound "
                    f"{plan.lower_bound:.2f} s)")
        for p in sorted(plan.entries, key=lambda p: (p.start, p.gpus)):
            self._write(f"  {p.start:9.1f} s -> {p.end:9.1f} s  GPUs {','.join(p.gpus):<12} "
                        f"{p.job.name}")
        for name, reason in plan.skipped.items():
            self._write(f"  skipped: {name}: {reason}")

    def _run_scheduled(self, session: pytest.Session,
                       scheduled: list[tuple[pytest.Item, GpuNeeds]]) -> None:
        durations, items, jobs = self._jobs(scheduled)
        inventory, policy = self.options.inventory, LongestFirstBackfill()
        plan = simulate(jobs, inventory.gpus, policy)
        fcfs = simulate(jobs, inventory.gpus, Fcfs())
        self._write(f"gpusched: {len(jobs) - len(plan.skipped)} tests on "
                    f"{len(inventory.gpus)} GPUs ({_describe(inventory)}); planned makespan "
                    f"{plan.makespan:.2f} s")
        scheduler = Scheduler(jobs, inventory.gpus, policy)
        for name, reason in scheduler.skipped.items():
            self._replay(items[name][0], skip_reports(items[name][0], reason))
        workdir, own_folder = _workdir(self.config)
        specs: dict[tuple[str, int], ChildSpec] = {}
        failed: list[str] = []

        def timeout_of(name: str) -> float:
            return items[name][1].timeout_s or self.options.timeout_s

        def launch(start: Start, number: int) -> Child:
            spec = specs[start.job.name, number] = ChildSpec(
                nodeid=items[start.job.name][0].nodeid,
                devices=inventory.devices(start.gpus),
                omp_threads=omp_threads(start.job.gpus, len(inventory.gpus)),
                timeout_s=timeout_of(start.job.name), rootdir=self.config.rootpath,
                inifile=self.config.inipath, workdir=workdir / f"{len(specs):04d}")
            return Child(spec)

        def done(attempt: Attempt) -> None:
            item = items[attempt.job.name][0]
            spec = specs[attempt.job.name, attempt.number]
            reports = complete_reports(
                item, attempt.exit, read_reports(spec.report_path, self.config),
                timeout_s=spec.timeout_s, grace_s=KILL_GRACE_S, note=_note(attempt, spec))
            if any(r.failed for r in reports):
                failed.append(item.nodeid)
            self._replay(item, reports)

        attempts: list[Attempt] = []
        try:
            attempts = execute(
                scheduler, launch, retries=self.options.retries, on_done=done,
                should_stop=lambda: bool(session.shouldfail or session.shouldstop))
        finally:
            self._save(durations, attempts, specs)
            if own_folder and not failed:
                shutil.rmtree(workdir, ignore_errors=True)
            elif failed:  # their tmp_path folders and whole output, for a look after the run
                self.notes.append(f"the tests' output and tmp_path folders: {workdir}")
        replay = simulate(jobs, inventory.gpus, policy, actual=measured_times(attempts))
        self.stats = run_stats(attempts, plan, fcfs, replay)
        self._raise_if_stopping(session)

    def _save(self, durations: Durations, attempts: list[Attempt],
              specs: dict[tuple[str, int], ChildSpec]) -> None:
        """Each test's latest measured duration, and the median start-up overhead, into the
        cache. A test that skipped itself keeps its short time too: the last run is the best
        guess of the next, and a wrong guess costs a less tight plan, never a wrong result."""
        measured, overheads = {}, []
        for attempt in attempts:
            spec = specs[attempt.job.name, attempt.number]
            own = [r for r in read_reports(spec.report_path, self.config)
                   if isinstance(r, pytest.TestReport)]
            measured[spec.nodeid] = attempt.exit.wall_s
            if len(own) == 3 and not attempt.exit.timed_out:
                overheads.append(max(0.0, attempt.exit.wall_s - sum(r.duration for r in own)))
        if not measured:
            return
        overhead = statistics.median(overheads) if overheads else None
        try:
            save_durations(self.options.durations, durations.updated(measured, overhead))
        except OSError as err:
            self.warning += f"\ncould not write the durations cache: {err}"

    def _replay(self, item: pytest.Item, reports: list[Any]) -> None:
        """Hand a test's reports to pytest as if it had run here."""
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in reports:
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def _raise_if_stopping(self, session: pytest.Session) -> None:
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)

    def _write(self, line: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.stats is None and not self.warning and not self.notes:
            return
        terminalreporter.write_sep("=", "gpu schedule (avrid.gpusched)")
        if self.stats is not None:
            for line in summary_lines(self.stats, inventory=_describe(self.options.inventory),
                                      policy=LongestFirstBackfill.name, sources=self.sources,
                                      cache=str(self.options.durations)):
                terminalreporter.write_line(line)
        for line in self.notes:
            terminalreporter.write_line(line)
        for line in self.warning.strip().splitlines():
            terminalreporter.write_line(f"warning: {line}", yellow=True)


def _workdir(config: pytest.Config) -> tuple[Path, bool]:
    """A folder for the tests' processes (output, reports, each one's basetemp), and whether
    it is this plugin's to remove. Under pytest's own numbered basetemp where there is one, so
    pytest keeps the last few runs and removes older ones, as for any tmp_path (the attribute
    is pytest's private one: without it, a temp folder removed unless a test failed)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        return factory.mktemp("gpusched", numbered=True), False
    return Path(tempfile.mkdtemp(prefix="pytest-gpusched-")), True


def _describe(inventory: Inventory) -> str:
    ids = [g.id for g in inventory.gpus]
    # A long inventory is named by its ends: a thousand ids would fill the terminal.
    named = ",".join(ids) if len(ids) <= 16 else f"{ids[0]},...,{ids[-1]} ({len(ids)} GPUs)"
    return f"{named}, simulated" if inventory.fake else named


def _note(attempt: Attempt, spec: ChildSpec) -> str:
    """Where and how a test ran, for its report's section."""
    lines = [f"ran on GPUs {','.join(attempt.gpus)} (CUDA_VISIBLE_DEVICES={spec.devices}, "
             f"OMP_NUM_THREADS={spec.omp_threads}) in {attempt.exit.wall_s:.2f} s, "
             f"process exit status {attempt.exit.returncode}"]
    if attempt.earlier:
        lines.append(f"attempt {attempt.number}: retried after {'; '.join(attempt.earlier)}")
    if attempt.exit.timed_out:
        lines.append(f"its process was still running after {spec.timeout_s:g} s and was "
                     f"killed with its whole process group {attempt.exit.pgid}")
    return "\n".join(lines)
