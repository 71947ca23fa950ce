"""Benchmark — the fan-out overhead of an avrid group call against bare Ray actor calls.

What is measured: the latency of one fan-out round trip to 8 workers running a no-op method,
    avrid:    group.call(BenchWorker.noop)                       (WorkerGroup -> _RayChannel)
    bare:     ray.get([a.noop.remote() for a in actors])         (plain @ray.remote actors)
and the same with a small payload (1 KiB of bytes, the same object sent to every rank). avrid
and bare Ray each run 8 single-CPU actors, one per bundle of an 8-bundle PACK placement group, so
the only difference is avrid's layer: the method check, the per-rank submit and
`_RayChannel.gather`'s fail-fast wait (ray.wait in slices, then ray.get).

Why interleaved: these machines are small and noisy, so a number taken a minute apart from
another means little. Each repeat times one block of calls per side, the order reversed every
other repeat (AB BA ...), so drift hits both sides alike. The ratio reported
is the median over repeats of each repeat's avrid/bare ratio of medians, with its min and max.

Run: ``python benchmarks/bench_workers.py [--repeats 7] [--calls 200] [--workers 8]``.
It always exits 0: it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from avrid.workers import (
    Mesh,
    RayBackend,
    ResourcePool,
    RoleSpec,
    Worker,
    plan_placement,
    start_ray,
)

TARGET = 1.25
PAYLOAD = b"x" * 1024


class BenchWorker(Worker):
    """The avrid worker: a no-op method that takes optional arguments and returns None."""

    def noop(self, *args: object) -> None:
        """Do nothing (the payload, if any, is received and dropped)."""


@ray.remote
class BareActor:
    """The bare Ray actor with the same no-op method."""

    def noop(self, *args: object) -> None:
        """Do nothing (the payload, if any, is received and dropped)."""

    def hold(self, seconds: float, payload: object = None) -> tuple[float, object]:
        """Sleep `seconds` and send `payload` back, with the seconds actually slept: a call
        that carries data and lasts as long as a phase's compute, and does nothing else."""
        t0 = time.perf_counter()
        time.sleep(seconds)
        return time.perf_counter() - t0, payload


def start_bare(n: int) -> tuple[list, object]:
    """Start `n` bare actors, one per bundle of an n-bundle PACK placement group (as avrid)."""
    pg = placement_group([{"CPU": 1.0}] * n, strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    actors = [BareActor.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(n)]
    ray.get([a.noop.remote() for a in actors])  # wait until every actor is up
    return actors, pg


def time_block(fn: Callable[[], object], calls: int) -> list[float]:
    """Run `fn` `calls` times; return each call's latency in microseconds."""
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


class BareFanOut:
    """`ray.get` of a no-op on each of n plain actors, one per bundle of a PACK placement
    group, as `bench_workers.py` measures it: the floor a phase call is compared with."""

    def __init__(self, workers: int) -> None:
        self.actors, self.pg = start_bare(workers)
        self.median_ms(20)  # warm-up

    def median_ms(self, calls: int) -> float:
        return statistics.median(time_block(
            lambda: ray.get([a.noop.remote() for a in self.actors]), calls)) / 1000

    def held_ms(self, seconds: float, payloads: list[object], calls: int) -> float:
        """Ray's own cost of a phase call, nothing else done: rank i is sent payloads[i],
        holds it `seconds` and sends it back. The median of wall time minus the longest
        hold, in ms — what any layer built on Ray actor calls pays for that call here."""
        def once() -> float:
            t0 = time.perf_counter()
            held = ray.get([a.hold.remote(seconds, p)
                            for a, p in zip(self.actors, payloads, strict=True)])
            return time.perf_counter() - t0 - max(h for h, _ in held)

        once()  # the first payload of a kind imports its classes in the actors: untimed
        return statistics.median(once() for _ in range(calls)) * 1000

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)


def bare_fan_out_ms(workers: int, calls: int = 300) -> float:
    """The bare fan-out on a cluster with nothing else running (after the trainers)."""
    bare = BareFanOut(workers)
    try:
        return bare.median_ms(calls)
    finally:
        bare.close()


def compare(sides: dict[str, Callable[[], object]], *, repeats: int, calls: int,
            warmup: int) -> dict[str, float]:
    """Time every side in alternating blocks; return per-call medians (us) per side, and the
    median/min/max over repeats of the per-repeat ratio avrid/bare."""
    for fn in sides.values():
        time_block(fn, warmup)
    lat: dict[str, list[float]] = {name: [] for name in sides}
    ratios: dict[str, list[float]] = {"bare": []}
    for rep in range(repeats):
        order = list(sides.items())
        if rep % 2:
            order.reverse()  # AB BA: no side always runs first
        med = {}
        for name, fn in order:
            block = time_block(fn, calls)
            med[name] = statistics.median(block)
            lat[name].extend(block)
        for base in ratios:
            ratios[base].append(med["avrid"] / med[base])
    out = {f"{name} us": statistics.median(v) for name, v in lat.items()}
    for base, r in ratios.items():
        out[f"/{base}"], out[f"/{base} min"], out[f"/{base} max"] = (
            statistics.median(r), min(r), max(r))
    return out


def main() -> None:
    """Start Ray, both sets of actors, run the comparisons, print the table, clean up."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8, help="ranks on each side (8)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved blocks (7)")
    parser.add_argument("--calls", type=int, default=200, help="calls per block (200)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed calls per side (50)")
    args = parser.parse_args()
    n = args.workers

    # Both sides reserve n CPUs; CPUs are logical slots in Ray, so 2n fit on a laptop.
    start_ray(num_cpus=2 * n)
    actors: list = []
    pg = None
    try:
        plan = plan_placement([ResourcePool.uniform("bench", n)],
                              [RoleSpec(role="bench", worker=BenchWorker, mesh=Mesh.of(dp=n),
                                        pool="bench")])
        with RayBackend().launch(plan) as cluster:
            group = cluster.group("bench", BenchWorker)
            actors, pg = start_bare(n)
            cases = {
                "no-op": {
                    "avrid": lambda: group.call(BenchWorker.noop),
                    "bare": lambda: ray.get([a.noop.remote() for a in actors])},
                "1 KiB to all": {
                    "avrid": lambda: group.call(BenchWorker.noop, PAYLOAD),
                    "bare": lambda: ray.get([a.noop.remote(PAYLOAD) for a in actors])},
            }
            print(f"fan-out to {n} workers: {args.repeats} interleaved repeats x {args.calls} "
                  f"calls per side, {os.cpu_count()} cores; per-call medians in us")
            print(f"{'case':<13}{'avrid':>7}{'bare':>7}{'avrid/bare [min-max]':>24}")
            results = {}
            for name, sides in cases.items():
                r = results[name] = compare(sides, repeats=args.repeats, calls=args.calls,
                                            warmup=args.warmup)
                spread = f"{r['/bare']:.2f} [{r['/bare min']:.2f}-{r['/bare max']:.2f}]"
                print(f"{name:<13}{r['avrid us']:>7.0f}{r['bare us']:>7.0f}{spread:>24}")
        ratio = results["no-op"]["/bare"]
        verdict = "PASS" if ratio <= TARGET else "FAIL"
        print(f"fan-out ratio avrid/bare = {ratio:.2f} (target <= {TARGET}): {verdict}")
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        if pg is not None:
            remove_placement_group(pg)
        ray.shutdown()


if __name__ == "__main__":
    main()
