"""Benchmark — `make demo` (``avrid ppo``, the default preset) on this tree against another
commit, side by side.

Issue 28 changed the trainer's layout (packed rows, chunked log-probs, SDPA attention) and must
not make the demo slower or change what it learns. This runs the same command on both trees,
alternating (base, this, base, this, ...) so that a machine busy with something else slows
both alike, and prints each run's wall time, the medians and their ratio, and each tree's
validation reward curve from its metrics.jsonl.

The other tree is a `git worktree` of `--base` in a temporary folder (removed at the end); its
code runs through PYTHONPATH, which comes before this checkout's editable install, in the
driver and in the Ray workers it starts.

Run: ``.venv/bin/python benchmarks/demo_speed.py [--base c30d38c] [--repeats 3]
[--set train.steps=150 ...]``. About 2 x repeats x 1.5 minutes on 2 cores. Always exits 0: a
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(code: Path, out: Path, overrides: list[str]) -> float:
    """Wall seconds of one ``avrid ppo`` run with `code` first on the path, into `out`."""
    env = {**os.environ, "PYTHONPATH": str(code), "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "avrid.cli", "ppo", "--out", str(out)]
    for o in overrides:
        cmd += ["--set", o]
    cmd += ["--set", "train.progress=false"]
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=code, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def val_curve(out: Path) -> list[tuple[int, float]]:
    """(step, val/reward) rows of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["step"]), round(float(r["val/reward"]), 4)) for r in rows
            if "val/reward" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="c30d38c", help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="avrid-demo-speed-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(base), args.base],
                       cwd=ROOT, check=True, capture_output=True)
        try:
            times: dict[str, list[float]] = {"base": [], "this": []}
            curves: dict[str, list[tuple[int, float]]] = {}
            for i in range(args.repeats):
                for name, code in (("base", base), ("this", ROOT)):
                    out = Path(tmp) / f"{name}-{i}"
                    seconds = run_once(code, out, args.overrides)
                    times[name].append(seconds)
                    curves[name] = val_curve(out)
                    print(f"run {i + 1} {name:>4}: {seconds:6.1f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           check=False, capture_output=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nmedian of {args.repeats}: base ({args.base}) {med['base']:.1f} s, "
          f"this tree {med['this']:.1f} s; this / base = {med['this'] / med['base']:.3f}")
    for name, curve in curves.items():
        print(f"val/reward {name:>4}: " + ", ".join(f"{s}:{v}" for s, v in curve))


if __name__ == "__main__":
    main()
