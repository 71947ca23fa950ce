"""Issue 40: what the kernel-namespace sandbox costs per tool call, against the process sandbox.

Two measurements per backend, side by side in one run (these machines are noisy):

- latency of a trivial call (``print(1)``): the median (and p90) of `--calls` calls, one
  after another;
- throughput of `--concurrent` calls at once (trivial calls submitted together from as many
  threads, as the episode loop's tool threads do): calls per second of wall time, median of
  `--rounds` rounds.

Backends: `namespaces` (the default: bubblewrap, seccomp, a pids cgroup when run as root),
`process` (a child interpreter with audit hooks: the chapter's sandbox before issue 40, kept
as an explicit choice), and, where git can show it, `before` — the exact `sandbox.py` of the
commit before issue 40 (`--before-rev`), loaded from git, for the comparison with "today's".

    python benchmarks/sandbox_cost.py [--calls 50 --concurrent 64 --rounds 3]

Not a timed test: it prints; the exit code is 0 unless a call does not return "ok".
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from avrid.agents.sandbox import ToolLimits, make_sandbox  # noqa: E402

Run = Callable[[str], str]
"""One backend: code -> status."""


def backends(before_rev: str) -> dict[str, Run]:
    limits = ToolLimits(wall_s=30.0, memory_mb=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        found: dict[str, Run] = {}
        for name in ("namespaces", "process"):
            sandbox = make_sandbox(name)
            found[name] = lambda code, s=sandbox: s.run(code, limits).status
    try:
        source = subprocess.run(["git", "show", f"{before_rev}:avrid/agents/sandbox.py"],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        print(f"(no 'before' column: git cannot show {before_rev}:avrid/agents/sandbox.py)")
        return found
    old = types.ModuleType("sandbox_before")
    sys.modules[old.__name__] = old  # its dataclasses look their module up by name
    exec(compile(source, "sandbox_before.py", "exec"), old.__dict__)
    old_limits = old.ToolLimits(wall_s=30.0, memory_mb=512)
    found["before"] = lambda code: old.run_python(code, old_limits).status
    return found


def latency(run: Run, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        status = run("print(1)")
        times.append(time.perf_counter() - start)
        if status != "ok":
            raise SystemExit(f"a trivial call ended {status!r}")
    return times


def throughput(run: Run, concurrent: int) -> float:
    with ThreadPoolExecutor(max_workers=concurrent) as pool:
        start = time.perf_counter()
        statuses = list(pool.map(run, ["print(1)"] * concurrent))
        wall = time.perf_counter() - start
    if set(statuses) != {"ok"}:
        raise SystemExit(f"concurrent calls ended {sorted(set(statuses))}")
    return concurrent / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before-rev", default="f586565")
    args = parser.parse_args()
    runs = backends(args.before_rev)
    for run in runs.values():  # warm up: imports, the seccomp filter, bubblewrap's probe
        run("print(1)")
    print(f"{'backend':<11} {'latency median':>15} {'p90':>8} "
          f"{f'{args.concurrent} at once, calls/s':>24}  (median of {args.rounds} rounds)")
    medians: dict[str, tuple[float, float]] = {}
    for name, run in runs.items():
        times = latency(run, args.calls)
        rates = [throughput(run, args.concurrent) for _ in range(args.rounds)]
        lat = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        medians[name] = (lat, statistics.median(rates))
        print(f"{name:<11} {lat * 1e3:>12.1f} ms {p90 * 1e3:>5.1f} ms {medians[name][1]:>24.1f}"
              f"   rounds: {', '.join(f'{r:.1f}' for r in rates)}")
    base = medians.get("before", medians["process"])
    name = "before" if "before" in medians else "process"
    lat, rate = medians["namespaces"]
    print(f"\nnamespaces vs {name}: latency x{lat / base[0]:.2f}, "
          f"throughput x{rate / base[1]:.2f}")


if __name__ == "__main__":
    main()
