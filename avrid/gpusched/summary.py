"""Test tooling — what a scheduled run achieved, against its plan and against running serially.

`RunStats` is computed from the attempts of a live run and the plan made before it:

- wall time: from the first test's start to the last one's end;
- busy GPU-seconds: each attempt's wall time times its GPU count (retries included: they held
  their GPUs too), and the utilisation, busy / (GPUs x wall);
- the serial sum: every attempt's wall time added up, what one test after another would have
  taken, and the speed-up, serial sum / wall;
- the planned makespan (and FCFS's, and the lower bound) the same tests had before they ran;
- the replayed makespan: the same policy played over what each test really took. The plan
  misses the wall time by the error in its expected durations (a busy machine, a slower test);
  the replay misses it only by the scheduler's own lag, so wall ~ replay is what says the run
  kept to its policy.

`summary_lines` is the text the plugin prints at the end of the run; the tests parse it, so
its labels are stable. Not here: timing anything, or pytest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from avrid.gpusched.execute import Attempt
from avrid.gpusched.plan import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStats:
    """The figures of one scheduled run."""

    gpus: int
    tests: int
    """Tests that ran (each counted once, however many attempts)."""
    retries: int
    skipped: int
    """Tests the inventory could never run."""
    wall_s: float
    busy_gpu_s: float
    serial_s: float
    planned_s: float
    fcfs_planned_s: float
    lower_bound_s: float
    replayed_s: float
    """The policy played over each test's measured time (its attempts added up)."""

    @property
    def utilisation(self) -> float:
        """Busy GPU-seconds over GPUs x wall time."""
        return self.busy_gpu_s / (self.gpus * self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def speedup(self) -> float:
        """The serial sum over the wall time."""
        return self.serial_s / self.wall_s if self.wall_s > 0 else 0.0


def run_stats(attempts: Sequence[Attempt], plan: Plan, fcfs: Plan, replay: Plan) -> RunStats:
    """The figures of a run from its attempts, the plans made before it and the `replay` of
    its policy over the measured times (`measured_times`).

    >>> from avrid.gpusched.runner import Exit
    >>> from avrid.gpusched.schedule import Job
    >>> from avrid.gpusched.plan import simulate
    >>> from avrid.gpusched.inventory import parse_gpus
    >>> from avrid.gpusched.schedule import Fcfs
    >>> jobs = [Job(name="a", gpus=2, duration_s=2.0), Job(name="b", gpus=1, duration_s=1.0)]
    >>> gpus = parse_gpus("fake:2").gpus
    >>> done = Exit(returncode=0, timed_out=False, wall_s=0, output="", pgid=0)
    >>> tries = [Attempt(job=jobs[0], gpus=("fake0", "fake1"), number=1, start=0.0, end=2.0,
    ...                  exit=done),
    ...          Attempt(job=jobs[1], gpus=("fake0",), number=1, start=2.0, end=3.0,
    ...                  exit=done)]
    >>> replay = simulate(jobs, gpus, actual=measured_times(tries))
    >>> s = run_stats(tries, simulate(jobs, gpus), simulate(jobs, gpus, Fcfs()), replay)
    >>> s.wall_s, s.busy_gpu_s, round(s.utilisation, 3), s.speedup
    (3.0, 5.0, 0.833, 1.0)
    >>> s.replayed_s  # a ran first, alone on both GPUs, then b
    3.0
    """
    wall = (max(a.end for a in attempts) - min(a.start for a in attempts)) if attempts else 0.0
    return RunStats(
        gpus=plan.gpus, tests=len({a.job.name for a in attempts}),
        retries=sum(1 for a in attempts if a.retried_because), skipped=len(plan.skipped),
        wall_s=wall, busy_gpu_s=sum((a.end - a.start) * len(a.gpus) for a in attempts),
        serial_s=sum(a.end - a.start for a in attempts), planned_s=plan.makespan,
        fcfs_planned_s=fcfs.makespan, lower_bound_s=plan.lower_bound,
        replayed_s=replay.makespan)


def measured_times(attempts: Sequence[Attempt]) -> dict[str, float]:
    """Test name -> the wall time its attempts took together (a retry held its GPUs too)."""
    times: dict[str, float] = {}
    for a in attempts:
        times[a.job.name] = times.get(a.job.name, 0.0) + (a.end - a.start)
    return times


def summary_lines(stats: RunStats, *, inventory: str, policy: str,
                  sources: Mapping[str, int], cache: str) -> list[str]:
    """The end-of-run summary: one fact per line, labels fixed (tests parse them)."""
    where = ", ".join(f"{n} {s}" for s, n in sources.items() if n) or "none"
    return [
        f"inventory: {inventory}; policy: {policy}",
        f"tests: {stats.tests} run on GPUs, {stats.retries} retried, {stats.skipped} skipped "
        f"as impossible on this inventory",
        f"wall {stats.wall_s:.2f} s | planned makespan {stats.planned_s:.2f} s "
        f"(FCFS would plan {stats.fcfs_planned_s:.2f} s; lower bound {stats.lower_bound_s:.2f} s)",
        f"replayed makespan {stats.replayed_s:.2f} s: the policy over each test's measured time",
        f"GPU-seconds busy {stats.busy_gpu_s:.2f} of {stats.gpus * stats.wall_s:.2f} | "
        f"utilisation {100 * stats.utilisation:.1f}%",
        f"serial sum {stats.serial_s:.2f} s | speed-up {stats.speedup:.2f}x over one test "
        f"after another",
        f"expected durations: {where} (cache {cache})",
    ]
