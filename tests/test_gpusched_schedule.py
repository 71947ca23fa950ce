"""The GPU test scheduler's policy, pure: no process, no clock, no pytest run.

What a schedule must never do (property-tested over random workloads, both policies): give a
GPU to two tests at once, give a test fewer or other GPUs than it needs, lose a test, or let a
test that can never fit hold up the queue. What longest-first with backfilling promises on top:

- the reservation holds: a test starts no later than the time of the first reservation it got
  (backfilled tests never delay it), when durations are as expected or shorter;
- no starvation, with a bound: in the policy's priority order, test k starts at most D after
  every test before it has started, where D is the longest expected duration. At the moment
  the last of them starts, test k either fits at once or gets the reservation, which is at
  most D away (every running test started by then and lasts at most D) and holds. By
  induction, test k (counted from 1) starts by (k - 1) x D.
- on random workloads its makespan is on average no worse than FCFS's, and never below the
  lower bound max(total GPU-time / GPUs, longest test).

The judge of the properties (`check_safe`) is shown to fail on each kind of unsafe plan, and
the `Scheduler` to refuse each start a broken policy could make.
"""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from avrid.gpusched import (
    Fcfs,
    Gpu,
    Job,
    LongestFirstBackfill,
    Plan,
    Planned,
    Scheduler,
    lower_bound,
    simulate,
    why_infeasible,
)
from avrid.gpusched.schedule import EPS, Decision, Running, Start, View

pytestmark = pytest.mark.project

POLICIES = [LongestFirstBackfill(), Fcfs()]


def gpus_of(n: int, memory: list[float | None] | None = None) -> tuple[Gpu, ...]:
    return tuple(Gpu(id=f"g{i}", device=str(i), memory_gb=(memory or [None] * n)[i])
                 for i in range(n))


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[Job], tuple[Gpu, ...]]:
    """Up to 8 GPUs (some with known memory), up to 25 tests of 1, 2, 4 or 8 GPUs (some
    impossible here), long-tailed durations, some memory needs."""
    n = draw(st.integers(1, 8))
    memory = draw(st.lists(st.sampled_from([None, 16.0, 40.0, 80.0]), min_size=n, max_size=n))
    jobs = []
    for i in range(draw(st.integers(1, 25))):
        gpus = draw(st.sampled_from([1, 1, 1, 2, 2, 4, 8]))
        duration = draw(st.sampled_from([0.5, 1.0, 3.0, 10.0]) | st.floats(0.0, 100.0))
        need = draw(st.sampled_from([None, None, None, 20.0, 60.0]))
        jobs.append(Job(name=f"t{i}", gpus=gpus, duration_s=duration, memory_gb=need))
    return jobs, gpus_of(n, memory)


def check_safe(plan: Plan, jobs: list[Job], gpus: tuple[Gpu, ...]) -> None:
    """No GPU in two tests at once; every test placed once on the GPUs it needs, or skipped
    exactly when it can never fit."""
    by_id = {g.id: g for g in gpus}
    placed = [p.job.name for p in plan.entries]
    assert len(placed) == len(set(placed))
    for job in jobs:
        reason = why_infeasible(job, gpus)
        assert (job.name in plan.skipped) == bool(reason), job
        assert (job.name in placed) != bool(reason), job
    for p in plan.entries:
        assert len(p.gpus) == len(set(p.gpus)) == p.job.gpus
        for g in p.gpus:
            gpu = by_id[g]
            assert p.job.memory_gb is None or gpu.memory_gb is None \
                or gpu.memory_gb >= p.job.memory_gb
    for g in by_id:
        spans = sorted((p.start, p.end) for p in plan.entries if g in p.gpus)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end - EPS, f"GPU {g} over-committed: {spans}"


def check_no_starvation(plan: Plan, jobs: list[Job], gpus: tuple[Gpu, ...]) -> None:
    """The reservation holds, and test k in priority order starts within D of the last start
    before it (so by (k - 1) x D), D the longest expected duration."""
    starts = {p.job.name: p.start for p in plan.entries}
    for name, at in plan.first_reservation.items():
        assert starts[name] <= at + EPS, (name, starts[name], at)
    order = LongestFirstBackfill().order([j for j in jobs if j.name not in plan.skipped])
    longest = max((j.duration_s for j in order), default=0.0)
    latest = 0.0
    for k, job in enumerate(order):
        assert starts[job.name] <= latest + longest + EPS, (job, starts[job.name], latest)
        assert starts[job.name] <= k * longest + EPS
        latest = max(latest, starts[job.name])


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@given(workload=workloads())
def test_a_plan_never_over_commits_and_places_every_possible_test(
        policy: LongestFirstBackfill | Fcfs, workload: tuple[list[Job], tuple[Gpu, ...]]) -> None:
    jobs, gpus = workload
    plan = simulate(jobs, gpus, policy)
    check_safe(plan, jobs, gpus)
    start = {p.job.name: p.start for p in plan.entries}
    order = policy.order([j for j in jobs if j.name not in plan.skipped])
    if order:  # nothing runs at 0: the head of the queue fits, and starts
        assert start[order[0].name] == 0.0
    if isinstance(policy, Fcfs):  # nothing overtakes a test that waits
        assert [start[j.name] for j in order] == sorted(start[j.name] for j in order)


def planned(name: str, gpus: tuple[str, ...], start: float, end: float, *, width: int = 0,
            memory_gb: float | None = None) -> Planned:
    return Planned(job=Job(name=name, gpus=width or len(gpus), duration_s=end - start,
                           memory_gb=memory_gb), gpus=gpus, start=start, end=end)


def a_plan(*entries: Planned, skipped: dict[str, str] | None = None) -> Plan:
    return Plan(policy="by hand", entries=entries, skipped=skipped or {}, first_reservation={},
                makespan=max(p.end for p in entries), lower_bound=0.0, gpus=2)


@pytest.mark.parametrize(("plan", "jobs"), [
    # g0 in two tests at once
    (a_plan(planned("a", ("g0",), 0, 2), planned("b", ("g0",), 1, 3)), ["a", "b"]),
    # a 2-GPU test on one GPU, twice
    (a_plan(planned("a", ("g0", "g0"), 0, 1)), ["a"]),
    # a 2-GPU test on one GPU
    (a_plan(planned("a", ("g0",), 0, 1, width=2)), ["a"]),
    # a test lost
    (a_plan(planned("a", ("g0",), 0, 1)), ["a", "b"]),
    # a test placed twice
    (a_plan(planned("a", ("g0",), 0, 1), planned("a", ("g1",), 0, 1)), ["a"]),
    # 40 GiB needed on a 16 GiB GPU
    (a_plan(planned("a", ("g1",), 0, 1, memory_gb=40.0)), ["a"]),
    # a possible test skipped
    (a_plan(planned("a", ("g0",), 0, 1), skipped={"b": "no"}), ["a", "b"]),
], ids=["over-committed", "same GPU twice", "too few GPUs", "lost", "placed twice",
        "too little memory", "skipped though it fits"])
def test_the_safety_check_refuses_an_unsafe_plan(plan: Plan, jobs: list[str]) -> None:
    """`check_safe`, the property tests' judge, fails on each way a plan can be wrong."""
    by_name = {p.job.name: p.job for p in plan.entries}
    workload = [by_name.get(n) or Job(name=n, gpus=1, duration_s=1.0) for n in jobs]
    with pytest.raises(AssertionError):
        check_safe(plan, workload, gpus_of(2, [80.0, 16.0]))


class Told:
    """A policy that starts, at its first decision, exactly what it is told to (a broken
    policy, to see the scheduler refuse it)."""

    name = "told"

    def __init__(self, *starts: tuple[str, tuple[str, ...]]) -> None:
        self.starts = starts

    def order(self, jobs: list[Job]) -> list[Job]:
        return list(jobs)

    def decide(self, view: View) -> Decision:
        jobs = {j.name: j for j in view.waiting}
        return Decision(starts=tuple(
            Start(job=jobs.get(name) or Job(name=name, gpus=len(ids), duration_s=1.0),
                  gpus=ids) for name, ids in self.starts))


@pytest.mark.parametrize(("starts", "problem"), [
    ((("a", ("g0",)), ("b", ("g0",))), r"gave b GPUs \('g0',\): free are \['g1', 'g2'\]"),
    ((("w", ("g0",)),), r"gave w GPUs \('g0',\): it needs 2 distinct"),
    ((("a", ("g0", "g1")),), r"gave a GPUs \('g0', 'g1'\): it needs 1 distinct"),
    ((("w", ("g0", "g0")),), r"gave w GPUs \('g0', 'g0'\): it needs 2 distinct"),
    ((("a", ("g0", "g0")),), r"gave a GPUs \('g0', 'g0'\): it needs 1 distinct"),
    ((("a", ("g9",)),), r"gave a GPUs \('g9',\): free are"),
    ((("big", ("g2",)),), r"gave big GPUs \('g2',\): it needs 40 GiB on each"),
    ((("ghost", ("g0",)),), r"gave ghost GPUs \('g0',\): it is not waiting"),
    ((("a", ("g0",)), ("a", ("g1",))), r"gave a GPUs \('g1',\): it is not waiting"),
], ids=["a busy GPU", "too few", "too many", "one GPU twice for two",
        "one GPU twice for one", "not in the inventory", "too little memory",
        "a test never queued", "a test started twice"])
def test_the_scheduler_refuses_a_start_no_policy_may_make(
        starts: tuple[tuple[str, tuple[str, ...]], ...], problem: str) -> None:
    jobs = [Job(name="a", gpus=1, duration_s=1), Job(name="b", gpus=1, duration_s=1),
            Job(name="w", gpus=2, duration_s=1), Job(name="big", gpus=1, duration_s=1,
                                                      memory_gb=40.0)]
    scheduler = Scheduler(jobs, gpus_of(3, [80.0, 80.0, 16.0]), Told(*starts))
    with pytest.raises(RuntimeError, match=rf"^policy told {problem}"):
        scheduler.starts(0.0)


@given(workload=workloads())
def test_backfilling_never_delays_the_reservation_and_no_test_starves(
        workload: tuple[list[Job], tuple[Gpu, ...]]) -> None:
    jobs, gpus = workload
    check_no_starvation(simulate(jobs, gpus), jobs, gpus)


@given(workload=workloads(), factors=st.lists(st.floats(0.1, 1.0), min_size=25, max_size=25))
def test_the_guarantees_hold_when_tests_end_earlier_than_expected(
        workload: tuple[list[Job], tuple[Gpu, ...]], factors: list[float]) -> None:
    jobs, gpus = workload
    actual = {j.name: j.duration_s * f for j, f in zip(jobs, factors, strict=False)}
    plan = simulate(jobs, gpus, actual=actual)
    check_safe(plan, jobs, gpus)
    check_no_starvation(plan, jobs, gpus)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@given(workload=workloads(), factors=st.lists(st.floats(0.1, 3.0), min_size=25, max_size=25))
def test_when_tests_overrun_their_estimates_the_run_stays_safe_and_finishes(
        policy: LongestFirstBackfill | Fcfs, workload: tuple[list[Job], tuple[Gpu, ...]],
        factors: list[float]) -> None:
    jobs, gpus = workload
    actual = {j.name: j.duration_s * f for j, f in zip(jobs, factors, strict=False)}
    check_safe(simulate(jobs, gpus, policy, actual=actual), jobs, gpus)


def test_a_short_test_backfills_before_a_reservation_and_a_long_one_waits() -> None:
    # g0 busy until 10, g1 until 4; g4 has too little memory for W. W (3 GPUs, 40 GiB) cannot
    # start now: it reserves g2, g3 (free) and g1 (free at 4). x ends by 4: it may take a
    # reserved GPU. y runs 15 s: only g4, outside the reservation, is allowed to it.
    gpus = gpus_of(5, [80.0, 80.0, 80.0, 80.0, 16.0])
    w = Job(name="W", gpus=3, duration_s=50, memory_gb=40)
    x, y = Job(name="x", gpus=1, duration_s=3), Job(name="y", gpus=1, duration_s=15)
    z = Job(name="z", gpus=1, duration_s=12)
    running = (Running(job=Job(name="r0", gpus=1, duration_s=10), gpus=("g0",), start=0,
                       expected_end=10),
               Running(job=Job(name="r1", gpus=1, duration_s=4), gpus=("g1",), start=0,
                       expected_end=4))
    view = View(now=0.0, waiting=(w, y, z, x), free=frozenset({"g2", "g3", "g4"}),
                running=running, gpus=gpus)
    decision = LongestFirstBackfill().decide(view)
    assert decision.reservation is not None
    assert (decision.reservation.job, decision.reservation.gpus, decision.reservation.at) == (
        w, frozenset({"g1", "g2", "g3"}), 4.0)
    assert [(s.job.name, s.gpus) for s in decision.starts] == [("y", ("g4",)), ("x", ("g2",))]
    # FCFS in the same spot starts nothing: W is first and does not fit.
    assert Fcfs().decide(view).starts == ()


class Greedy(LongestFirstBackfill):
    """Longest first, and anything that fits starts: backfilling without a reservation."""

    name = "greedy"

    def decide(self, view: View) -> Decision:
        free, starts = set(view.free), []
        for job in view.waiting:
            able = sorted(g for g in free)[:job.gpus]
            if len(able) == job.gpus:
                starts.append(Start(job=job, gpus=tuple(able)))
                free.difference_update(able)
        return Decision(starts=tuple(starts))


def test_a_wide_test_is_not_starved_by_a_stream_of_narrow_ones() -> None:
    # A 30 s test holds g0; the 4-GPU test comes next in the order, then 40 narrow 7 s tests.
    # The wide test reserves all four GPUs for t=30; narrow tests fill g1-g3 while they end by
    # then (at 0, 7, 14, 21) and the wide one starts at 30. Without the reservation (greedy),
    # a narrow test always holds some GPU and the wide one waits until the stream runs dry.
    jobs = [Job(name="long", gpus=1, duration_s=30), Job(name="wide", gpus=4, duration_s=20)]
    jobs += [Job(name=f"n{i}", gpus=1, duration_s=7) for i in range(40)]
    plan = simulate(jobs, gpus_of(4))
    start = {p.job.name: p.start for p in plan.entries}
    assert start["wide"] == plan.first_reservation["wide"] == 30.0
    # At 28 nothing starts: a narrow test would hold a reserved GPU until 35, past 30.
    assert sorted(start.values())[:14] == [0.0] * 4 + [7.0] * 3 + [14.0] * 3 + [21.0] * 3 + [
        30.0]
    greedy = {p.job.name: p.start for p in simulate(jobs, gpus_of(4), Greedy()).entries}
    assert greedy["wide"] >= max(greedy.values()) - EPS  # it started last: starved


def test_impossible_tests_are_skipped_with_a_reason_and_hold_nothing_up() -> None:
    gpus = gpus_of(4, [80.0] * 4)
    jobs = [Job(name="eight", gpus=8, duration_s=1), Job(name="huge", gpus=1, duration_s=1,
                                                        memory_gb=100),
            Job(name="ok", gpus=4, duration_s=2), Job(name="small", gpus=1, duration_s=1)]
    plan = simulate(jobs, gpus)
    assert plan.skipped == {
        "eight": "needs 8 GPUs, the inventory has 4",
        "huge": "needs 1 GPU(s) with 100 GiB free, the inventory has 0 (the most free on one "
                "GPU is 80.0 GiB)"}
    assert [p.job.name for p in plan.entries] == ["ok", "small"]
    assert plan.makespan == 3.0


def test_a_retried_test_goes_back_to_its_place_in_the_order() -> None:
    jobs = [Job(name=n, gpus=1, duration_s=d) for n, d in (("a", 5), ("b", 9), ("c", 1))]
    s = Scheduler(jobs, gpus_of(1))
    assert [st.job.name for st in s.starts(0.0)] == ["b"]
    s.finish("b", 2.0)  # failed at start-up: try again before the shorter ones
    s.retry(jobs[1])
    assert [j.name for j in s.waiting] == ["b", "a", "c"]
    assert [st.job.name for st in s.starts(2.0)] == ["b"]
    with pytest.raises(ValueError, match="still running"):
        s.retry(jobs[1])


def test_a_test_past_its_estimate_is_expected_to_end_any_moment() -> None:
    # r0 should have ended at 5 and still runs at 8: the reservation is "now", so a 1 s test
    # may not take r0's GPU... there is none free but g1, which the reservation also holds.
    gpus = gpus_of(2)
    running = (Running(job=Job(name="r0", gpus=1, duration_s=5), gpus=("g0",), start=0,
                       expected_end=5),)
    wide, short = Job(name="wide", gpus=2, duration_s=5), Job(name="s", gpus=1, duration_s=1)
    decision = LongestFirstBackfill().decide(View(
        now=8.0, waiting=(wide, short), free=frozenset({"g1"}), running=running, gpus=gpus))
    assert decision.reservation is not None and decision.reservation.at == 8.0
    assert decision.starts == ()


def random_workload(rng: random.Random, n: int = 24) -> list[Job]:
    """Mixed widths on 8 GPUs, long-tailed durations (lognormal), in a random order."""
    return [Job(name=f"t{i}", gpus=rng.choice([1, 1, 1, 1, 2, 2, 4, 8]),
                duration_s=min(600.0, rng.lognormvariate(3.0, 1.0))) for i in range(n)]


def test_longest_first_with_backfill_beats_fcfs_on_average_and_both_respect_the_bound() -> None:
    rng = random.Random(0)
    gpus = gpus_of(8)
    ratios = {p.name: [] for p in POLICIES}
    for _ in range(200):
        jobs = random_workload(rng)
        bound = lower_bound(jobs, 8)
        for policy in POLICIES:
            plan = simulate(jobs, gpus, policy)
            assert plan.makespan >= bound - EPS
            ratios[policy.name].append(plan.makespan / bound)
    lf, fcfs = (statistics.mean(ratios[p.name]) for p in POLICIES)
    assert lf <= fcfs
    assert lf <= 1.15, lf  # measured ~1.05 (benchmarks/bench_gpusched.py: 1,000 workloads)
