"""Test tooling — the planned schedule: a policy played out over expected durations.

`simulate` runs a `Scheduler` in an event loop on a simulated clock: start what the policy
starts, jump to the next expected end, free those GPUs, ask again. The result, a `Plan`, says
when and where each test would run and how long the whole run would take (its makespan),
next to the lower bound no schedule can beat, max(total GPU-seconds / GPUs, longest test).

The plugin prints the planned makespan before a run and compares the real wall time with it
after; the tests and `benchmarks/bench_gpusched.py` compare policies with it. Passing
`actual` durations plays the live case instead: the policy still decides on the estimates,
but tests end when `actual` says (what happens when the estimates are wrong).

Not here: the policy (`schedule.py`) or running anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from avrid.gpusched.inventory import Gpu
from avrid.gpusched.schedule import EPS, Job, LongestFirstBackfill, Policy, Scheduler


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """One test in a plan: on which GPUs it runs, from when until when."""

    job: Job
    gpus: tuple[str, ...]
    start: float
    end: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A whole schedule, its makespan and its lower bound.

    >>> from avrid.gpusched.inventory import parse_gpus
    >>> jobs = [Job(name=f"t{i}", gpus=g, duration_s=d)
    ...         for i, (g, d) in enumerate([(2, 4), (1, 3), (1, 1), (1, 1)])]
    >>> plan = simulate(jobs, parse_gpus("fake:2").gpus)
    >>> for p in plan.entries:
    ...     print(p.job.name, p.gpus, p.start, p.end)
    t0 ('fake0', 'fake1') 0.0 4.0
    t1 ('fake0',) 4.0 7.0
    t2 ('fake1',) 4.0 5.0
    t3 ('fake1',) 5.0 6.0
    >>> plan.makespan, plan.lower_bound  # the bound is 6.5; no schedule does better than 7
    (7.0, 6.5)
    """

    policy: str
    entries: tuple[Planned, ...]
    """In start order."""
    skipped: Mapping[str, str]
    """Tests that can never run on this inventory, with the reason."""
    first_reservation: Mapping[str, float]
    """Test -> the time of the first reservation it got (see `Scheduler`)."""
    makespan: float
    lower_bound: float
    gpus: int
    """How many GPUs the plan ran on."""

    def gpu_seconds(self) -> float:
        """Busy GPU-seconds: each test's duration times its GPU count."""
        return sum((p.end - p.start) * len(p.gpus) for p in self.entries)

    def utilisation(self) -> float:
        """Busy GPU-seconds over GPUs x makespan (1.0: no GPU ever idle)."""
        return self.gpu_seconds() / (self.gpus * self.makespan) if self.makespan > 0 else 1.0


def lower_bound(jobs: Sequence[Job], gpus: int) -> float:
    """max(total GPU-seconds / GPUs, longest test): no schedule of `jobs` ends sooner.

    >>> lower_bound([Job(name="a", gpus=4, duration_s=2), Job(name="b", gpus=1, duration_s=5)],
    ...             4)
    5.0
    """
    if not jobs:
        return 0.0
    return float(max(sum(j.gpus * j.duration_s for j in jobs) / gpus,
                     max(j.duration_s for j in jobs)))


def simulate(jobs: Sequence[Job], gpus: Sequence[Gpu], policy: Policy | None = None, *,
             actual: Mapping[str, float] | None = None) -> Plan:
    """Play `policy` (longest-first with backfill by default) over `jobs` on `gpus`.

    Each test lasts its `duration_s`, or `actual[name]` where given (the policy still plans
    with `duration_s`). Tests that can never fit are in the plan's `skipped`.
    """
    scheduler = Scheduler(jobs, gpus, policy or LongestFirstBackfill())
    length = {j.name: (actual or {}).get(j.name, j.duration_s) for j in jobs}
    now, entries, ends = 0.0, [], {}
    while not scheduler.done:
        for start in scheduler.starts(now):
            name = start.job.name
            ends[name] = now + length[name]
            entries.append(Planned(job=start.job, gpus=start.gpus, start=now, end=ends[name]))
        if not scheduler.running:  # nothing runs and nothing started: a policy bug
            raise RuntimeError(f"policy {scheduler.policy.name} left "
                               f"{[j.name for j in scheduler.waiting]} waiting on idle GPUs")
        now = min(ends[name] for name in scheduler.running)
        for name in [n for n in scheduler.running if ends[n] <= now + EPS]:
            scheduler.finish(name, now)
    feasible = [j for j in jobs if j.name not in scheduler.skipped]
    return Plan(policy=scheduler.policy.name, entries=tuple(entries),
                skipped=dict(scheduler.skipped),
                first_reservation=dict(scheduler.first_reservation),
                makespan=max((p.end for p in entries), default=0.0),
                lower_bound=lower_bound(
                    [Job(name=j.name, gpus=j.gpus, duration_s=length[j.name]) for j in feasible],
                    len(gpus)),
                gpus=len(gpus))
