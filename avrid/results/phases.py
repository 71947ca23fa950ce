"""Chapter 3 — the phases of one driver step, timed, with every worker result they made.

A driver step is a sequence of named phases (generate, reward, ...), each one or more
`run_shards` calls. `Phases` times each phase as a driver span, keeps the calls' merged
results, and turns them into the step's timing metrics (`times`: the phases, the step, the
workers' compute on the critical path and the rest: overhead) and its `Timeline`.

    phases = Phases()
    with phases("generate"):
        gen = phases.add(run_shards(policy, PolicyWorker.generate, prompts))
    phases.times()["time/generate"], phases.timeline().to_chrome_trace("step.json")

Phases that run at once (chapter 5's concurrent controller) are each timed on a `Phases` of
their own and `extend`ed back in a fixed order, their driver spans on lanes of their own.

Not here: what a phase does (the trainer decides), and drawing (`timeline.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager

from avrid.results.merge import Merged
from avrid.results.result import Span, WorkerResult, compute_seconds, timed
from avrid.results.timeline import DRIVER, Lane, Timeline


class Phases:
    """Times the named phases of one step and keeps every worker result for the timeline."""

    def __init__(self) -> None:
        self.start = time.time()
        self.spans: list[Span] = []
        self.merged: list[Merged] = []
        self.calls: list[tuple[WorkerResult, ...]] = []
        """Every call's worker results: those of `merged`, then those `record`ed."""
        self.driver_lanes: dict[str, list[Span]] = {}
        """Driver spans drawn on lanes of their own (`extend`), by lane label."""
        self._elsewhere: set[int] = set()  # ids of the spans and calls drawn on those lanes

    def __call__(self, name: str) -> AbstractContextManager[None]:
        """Time the phase `name` (a driver span on the timeline)."""
        self.boundary()
        return timed(self.spans, name)

    def boundary(self) -> None:
        """Called as each phase begins: nothing here; chapter 6's phases tend the pipeline
        (collect a finished generation, start the next) at every boundary."""

    def extend(self, other: Phases, *, lane: str | None = None) -> None:
        """Append `other`'s spans and calls: a phase timed on a `Phases` of its own (the
        concurrent controller runs each in a thread of its own, then puts them back in the
        serial order, so the step's spans and calls read as the serial run's). `lane`: draw
        its driver spans on a driver lane of that name, not the driver's own: phases that
        overlap in time go on lanes of their own, so that no lane holds two at once."""
        self.spans.extend(other.spans)
        self.merged.extend(other.merged)
        self.calls.extend(other.calls)
        if lane is not None:
            self.driver_lanes.setdefault(lane, []).extend(other.driver_spans())
            self._elsewhere.update(id(x) for x in [*other.spans, *other.merged])

    def driver_spans(self) -> list[Span]:
        """The spans of the driver's own lane: its phases and each call's plan / split /
        submit / wait / receive / merge (those `extend`ed onto lanes of their own left out)."""
        return [s for s in self.spans if id(s) not in self._elsewhere] + [
            s for m in self.merged if id(m) not in self._elsewhere for s in m.driver_spans]

    def add(self, merged: Merged) -> Merged:
        """Keep a call's results for the timing and the timeline; returns it unchanged."""
        self.merged.append(merged)
        self.calls.append(merged.results)
        return merged

    def record(self, results: Sequence[WorkerResult]) -> Sequence[WorkerResult]:
        """Keep the results of a call that sends no batch (the weight sync: each rank's
        spans and metrics, `ResultBuilder.for_call`); returns them unchanged."""
        self.calls.append(tuple(results))
        return results

    def times(self) -> dict[str, float]:
        """time/<phase> seconds, time/step, and the share of the step that workers did not
        spend computing (driver, dispatch, merge, transport, waiting): time/overhead."""
        out = {f"time/{s.name}": s.end - s.start for s in self.spans}
        out["time/step"] = time.time() - self.start
        busy = 0.0
        for call in self.calls:  # per call: the busiest rank's compute is the critical path
            per_rank: dict[str, float] = {}
            for r in call:  # compute spans only: a rank's unpack / pack are orchestration
                per_rank[r.identity.name] = compute_seconds(r.spans)
            busy += max(per_rank.values(), default=0.0)
        out["time/compute"] = busy
        out["time/overhead"] = max(0.0, 1.0 - busy / out["time/step"])
        return out

    def timeline(self) -> Timeline:
        """The step's spans — every worker's (compute, unpack, pack) and the driver's (phases,
        and each call's plan / split / submit / wait / receive / merge)."""
        results = [r for call in self.calls for r in call]
        return self.with_driver_lanes(Timeline.from_results(results,
                                                            driver_spans=self.driver_spans()))

    def with_driver_lanes(self, timeline: Timeline) -> Timeline:
        """`timeline` and the `driver_lanes`, each a lane of the driver's group."""
        return Timeline(lanes=timeline.lanes + tuple(
            Lane(label=label, group=DRIVER, spans=tuple(spans))
            for label, spans in self.driver_lanes.items() if spans))
