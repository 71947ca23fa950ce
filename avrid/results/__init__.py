"""Chapter 3 — canonical results: one result format for every worker whatever its local
strategy, a checked merge back into the original order with exact metric reduction, and the
timeline of who did what when.

Read in this order: result.py (the values), builder.py (worker side), merge.py (driver side),
run.py (the round trip), timeline.py (trace file and Gantt chart), gantt_stack.py (several
Gantt charts on one time scale), phases.py (a driver step's timed phases and its timeline).
"""

from avrid.results.builder import ResultBuilder, is_collect_rank
from avrid.results.gantt_stack import stacked_gantt
from avrid.results.merge import Merged, merge
from avrid.results.phases import Phases
from avrid.results.result import (
    HANDLING_SPANS,
    REDUCTIONS,
    RESULT_VERSION,
    Metric,
    Reduction,
    Span,
    WorkerResult,
    compute_seconds,
    merge_metrics,
)
from avrid.results.run import ShardCall, run_shards, start_shards
from avrid.results.timeline import Lane, Timeline, Utilization, atomic_write, palette

__all__ = [
    "HANDLING_SPANS", "REDUCTIONS", "RESULT_VERSION", "Lane", "Merged", "Metric", "Phases",
    "Reduction",
    "ResultBuilder", "ShardCall", "Span", "Timeline", "Utilization", "WorkerResult",
    "atomic_write", "compute_seconds", "is_collect_rank", "merge", "merge_metrics", "palette",
    "run_shards", "stacked_gantt", "start_shards",
]
