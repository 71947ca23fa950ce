"""Benchmark — avrid's partition against verl's Karmarkar–Karp, case by case.

For each of 36 length sets (six shapes: long-tailed rollouts, uniform, bimodal short/truncated,
Pareto tails, heavily tied short answers, and few items per shard; each at three (n, k)
sizes; each with and without equal counts, n a multiple of k since verl's equal-size KK
needs it), it partitions token counts with avrid's `karmarkar_karp` (LDM from both starts,
then exchange refinement) and with verl's KK (`verl_kk.py`, the same algorithm as verl
0.9.x's), and prints:

- max shard cost / lower bound for both, and which is better (both maxima summed the same
  way, with `np.bincount` over the same float64 costs, so "equal" means equal);
- the median planning time of each over interleaved repeats, and their ratio.

Targets (issue 44): avrid never worse than verl on any case; avrid's planning time at most
0.05 x verl's, over the whole set (the sum of the per-case medians, as a trainer planning all
these batches would spend it). Per case the ratio varies widely: verl's equal-size KK starts
from n / k states and is quick where few items fall on each shard, its one-item start is
slow on large batches; the median and worst per-case ratios are printed too.

Run: ``python benchmarks/bench_dispatch_verl.py [--repeats 7] [--seed 0]``. It exits 0 either
way: it is a benchmark; the verdict lines say PASS or FAIL.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # verl_kk.py beside this file
from verl_kk import verl_kk  # noqa: E402

from avrid.dispatch.partition import karmarkar_karp  # noqa: E402

MAX_LEN = 8192
SIZES = ((512, 8), (2048, 16), (4096, 64))
TARGET_TIME_RATIO = 0.05


def _rollouts(n: int, rng: np.random.Generator) -> np.ndarray:
    prompt = np.clip(rng.lognormal(np.log(200), 0.5, n), 16, 2048)
    response = np.clip(rng.lognormal(np.log(1500), 1.0, n), 1, MAX_LEN)
    response[rng.random(n) < 0.08] = MAX_LEN
    return prompt + response


def _bimodal(n: int, rng: np.random.Generator) -> np.ndarray:
    short = rng.integers(20, 200, n)
    return np.where(rng.random(n) < 0.3, MAX_LEN + rng.integers(0, 300, n), short)


SHAPES: dict[str, Callable[[int, np.random.Generator], np.ndarray]] = {
    "rollouts": _rollouts,
    "uniform": lambda n, rng: rng.integers(64, 4096, n),
    "bimodal": _bimodal,
    "pareto": lambda n, rng: np.clip(100 * (1 + rng.pareto(1.2, n)), 1, 32768),
    "tied": lambda n, rng: rng.integers(5, 12, n),
    "few-per-shard": lambda n, rng: np.clip(rng.lognormal(np.log(1500), 1.0, n), 1, MAX_LEN),
}


def _cases(seed: int) -> list[tuple[str, int, int, bool, np.ndarray]]:
    """(shape, n, k, equal_count, token counts) for every case, from one seed."""
    rng = np.random.default_rng(seed)
    out = []
    for shape, draw in SHAPES.items():
        for n, k in SIZES:
            if shape == "few-per-shard":
                n = 2 * k  # two or three items per shard: where LDM's starts differ most
            costs = np.asarray(draw(n, rng), dtype=np.int64).astype(np.float64)
            for equal in (False, True):
                out.append((shape, n, k, equal, costs))
    return out


def _max_cost(costs: np.ndarray, shards: list[list[int]] | tuple[tuple[int, ...], ...],
              k: int) -> float:
    labels = np.empty(len(costs), dtype=np.int64)
    for s, positions in enumerate(shards):
        labels[list(positions)] = s
    return float(np.bincount(labels, weights=costs, minlength=k).max())


def _median_ms(calls: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median ms per call, interleaved and rotated per repeat (the machines are noisy)."""
    for call in calls:  # warm-up
        call()
    times: list[list[float]] = [[] for _ in calls]
    for r in range(repeats):
        for j in [(r + i) % len(calls) for i in range(len(calls))]:
            t0 = time.perf_counter()
            calls[j]()
            times[j].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per partitioner")
    parser.add_argument("--seed", type=int, default=0, help="seed of the length sets")
    args = parser.parse_args()
    print(f"avrid karmarkar_karp vs verl's KK on token counts; seed {args.seed}, "
          f"median of {args.repeats} interleaved repeats")
    print(f"{'shape':<14} {'n':>5} {'k':>3} {'equal':>5} {'avrid max/bound':>16} "
          f"{'verl max/bound':>15} {'':>7} {'avrid ms':>9} {'verl ms':>9} {'ratio':>7}")
    worse, ratios, totals = [], [], [0.0, 0.0]
    for shape, n, k, equal, costs in _cases(args.seed):
        ours = karmarkar_karp(costs, k, equal_count=equal)
        theirs = verl_kk(costs.tolist(), k, equal_size=equal)
        bound = ours.lower_bound
        a, v = _max_cost(costs, ours.shards, k), _max_cost(costs, theirs, k)
        verdict = "better" if a < v else ("equal" if a == v else "WORSE")
        if verdict == "WORSE":
            worse.append(f"{shape} n={n} k={k} equal={equal}")
        ms_ours, ms_verl = _median_ms(
            [partial(karmarkar_karp, costs, k, equal_count=equal),
             partial(verl_kk, costs.tolist(), k, equal_size=equal)], args.repeats)
        ratios.append(ms_ours / ms_verl)
        totals[0] += ms_ours
        totals[1] += ms_verl
        print(f"{shape:<14} {n:>5} {k:>3} {str(equal):>5} {a / bound:>16.6f} {v / bound:>15.6f} "
              f"{verdict:>7} {ms_ours:>9.3f} {ms_verl:>9.3f} {ms_ours / ms_verl:>7.3f}")
    print()
    print(f"never worse than verl: {len(ratios) - len(worse)} of {len(ratios)} cases "
          f"{'PASS' if not worse else 'FAIL: ' + '; '.join(worse)}")
    total = totals[0] / totals[1]
    print(f"planning time avrid / verl over the set: {total:.3f} ({totals[0]:.1f} ms vs "
          f"{totals[1]:.1f} ms; per case median {statistics.median(ratios):.3f}, worst "
          f"{max(ratios):.3f}) (target <= {TARGET_TIME_RATIO}): "
          f"{'PASS' if total <= TARGET_TIME_RATIO else 'FAIL'}")


if __name__ == "__main__":
    main()
