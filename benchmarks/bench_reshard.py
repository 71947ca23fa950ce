"""Benchmark — weight resharding, FSDP trainer to tensor-parallel rollout: planned vs all-gather.

What is measured: moving the weights of a decoder-shaped model (~104M float32 parameters at
the defaults: 8 layers, hidden 768, intermediate 2304, 4 kv heads of 64, vocab 32000, untied
lm_head; names as transformers writes them, so `decoder_tp_layout` applies) from an FSDP
layout over dp = 4 ranks to vLLM's tensor-parallel layout over tp = 2 ranks, colocated (target
rank t shares a process with source rank t, the hybrid engine; ``--disaggregated`` gives the
target ranks their own processes), over gloo between CPU Ray workers:

    planned     ``execute(plan, rank, shards)``: `plan_transfer`'s minimum-bytes plan, local
                copies first, then bucket by bucket of point-to-point sends (``--bucket-mb``)
    all-gather  ``naive_allgather(...)``: every process all-gathers every full tensor (each
                shard padded to the longest), then slices its target region (verl's old path)

One avrid RayBackend group of ``ProcessMap.for_plan(plan).world_size`` single-CPU workers runs
both. Each worker makes its own source shard (a seeded normal tensor per parameter, cut to its
FSDP region): nothing big leaves the driver, which only ships the frozen plan.

Bytes: planned = ``plan.bytes_moved`` beside ``plan.lower_bound`` (what each target needs and
its own process does not hold); all-gather = what gloo's all-gather moves: every one of W
processes receives the W - 1 other padded shards of every parameter (W(W-1) x padded shard).

Wall time: per repeat, each path once, the order swapped every repeat, after one untimed
warm-up each; every rank enters a path after ``dist.barrier()`` and times its own call. A
path's time in a repeat is the slowest rank's (when the last target is complete); medians over
repeats are reported, and the ratio is median(planned) / median(all-gather).

Peak extra memory, measured: once per path, in a fresh group (new processes), each worker
makes its shards, ``gc.collect()`` and ``malloc_trim(0)``, then resets the kernel's RSS
high-water mark (writing 5 to /proc/self/clear_refs), reads VmRSS, runs the path once and reads
VmHWM. Peak extra = VmHWM - VmRSS before - the bytes of the tensors the path returns (both
paths must hold those at the end): the most memory the call needed beyond its inputs and
outputs; the largest over ranks is reported. Precision: pages (4 KiB), and it counts
everything the process touched — gloo's buffers, malloc's retained free chunks, Python objects
(a few MB), and glibc's dynamic mmap threshold keeps freed 10-30 MB buffers in the heap for
reuse — so it is an upper-side measure of the buffers, not a count of them, and it varies
run to run (50-95 MB for the planned path at the defaults on a 2-core machine). Beside it, a second
run of each path under ``torch.profiler`` (profile_memory) counts torch's own allocations
exactly: peak live tensor bytes minus the outputs (allocated up front by `execute`, so counted
whole here, while RSS only counts output pages once written). The verdict judges RSS; the
bound is the bucket size plus the largest single transfer of the plan (the executor's last
receive buffer of one bucket stays referenced while the next bucket's are made).

Correctness, once: the target fingerprints of both paths (`layout_checksums`, added across
ranks with `combine`) must equal the source's.

Run: ``python benchmarks/bench_reshard.py [--repeats 5] [--dp 4] [--tp 2] [--layers 8]
[--hidden 768] [--bucket-mb 64] [--disaggregated]``. It always exits 0: it is a benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from avrid.reshard.executor import ProcessMap, execute, layout_checksums, naive_allgather
from avrid.reshard.fingerprint import combine
from avrid.reshard.layout import ModelLayout
from avrid.reshard.planner import TransferPlan, plan_transfer
from avrid.reshard.tp_layout import decoder_shapes, decoder_tp_layout
from avrid.workers import (
    Mesh,
    RayBackend,
    ResourcePool,
    RoleSpec,
    Worker,
    plan_placement,
    start_ray,
)

TARGET_BYTES = 1.00  # planned bytes / lower bound
TARGET_TIME = 0.6  # planned / all-gather wall time, judged when tp < dp
MB = 1e6
PATHS = ("planned", "all-gather")


def allgather_bytes(source: ModelLayout, world: int) -> int:
    """Bytes gloo's all-gather moves: each of `world` processes receives the world - 1 other
    padded dim-0 shards of every parameter."""
    padded = 0
    for _, p in source.params:
        rows = -(-p.shape[0] // source.world_size)
        padded += rows * (p.nbytes // p.shape[0])
    return world * (world - 1) * padded


# ---------------------------------------------------------------- inside each worker


def _status(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _settle_and_reset_peak() -> int:
    """Free what can be freed, reset the RSS high-water mark; return the RSS now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand retained free chunks back to the OS
    with open("/proc/self/clear_refs", "w") as f:  # Linux >= 4.0: VmHWM := VmRSS
        f.write("5")
    return _status("VmRSS")


class ReshardBench(Worker):
    """One process of the group: holds its source shard, runs either path on demand."""

    def setup(self, plan: TransferPlan, seed: int) -> int:
        """Join gloo and make this process's source shard; return its bytes."""
        self.group = self.init_distributed(timeout_s=600)
        self.plan, self.pmap = plan, ProcessMap.for_plan(plan)
        self.src, self.dst = self.pmap.roles_of(self.identity.rank)
        self.shards: dict[str, torch.Tensor] = {}
        if self.src is not None:
            for i, (name, p) in enumerate(plan.source.params):
                gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
                full = torch.randn(p.shape, generator=gen)  # the same on every rank
                if p.regions[self.src] is not None:
                    self.shards[name] = full[p.regions[self.src].to_slices()].clone()
        return sum(t.nbytes for t in self.shards.values())

    def run(self, path: str) -> dict[str, torch.Tensor]:
        """One call of `path` ("planned" or "all-gather"); its target tensors."""
        me = self.identity.rank
        if path == "planned":
            return execute(self.plan, me, self.shards, self.group)
        return naive_allgather(self.plan.source, self.plan.target, me, self.shards, self.pmap,
                               self.group)

    def peak(self, path: str) -> tuple[int, int, int, dict[str, int], dict[str, int]]:
        """Run `path` twice: (peak extra RSS bytes, peak extra tensor bytes, output bytes,
        target and source checksums). The second run only counts torch's allocations."""
        dist.barrier(group=self.group)
        before = _settle_and_reset_peak()
        out = self.run(path)
        high = _status("VmHWM")
        out_bytes = sum(t.nbytes for t in out.values())
        sums = layout_checksums(self.plan.target, self.dst, out)
        del out
        dist.barrier(group=self.group)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.run(path)  # its outputs are counted, freed, then subtracted below
        live = tensors = 0
        for e in sorted((e for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]"), key=lambda e: e.start_ns()):
            live += e.nbytes()  # + allocated, - freed
            tensors = max(tensors, live)
        return (high - before - out_bytes, tensors - out_bytes, out_bytes, sums,
                layout_checksums(self.plan.source, self.src, self.shards))

    def times(self, repeats: int) -> dict[str, list[float]]:
        """Seconds of this rank's call of each path, per repeat (interleaved, order swapped)."""
        for path in PATHS:  # warm-up: first-call costs (gloo pairs, page faults) untimed
            self.run(path)
        out: dict[str, list[float]] = {p: [] for p in PATHS}
        for rep in range(repeats):
            for path in PATHS if rep % 2 == 0 else PATHS[::-1]:
                gc.collect()
                dist.barrier(group=self.group)
                t0 = time.perf_counter()
                result = self.run(path)
                out[path].append(time.perf_counter() - t0)
                del result
        return out

    def close(self) -> None:
        """Leave the process group (all ranks at once)."""
        self.destroy_distributed()


# ---------------------------------------------------------------- driver


def in_group(plan: TransferPlan, seed: int, body: Callable[[Any], Any]) -> Any:
    """Start a fresh group (new processes), set every rank up, run `body(group)`, release."""
    world = ProcessMap.for_plan(plan).world_size
    placement = plan_placement([ResourcePool.uniform("cpu", world)],
                               [RoleSpec(role="reshard", worker=ReshardBench,
                                         mesh=Mesh.of(dp=world), pool="cpu")])
    with RayBackend().launch(placement) as cluster:
        group = cluster.group("reshard", ReshardBench)
        group.call(ReshardBench.setup, plan, seed)
        try:
            return body(group)
        finally:
            group.call(ReshardBench.close)


def run(args: argparse.Namespace) -> None:
    """Plan, measure memory per path in fresh groups, time both interleaved, report."""
    kv = args.kv_heads * 64
    shapes = decoder_shapes(layers=args.layers, hidden=args.hidden,
                            intermediate=args.intermediate, heads=args.hidden // 64,
                            kv_heads=args.kv_heads, vocab=args.vocab)  # heads of 64
    n_params = sum(torch.Size(s).numel() for s, _ in shapes.values())
    same = {} if args.disaggregated else {t: t for t in range(min(args.dp, args.tp))}
    t0 = time.perf_counter()
    plan = plan_transfer(ModelLayout.fsdp(shapes, args.dp), decoder_tp_layout(shapes, args.tp),
                         same_process=same, bucket_bytes=int(args.bucket_mb * MB))
    plan_s = time.perf_counter() - t0
    world = ProcessMap.for_plan(plan).world_size
    print(f"model: {len(shapes)} tensors, {n_params / 1e6:.1f}M parameters (float32, "
          f"{n_params * 4 / MB:.0f} MB): {args.layers} layers, hidden {args.hidden}, "
          f"intermediate {args.intermediate}, kv {kv}, vocab {args.vocab}")
    print(f"FSDP dp={args.dp} -> TP tp={args.tp}, "
          f"{'disaggregated' if args.disaggregated else 'colocated'}, {world} processes, "
          f"{os.cpu_count()} cores; planned in {plan_s * 1e3:.0f} ms")
    print(plan.describe(max_rows=0))

    start_ray(num_cpus=max(8, world))
    try:
        mem = {path: in_group(plan, args.seed, lambda g, p=path: g.call(ReshardBench.peak, p))
               for path in PATHS}
        per_rank = in_group(plan, args.seed,
                            lambda g: g.call(ReshardBench.times, args.repeats))
    finally:
        ray.shutdown()
    source_sums = combine(r[4] for r in mem["planned"])
    agree = all(combine(r[3] for r in mem[p]) == source_sums for p in PATHS)
    times = {p: [max(r[p][i] for r in per_rank) for i in range(args.repeats)] for p in PATHS}
    report(args, plan, world, mem, times, agree)


def report(args: argparse.Namespace, plan: TransferPlan, world: int,
           mem: dict[str, list[tuple]], times: dict[str, list[float]], agree: bool) -> None:
    """The side-by-side table and the three verdicts."""
    moved = {"planned": plan.bytes_moved, "all-gather": allgather_bytes(plan.source, world)}
    bound = plan.lower_bound
    print(f"\n{args.repeats} interleaved repeats; time = slowest rank, median [min-max]; "
          f"peak extra = max over ranks of VmHWM growth (RSS) or of live torch allocations "
          f"(tensors), minus the outputs")
    print(f"{'path':<11}{'moved MB':>10}{'/bound':>8}{'wall ms':>20}{'RSS MB':>9}"
          f"{'tensors MB':>12}   RSS per rank MB")
    for p in PATHS:
        t = times[p]
        ms = f"{statistics.median(t) * 1e3:.0f} [{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}]"
        extras = [r[0] for r in mem[p]]
        print(f"{p:<11}{moved[p] / MB:>10.1f}{moved[p] / max(bound, 1):>7.2f}x{ms:>20}"
              f"{max(extras) / MB:>9.1f}{max(r[1] for r in mem[p]) / MB:>12.1f}   "
              f"{' '.join(f'{e / MB:.1f}' for e in extras)}")
    outs = " ".join(f"{r[2] / MB:.0f}" for r in mem["planned"])
    print(f"outputs per rank MB: {outs}; lower bound {bound / MB:.1f} MB; "
          f"naive model (full tensors to every target) {plan.bytes_naive / MB:.1f} MB")
    print(f"targets identical to the source (fingerprints, both paths): "
          f"{'yes' if agree else 'NO'}")

    ratio = plan.bytes_moved / bound if bound else 1.0
    ok = abs(ratio - TARGET_BYTES) < 5e-4
    print(f"\nplanned bytes / lower bound = {ratio:.3f} (target {TARGET_BYTES:.2f}): "
          f"{'PASS' if ok else 'FAIL'}")
    wall = statistics.median(times["planned"]) / statistics.median(times["all-gather"])
    each = [a / b for a, b in zip(times["planned"], times["all-gather"], strict=True)]
    judged = ("PASS" if wall <= TARGET_TIME else "FAIL") if args.tp < args.dp \
        else "not judged (tp >= dp)"
    print(f"planned / all-gather wall time = {wall:.2f}x [per repeat {min(each):.2f}-"
          f"{max(each):.2f}] (target <= {TARGET_TIME}x): {judged}")
    extra = max(r[0] for r in mem["planned"])
    largest = max((t.nbytes for t in plan.transfers), default=0)
    limit = plan.bucket_bytes + largest
    print(f"peak extra memory {extra / MB:.1f} MB {'<=' if extra <= limit else '>'} bucket "
          f"{plan.bucket_bytes / MB:.0f} MB + largest region {largest / MB:.1f} MB = "
          f"{limit / MB:.1f} MB: {'PASS' if extra <= limit else 'FAIL'}")
    print(f"  (torch-allocated tensors alone, same definition: "
          f"{max(r[1] for r in mem['planned']) / MB:.1f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per path (5)")
    parser.add_argument("--dp", type=int, default=4, help="FSDP source ranks (4)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel target ranks (2)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (8)")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (768)")
    parser.add_argument("--intermediate", type=int, default=2304, help="MLP width (2304)")
    parser.add_argument("--kv-heads", type=int, default=4, help="kv heads of 64 (4)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (32000)")
    parser.add_argument("--bucket-mb", type=float, default=64, help="bucket size, MB (64)")
    parser.add_argument("--disaggregated", action="store_true",
                        help="target ranks in their own processes (default: colocated)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    args = parser.parse_args()
    try:
        run(args)
    except Exception:  # a benchmark reports, it does not fail the caller
        traceback.print_exc()


if __name__ == "__main__":
    main()
