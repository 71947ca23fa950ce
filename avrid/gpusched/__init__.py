"""Test tooling — a GPU test scheduler, shipped as a pytest plugin (not a library layer).

The GPU tier of a test suite usually runs one test after another, so on an 8-GPU machine a
1-GPU test leaves seven GPUs idle. With ``pytest -m "gpu or vllm" --gpus 0,1,2,3`` (or
``--gpus all``, or ``--gpus fake:8`` to simulate on a CPU host) each marked test runs in its
own process on the GPUs it declares, side by side, in an order that keeps the GPUs busy
without starving wide tests. Nothing here imports torch, CUDA, Ray or another avrid layer: only
the standard library, and pytest in the two files pytest loads.

Read in this order:

1. needs.py      what a test needs, from its ``gpu(count=, memory_gb=, duration_s=,
                 timeout_s=)`` / ``vllm`` markers
2. inventory.py  the GPUs of a run, from ``--gpus`` (ids, ``all`` via nvidia-smi, ``fake:N``)
3. schedule.py   the policy: longest first, all-or-nothing, one reservation and EASY
                 backfilling (and FCFS, the baseline); the `Scheduler` state it drives
4. plan.py       the policy played out over expected durations: the planned makespan
5. durations.py  expected durations: declared, learnt from the last run (a JSON cache),
                 or a default
6. runner.py     one test in its own process and process group: devices, threads, time
                 limit, the whole group killed; which failures are retried
7. execute.py    the live run: the same scheduler, driven by processes as they end
8. report.py     a test's reports across the process boundary (the child's plugin, and
                 the parent's reading and completing of them)
9. summary.py    wall time, GPU utilisation, speed-up over serial, against the plan
10. plugin.py    the pytest hooks: options, taking over the run loop, reporting, summary

The plugin is registered as the ``avrid-gpusched`` pytest11 entry point and does nothing
unless ``--gpus`` is given. The pure parts (needs, inventory, schedule, plan, durations) can
be used on their own, e.g. to plan a suite without running it.
"""

from avrid.gpusched.durations import Durations, load_durations, save_durations
from avrid.gpusched.inventory import Gpu, Inventory, InventoryError, parse_gpus
from avrid.gpusched.needs import GpuNeeds, MarkerError, needs_of
from avrid.gpusched.plan import Plan, Planned, lower_bound, simulate
from avrid.gpusched.runner import retry_reason
from avrid.gpusched.schedule import (
    Fcfs,
    Job,
    LongestFirstBackfill,
    Policy,
    Reservation,
    Scheduler,
    Start,
    why_infeasible,
)

__all__ = [
    "Durations", "Fcfs", "Gpu", "GpuNeeds", "Inventory", "InventoryError", "Job",
    "LongestFirstBackfill", "MarkerError", "Plan", "Planned", "Policy", "Reservation",
    "Scheduler", "Start", "load_durations", "lower_bound", "needs_of", "parse_gpus",
    "retry_reason", "save_durations", "simulate", "why_infeasible",
]
