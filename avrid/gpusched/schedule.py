"""Test tooling — the scheduling policy: which waiting tests start now, and on which GPUs.

A test needs n whole GPUs at once (all-or-nothing: it never holds some while it waits for the
rest, which is how two multi-GPU tests deadlock) and may need a minimum of free memory on each.
A GPU runs one test at a time. Given what runs now and when each is expected to end, a policy
decides which waiting tests start now. Two policies:

- `LongestFirstBackfill` (the default): the queue is ordered longest expected duration first
  (wider first among equals), since a long test started late ends late whatever else happens.
  Tests start in that order while they fit. The first that does not fit gets a *reservation*:
  the GPUs that free up earliest by the running tests' expected ends, and the time at which
  the last of them frees. A later test may then start ahead of it (*backfill*, as in EASY
  backfilling) only if that cannot delay the reservation: it uses none of the reserved GPUs,
  or it is expected to end before the reservation's time. So a wide test is never starved by
  a stream of narrow ones, while narrow ones still fill the gaps before it.
- `Fcfs`: the queue in the given order, starting tests while they fit and stopping at the
  first that does not, with nothing overtaking it: the baseline the default is measured on.

`Scheduler` holds the state (waiting, running, free GPUs), asks its policy at each event and
refuses a start no policy may make (busy, repeated or too small GPUs, a test not waiting);
the same object drives the planned schedule (`plan.simulate`, over expected durations) and
the live run (the plugin, as real tests end). Not here: processes, time itself or pytest.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from avrid.gpusched.inventory import Gpu

EPS = 1e-9
"""Slack on time comparisons: a test ending exactly at a reservation does not delay it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One test as the scheduler sees it.

    >>> Job(name="t", gpus=2, duration_s=30.0)
    Job(name='t', gpus=2, duration_s=30.0, memory_gb=None)
    """

    name: str
    """Unique name (the test's node id)."""
    gpus: int
    """Whole GPUs needed at once."""
    duration_s: float
    """Expected run time (the policy's estimate; the live run may differ)."""
    memory_gb: float | None = None
    """Free GiB needed on each GPU; None: any GPU."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or not self.duration_s >= 0:
            raise ValueError(f"job {self.name!r} needs gpus >= 1 and duration_s >= 0, got "
                             f"{self.gpus} and {self.duration_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Start:
    """A decision: `job` starts now on `gpus`."""

    job: Job
    gpus: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Running:
    """A started test: where it runs, since when, and when it is expected to end."""

    job: Job
    gpus: tuple[str, ...]
    start: float
    expected_end: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """The GPUs held for the first waiting test that did not fit, and from when."""

    job: Job
    gpus: frozenset[str]
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class View:
    """What a policy sees when it decides: everything is a value, nothing is mutated."""

    now: float
    waiting: tuple[Job, ...]
    """Tests not started yet, in the policy's own order."""
    free: frozenset[str]
    running: tuple[Running, ...]
    gpus: tuple[Gpu, ...]
    """The whole inventory, in its order (ties between GPUs break by it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What to start now, and the reservation made (None: every test considered fit)."""

    starts: tuple[Start, ...]
    reservation: Reservation | None = None


class Policy(Protocol):
    """Orders the queue once and decides at every event; stateless and pure."""

    name: str

    def order(self, jobs: Sequence[Job]) -> list[Job]:
        """The queue's priority order."""
        ...

    def decide(self, view: View) -> Decision:
        """Which waiting tests start now, on which free GPUs."""
        ...


def fits(gpu: Gpu, job: Job) -> bool:
    """Whether `gpu` has the memory `job` needs (unknown memory on either side: it fits)."""
    return job.memory_gb is None or gpu.memory_gb is None or gpu.memory_gb >= job.memory_gb


def why_infeasible(job: Job, gpus: Sequence[Gpu]) -> str:
    """Why `job` can never start on `gpus` (whatever else runs), or "" if it can.

    >>> why_infeasible(Job(name="t", gpus=8, duration_s=1), [Gpu(id="0", device="0")])
    'needs 8 GPUs, the inventory has 1'
    """
    if job.gpus > len(gpus):
        return f"needs {job.gpus} GPUs, the inventory has {len(gpus)}"
    if job.memory_gb is None:  # any GPU fits: no need to look at each (there may be 1,024)
        return ""
    able = [g for g in gpus if fits(g, job)]
    if len(able) < job.gpus:
        best = max((g.memory_gb for g in gpus if g.memory_gb is not None), default=0.0)
        return (f"needs {job.gpus} GPU(s) with {job.memory_gb:g} GiB free, the inventory has "
                f"{len(able)} (the most free on one GPU is {best:.1f} GiB)")
    return ""


def _pick(free: Collection[str], job: Job, gpus: Mapping[str, Gpu], rank: Mapping[str, int],
          avoid: frozenset[str] = frozenset()) -> tuple[str, ...] | None:
    """`job.gpus` free GPUs with the memory it needs, or None. Preference: outside `avoid`
    (the reservation), then the least memory that fits (best fit: keeps the big GPUs for the
    tests that need them), then inventory order."""
    if len(free) < job.gpus:  # the usual answer for a waiting test, known without a look
        return None
    able = [g for g in free if fits(gpus[g], job)]
    if len(able) < job.gpus:
        return None
    # The few best of many free GPUs, without sorting them all (the key is a total order:
    # the rank breaks every tie, so this picks exactly what a full sort would).
    best = heapq.nsmallest(job.gpus, able,
                           key=lambda g: (g in avoid, gpus[g].memory_gb or 0.0, rank[g]))
    return tuple(sorted(best, key=rank.__getitem__))


class Fcfs:
    """First come, first served: the given order, and nothing overtakes a test that waits."""

    name = "fcfs"

    def order(self, jobs: Sequence[Job]) -> list[Job]:
        return list(jobs)

    def decide(self, view: View) -> Decision:
        gpus = {g.id: g for g in view.gpus}
        rank = {g.id: i for i, g in enumerate(view.gpus)}
        free, starts = set(view.free), []
        for job in view.waiting:
            ids = _pick(free, job, gpus, rank)
            if ids is None:
                break
            starts.append(Start(job=job, gpus=ids))
            free.difference_update(ids)
        return Decision(starts=tuple(starts))


class LongestFirstBackfill:
    """Longest expected duration first, with one reservation and EASY backfilling."""

    name = "longest-first+backfill"

    def order(self, jobs: Sequence[Job]) -> list[Job]:
        # sorted() is stable: among equal keys the collection order stays.
        return sorted(jobs, key=lambda j: (-j.duration_s, -j.gpus))

    def decide(self, view: View) -> Decision:
        gpus = {g.id: g for g in view.gpus}
        rank = {g.id: i for i, g in enumerate(view.gpus)}
        free, running = set(view.free), list(view.running)
        starts: list[Start] = []
        reservation: Reservation | None = None
        for job in view.waiting:
            if reservation is not None and not free:
                break  # no GPU left, the reservation made: the rest of the queue cannot start
            if reservation is None:
                ids = _pick(free, job, gpus, rank)
                if ids is None:
                    reservation = reserve(job, view.now, free, running, view.gpus)
                    continue
            else:
                ids = _pick(free, job, gpus, rank, avoid=reservation.gpus)
                if ids is None:
                    continue
                ends_in_time = view.now + job.duration_s <= reservation.at + EPS
                if reservation.gpus.intersection(ids) and not ends_in_time:
                    continue  # it would still hold a reserved GPU when the reservation starts
            starts.append(Start(job=job, gpus=ids))
            free.difference_update(ids)
            running.append(Running(job=job, gpus=ids, start=view.now,
                                   expected_end=view.now + job.duration_s))
        return Decision(starts=tuple(starts), reservation=reservation)


def reserve(job: Job, now: float, free: Iterable[str], running: Iterable[Running],
            gpus: Sequence[Gpu]) -> Reservation:
    """The reservation for `job`: of the GPUs with the memory it needs, the `job.gpus` that
    free up first by the running tests' expected ends, and when the last of them does.

    A test running past its expected end is taken to end now, at any moment: its GPU is the
    likeliest to free next, and nothing may be backfilled onto it that runs longer than 0 s.
    """
    free_at = {g: now for g in free}
    for r in running:
        free_at.update((g, max(r.expected_end, now)) for g in r.gpus)
    rank = {g.id: i for i, g in enumerate(gpus)}
    able = heapq.nsmallest(job.gpus, (g.id for g in gpus if fits(g, job) and g.id in free_at),
                           key=lambda g: (free_at[g], rank[g]))
    if len(able) < job.gpus:  # the Scheduler drops such jobs first; a policy must not loop
        raise ValueError(f"job {job.name!r} can never fit: {why_infeasible(job, gpus)}")
    return Reservation(job=job, gpus=frozenset(able), at=max(free_at[g] for g in able))


class Scheduler:
    """The queue, the running tests and the free GPUs, advanced by events.

    Call `starts(now)` at every event (the beginning, and after every `finish`); it records
    what it starts. Tests that can never fit are left out at once, in `skipped`, with the
    reason, so they never hold up the queue.

    >>> from avrid.gpusched.inventory import parse_gpus
    >>> s = Scheduler([Job(name="wide", gpus=2, duration_s=5), Job(name="x", gpus=1,
    ...                duration_s=9)], parse_gpus("fake:2").gpus)
    >>> [(st.job.name, st.gpus) for st in s.starts(0.0)]
    [('x', ('fake0',))]
    >>> s.first_reservation
    {'wide': 9.0}
    """

    def __init__(self, jobs: Sequence[Job], gpus: Sequence[Gpu],
                 policy: Policy | None = None) -> None:
        names = [j.name for j in jobs]
        if len(set(names)) != len(names):
            raise ValueError("job names must be unique")
        self.policy: Policy = policy or LongestFirstBackfill()
        self.gpus = tuple(gpus)
        self._by_id = {g.id: g for g in self.gpus}
        self.skipped: dict[str, str] = {}
        """Name -> why it can never start here."""
        feasible = []
        for job in jobs:
            reason = why_infeasible(job, self.gpus)
            if reason:
                self.skipped[job.name] = reason
            else:
                feasible.append(job)
        self.waiting: list[Job] = self.policy.order(feasible)
        self._rank = {j.name: i for i, j in enumerate(self.waiting)}
        self.running: dict[str, Running] = {}
        self.free: set[str] = {g.id for g in self.gpus}
        self.first_reservation: dict[str, float] = {}
        """Name -> the time of the first reservation it got (the planned start it may never
        be later than, when durations are as expected)."""

    @property
    def done(self) -> bool:
        """Nothing waits and nothing runs."""
        return not self.waiting and not self.running

    def starts(self, now: float) -> list[Start]:
        """Ask the policy what starts now; record those starts and return them."""
        if not self.waiting or not self.free:
            return []
        decision = self.policy.decide(View(
            now=now, waiting=tuple(self.waiting), free=frozenset(self.free),
            running=tuple(self.running.values()), gpus=self.gpus))
        if decision.reservation is not None:
            self.first_reservation.setdefault(decision.reservation.job.name,
                                              decision.reservation.at)
        for start in decision.starts:
            self._check(start)
            self.waiting.remove(start.job)
            self.free.difference_update(start.gpus)
            self.running[start.job.name] = Running(job=start.job, gpus=start.gpus, start=now,
                                                   expected_end=now + start.job.duration_s)
        return list(decision.starts)

    def _check(self, start: Start) -> None:
        """Refuse a start no policy may make (a bug in the policy): a test that is not
        waiting, or GPUs that are busy, unknown, repeated, too few or too many, or short of
        the memory the test needs."""
        job, ids = start.job, start.gpus
        if job not in self.waiting:
            problem = "it is not waiting"
        elif len(ids) != job.gpus or len(set(ids)) != len(ids):
            problem = f"it needs {job.gpus} distinct GPU(s)"
        elif not self.free.issuperset(ids):
            problem = f"free are {sorted(self.free)}"
        elif not all(fits(self._by_id[g], job) for g in ids):
            problem = f"it needs {job.memory_gb:g} GiB on each"
        else:
            return
        raise RuntimeError(f"policy {self.policy.name} gave {job.name} GPUs {ids}: {problem}")

    def finish(self, name: str, now: float) -> Running:
        """`name` ended (at `now`): its GPUs are free again."""
        done = self.running.pop(name)
        self.free.update(done.gpus)
        return done

    def retry(self, job: Job) -> None:
        """Put a finished test back in the queue, at its place in the policy's order."""
        if job.name in self.running or job in self.waiting:
            raise ValueError(f"{job.name} is still running or waiting")
        self.waiting.append(job)
        self.waiting.sort(key=lambda j: self._rank[j.name])
