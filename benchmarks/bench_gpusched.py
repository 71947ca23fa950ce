"""Benchmark — the GPU test scheduler's policy: planned makespan against the lower bound.

What is measured, over 1,000 random workloads (seeded) on 8 GPUs: 8 to 60 tests each, needing
1, 2, 4 or 8 GPUs (probabilities 0.55, 0.25, 0.12, 0.08), durations long-tailed like a GPU test
tier (lognormal around 30 s, sigma 1.2, clipped to 2 s .. 30 min), in collection order (random):

- planned makespan / lower bound, the bound being max(total GPU-seconds / 8, longest test),
  mean and worst, for three policies: longest-first with one reservation and EASY backfilling
  (`LongestFirstBackfill`, the plugin's), longest-first without backfilling (the order alone),
  and FCFS in collection order (`Fcfs`, what one would write first);
- the mean of the per-workload ratio longest-first+backfill / FCFS;
- the same with wrong estimates: the policy plans with the estimates but each test really lasts
  its estimate times a lognormal factor (sigma 0.5), as when durations come from the last run;
  the ratio is then to the bound of the real durations;
- planning time: one whole `simulate` of a 60-test workload, median.

No target is fixed: these are the figures the README quotes. The scheduler is pure Python and
the whole benchmark takes a few seconds on one core.

Run: ``python benchmarks/bench_gpusched.py [--workloads 1000] [--seed 0]``. Always exits 0.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from avrid.gpusched import Fcfs, Gpu, Job, LongestFirstBackfill, Policy, lower_bound, simulate

GPUS = tuple(Gpu(id=str(i), device=str(i)) for i in range(8))
WIDTHS, WEIGHTS = (1, 2, 4, 8), (0.55, 0.25, 0.12, 0.08)


class LongestFirst(Fcfs):
    """Longest first, strictly in order: what the order alone gives, without backfilling."""

    name = "longest-first"

    def order(self, jobs: Sequence[Job]) -> list[Job]:
        return LongestFirstBackfill().order(jobs)


POLICIES: tuple[Policy, ...] = (LongestFirstBackfill(), LongestFirst(), Fcfs())


def workload(rng: random.Random) -> list[Job]:
    return [Job(name=f"t{i}", gpus=rng.choices(WIDTHS, WEIGHTS)[0],
                duration_s=min(1800.0, max(2.0, rng.lognormvariate(3.4, 1.2))))
            for i in range(rng.randint(8, 60))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    ratios = {(p.name, noisy): [] for p in POLICIES for noisy in (False, True)}
    vs_fcfs = {False: [], True: []}
    for _ in range(args.workloads):
        jobs = workload(rng)
        actual = {j.name: j.duration_s * rng.lognormvariate(0.0, 0.5) for j in jobs}
        for noisy in (False, True):
            real = [Job(name=j.name, gpus=j.gpus, duration_s=actual[j.name]) for j in jobs]
            bound = lower_bound(real if noisy else jobs, len(GPUS))
            spans = {}
            for policy in POLICIES:
                plan = simulate(jobs, GPUS, policy, actual=actual if noisy else None)
                spans[policy.name] = plan.makespan
                ratios[policy.name, noisy].append(plan.makespan / bound)
            vs_fcfs[noisy].append(spans[POLICIES[0].name] / spans[Fcfs.name])
    big = max((workload(random.Random(s)) for s in range(50)), key=len)
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        simulate(big, GPUS)
        times.append(time.perf_counter() - t0)

    print(f"{args.workloads} random workloads on 8 GPUs (seed {args.seed}): 8-60 tests of "
          f"1/2/4/8 GPUs, lognormal durations\n")
    print(f"{'makespan / lower bound':<26}{'exact estimates':>24}"
          f"{'estimates x lognormal(0.5)':>30}")
    print(f"{'policy':<26}{'mean':>12}{'worst':>12}{'mean':>15}{'worst':>15}")
    for p in POLICIES:
        exact, noisy = ratios[p.name, False], ratios[p.name, True]
        print(f"{p.name:<26}{statistics.mean(exact):>12.3f}{max(exact):>12.3f}"
              f"{statistics.mean(noisy):>15.3f}{max(noisy):>15.3f}")
    print(f"\nmean of (longest-first+backfill / FCFS) per workload: "
          f"{statistics.mean(vs_fcfs[False]):.3f} (exact estimates), "
          f"{statistics.mean(vs_fcfs[True]):.3f} (wrong estimates); "
          f"worst {max(vs_fcfs[False]):.3f} / {max(vs_fcfs[True]):.3f}")
    print(f"planning one {len(big)}-test workload (simulate): "
          f"{1000 * statistics.median(times):.1f} ms median")


if __name__ == "__main__":
    main()
