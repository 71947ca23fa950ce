"""Chapter 3 demo — canonical results: the same result whatever a worker did locally, a merge
that checks every id and reduces metrics exactly, and the timeline that shows the bubbles.

Run it with ``python -m chapters.ch03_results`` (CPU only, well under a minute). It reads top
to bottom:

1. one shard, three local strategies (packed micro-batches, one big pass, padded micro-batches):
   the canonical results are identical — outputs, ids, data metrics; only per-rank facts differ;
2. what the merge refuses (no Ray): another format version, a missing sample, a missing shard;
3. Ray, an "actor" group on a dp=2 x tp=2 mesh: `run_shards` plans, sends, waits and merges;
   only the tp=0 ranks return data, the batch comes back in its original order, and the
   metrics are exact — next to the wrong mean of per-shard means;
4. Ray, a "ref" group on a dp=4 mesh: a long-tailed batch dispatched contiguously (imbalanced)
   and with Karmarkar–Karp (balanced); both timelines as Chrome/Perfetto traces and one Gantt
   chart under ``outputs/ch03/``, with every worker's busy and idle share.

It exits 0 when every check passes and 1 otherwise. It uses `avrid.workers`, `avrid.dispatch`,
`avrid.results`, chapter 2's example batch and the example worker in ``workers.py``; it defines
no library code.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from avrid.dispatch import Batch, DispatchConfig, DispatchPlan, make_plan
from avrid.results import (
    RESULT_VERSION,
    Merged,
    Timeline,
    WorkerResult,
    merge,
    run_shards,
    stacked_gantt,
)
from avrid.workers import (
    Mesh,
    PlacementPlan,
    ResourcePool,
    RoleSpec,
    WorkerGroup,
    WorkerIdentity,
    plan_placement,
)
from chapters.ch02_dispatch.workers import rollout_batch
from chapters.ch03_results.workers import STRATEGIES, ActorWorker, expected_log_probs

BUDGET = 4096  # tokens per micro-batch
SECONDS_PER_TOKEN = 3.5e-5  # pretend GPU time: a 40k-token shard "computes" for 1.4 s
# outputs/ is git-ignored; anchored at the checkout so `avrid demo ch03` works from anywhere.
OUT_DIR = Path(__file__).resolve().parents[2] / "outputs" / "ch03"


def check(label: str, ok: bool) -> bool:
    """Print one verified claim; the demo's exit status is the AND of all of them."""
    print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    return ok


def shown(path: Path) -> Path:
    """`path` relative to the working directory when it lies below it."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def local_worker(dp: int, dp_size: int) -> ActorWorker:
    """A worker built by hand, in this process: a worker is an ordinary class."""
    return ActorWorker(WorkerIdentity(role="actor", rank=dp, world_size=dp_size,
                                      coords={"dp": dp}))


def data_metrics(result: WorkerResult) -> dict[str, tuple[float, float]]:
    """Name -> (total, weight) of the metrics about samples (not about the rank)."""
    return {m.name: (m.total, m.weight) for m in result.metrics if not m.per_rank}


def rank_metrics(result: WorkerResult) -> dict[str, float]:
    """Name -> value of the per-rank metrics."""
    return {m.name: m.value for m in result.metrics if m.per_rank}


def strategies_agree() -> bool:
    """Section 1: one shard through every local strategy."""
    batch = rollout_batch(num_prompts=4, group_size=4)
    plan = make_plan(batch, 1, DispatchConfig(micro_batch_tokens=BUDGET))
    shard = plan.split(batch)[0]
    print(f"  one shard: {len(shard.batch)} samples, {int(shard.batch.total_lens.sum()):,} "
          f"tokens, {len(shard.micro_batches())} micro-batches of <= {BUDGET} tokens")
    worker = local_worker(0, 1)
    results = {s: worker.log_probs(shard, s) for s in STRATEGIES}
    print(f"  {'strategy':<8} {'what it does':<58} {'passes':>6} {'peak pass':>9}")
    for s, r in results.items():
        rm = rank_metrics(r)
        print(f"  {s:<8} {STRATEGIES[s]:<58} {rm['forward_passes']:>6.0f} "
              f"{rm['peak_pass_tokens']:>9,.0f}")
    ref = results["packed"]
    assert ref.outputs is not None
    others = list(results.values())[1:]
    print(f"  every result: format v{ref.version}, ids {ref.sample_ids[:3].tolist()}..., "
          f"columns {sorted(ref.outputs.packed) + sorted(ref.outputs.scalars)}")
    return all([
        check("outputs identical, bit for bit (Batch.equals)",
              all(r.outputs is not None and r.outputs.equals(ref.outputs) for r in others)),
        check("same sample ids, in the order the shard was sent",
              all(torch.equal(r.sample_ids, shard.batch.sample_ids) for r in results.values())),
        check("same data metrics (total and weight, compared with ==)",
              all(data_metrics(r) == data_metrics(ref) for r in others)),
        check("log-probs equal the driver's own computation on the whole shard",
              torch.equal(ref.outputs.packed["logprobs"].values,
                          expected_log_probs(shard.batch).values)),
        check("per-rank metrics differ: they describe the rank, not the samples",
              len({tuple(rank_metrics(r).values()) for r in results.values()}) == 3),
    ])


def refused(label: str, attempt: Callable[[], object]) -> bool:
    """Run `attempt`, expect a ValueError, print its first line cut to the screen."""
    try:
        attempt()
    except ValueError as exc:
        text = str(exc)
        print(f"    ValueError: {text if len(text) <= 92 else text[:89] + '...'}")
        return check(label, True)
    return check(label + " (it did not refuse)", False)


def merge_checks() -> bool:
    """Section 2: what `merge` checks before it combines anything."""
    batch = rollout_batch(num_prompts=3, group_size=4, seed=1)
    plan = make_plan(batch, 2, DispatchConfig(micro_batch_tokens=BUDGET))
    results = [local_worker(s.index, 2).log_probs(s) for s in plan.split(batch)]
    arrived = random.Random(0).sample(results, len(results))  # results come in any order
    merged = merge(plan, arrived)
    print(f"  2 shards of {[len(r.sample_ids) for r in results]} samples, merged in "
          f"arrival order {[r.identity.name for r in arrived]}")
    ok = check("merged ids equal the batch's, in the original order",
               torch.equal(merged.batch.sample_ids, batch.sample_ids))
    first = results[0]
    assert first.outputs is not None
    newer = dataclasses.replace(first, version=RESULT_VERSION + 1)
    short = dataclasses.replace(first, outputs=first.outputs.slice(1, len(first.outputs)))
    ok &= refused("a result of another format version", lambda: merge(plan, [newer, results[1]]))
    ok &= refused("a result with a missing sample", lambda: merge(plan, [short, results[1]]))
    ok &= refused("a shard with no collect result", lambda: merge(plan, [results[1]]))
    return ok


def launch_plan() -> PlacementPlan:
    """Two roles colocated on 4 one-CPU bundles: the actor on dp=2 x tp=2, the reference
    policy on dp=4 (same worker class, another mesh). Rank r of each shares bundle r."""
    pool = ResourcePool.uniform("cpu", 4, cpus=1)
    roles = [RoleSpec(role="actor", worker=ActorWorker, mesh=Mesh.of(dp=2, tp=2), pool="cpu",
                      cpus=0.5),
             RoleSpec(role="ref", worker=ActorWorker, mesh=Mesh.of(dp=4), pool="cpu",
                      cpus=0.5)]
    return plan_placement([pool], roles)


def show_metrics(merged: Merged) -> None:
    """The merged metrics with their reduction and scope."""
    print(f"  {'metric':<18} {'reduction':<12} {'scope':<9} {'value':>12}")
    for name, m in merged.metrics.items():
        scope = "per rank" if m.per_rank else "data"
        print(f"  {name:<18} {m.reduction:<12} {scope:<9} {m.value:>12,.4f}")


def mean_of_means(merged: Merged, name: str) -> float:
    """The wrong way: average the per-shard means, ignoring how much each shard holds."""
    per_shard = [m for r in merged.results if r.is_collect for m in r.metrics if m.name == name]
    for r, m in zip([r for r in merged.results if r.is_collect], per_shard, strict=True):
        print(f"    {r.identity.name} (dp={r.identity.coords['dp']}): mean {m.value:,.4f} "
              f"over {m.weight:,.0f} {'tokens' if m.reduction == 'mean_tokens' else 'samples'}")
    return float(np.mean([m.value for m in per_shard]))


def collect_ranks(group: WorkerGroup) -> bool:
    """Section 3: the round trip on a dp=2 x tp=2 group."""
    batch = rollout_batch(num_prompts=4, group_size=4)
    config = DispatchConfig(micro_batch_tokens=BUDGET)
    merged = run_shards(group, ActorWorker.log_probs, batch, config, "packed",
                        seconds_per_token=SECONDS_PER_TOKEN / 4)
    print(f"  {'rank':<9} {'coords':<20} {'collect':<8} {'rows returned':>13} {'spans':>6}")
    for r in merged.results:
        rows = "-" if r.outputs is None else str(len(r.outputs))
        print(f"  {r.identity.name:<9} {str(dict(r.identity.coords)):<20} "
              f"{str(r.is_collect):<8} {rows:>13} {len(r.spans):>6}")
    print(f"  original ids: {batch.sample_ids.tolist()}")
    print(f"  merged ids:   {merged.batch.sample_ids.tolist()}")
    print("  driver spans: " + ", ".join(f"{s.name} {s.duration * 1000:.0f} ms"
                                         for s in merged.driver_spans))
    show_metrics(merged)
    ok = all([
        check("only the tp=0 ranks returned data",
              [r.is_collect for r in merged.results]
              == [c["tp"] == 0 for c in map(group.mesh.coords, range(group.world_size))]),
        check("merged ids and log-probs equal the batch's, in the original order",
              torch.equal(merged.batch.sample_ids, batch.sample_ids)
              and torch.equal(merged.batch.packed["logprobs"].values,
                              expected_log_probs(batch).values)),
        check("response_tokens counts each sample once (collect ranks only)",
              merged.metrics["response_tokens"].value == int(batch.response_lens.sum())),
        check("forward_passes counts every rank's passes (TP replicas too)",
              merged.metrics["forward_passes"].value
              == 2 * sum(len(s.micro_batches()) for s in make_plan(batch, 2, config)
                         .split(batch))),
    ])
    everyone = sum(m.total for r in merged.results for m in r.metrics
                   if m.name == "response_tokens")
    print(f"  (summed over every rank, TP replicas included, response_tokens would be "
          f"{everyone:,.0f}: twice the truth)")
    truth = {"logprob_mean": float(expected_log_probs(batch).values.mean()),
             "response_len_mean": float(batch.response_lens.double().mean())}
    for name, true in truth.items():
        print(f"  {name}:")
        naive = mean_of_means(merged, name)
        exact = merged.metrics[name].value
        print(f"    mean of the shard means {naive:,.4f}   merged exactly {exact:,.4f}   "
              f"whole batch, computed here {true:,.4f}")
        ok &= check(f"{name}: the merged value is the whole-batch mean",
                    abs(exact - true) <= 1e-12 * abs(true))
    print("  (KK gave both shards nearly the same tokens, so the token mean's error is small "
          "here;\n  their sample counts differ, so the sample mean's error is not)")
    return ok


def run_timed(group: WorkerGroup, batch: Batch, method: str) -> tuple[Merged, Timeline]:
    """One dispatch of `batch` with partitioner `method`, and its timeline."""
    config = DispatchConfig(method=method, micro_batch_tokens=2 * BUDGET)
    merged = run_shards(group, ActorWorker.log_probs, batch, config, "packed",
                        seconds_per_token=SECONDS_PER_TOKEN)
    return merged, Timeline.from_results(merged.results, merged.driver_spans)


def timelines(group: WorkerGroup) -> bool:
    """Section 4: an imbalanced and a balanced dispatch of one long-tailed batch."""
    batch = rollout_batch(num_prompts=16, group_size=8)
    print(f"  {len(batch)} samples, {int(batch.total_lens.sum()):,} tokens; each pass sleeps "
          f"{SECONDS_PER_TOKEN * 1e6:.0f} us per token")
    run_shards(group, ActorWorker.log_probs, batch.slice(0, 8))  # warm up every worker
    merged: dict[str, Merged] = {}
    tls: dict[str, Timeline] = {}
    plans: dict[str, DispatchPlan] = {}
    for method in ("contiguous", "kk"):
        merged[method], tls[method] = run_timed(group, batch, method)
        plans[method] = make_plan(batch, 4, DispatchConfig(method=method,
                                                           micro_batch_tokens=2 * BUDGET))
    titles = {}
    for method, tl in tls.items():
        shard_tokens = ", ".join(f"{c / 1000:.0f}k" for c in plans[method].shard_costs)
        titles[method] = (f"{method}: shard tokens {shard_tokens} "
                          f"(max / lower bound {plans[method].imbalance:.2f})")
        print(f"\n  -- {titles[method]} --")
        for line in tl.describe().splitlines():
            print("    " + line)
        trace = tl.to_chrome_trace(OUT_DIR / f"trace_{method}.json")
        print(f"    trace: {shown(trace)}")
    png = stacked_gantt({titles[m]: tl for m, tl in tls.items()},
                        OUT_DIR / "gantt_contiguous_vs_kk.png")
    print(f"\n  Gantt charts (contiguous above, kk below, one time scale): {shown(png)}")
    print("  open a trace in https://ui.perfetto.dev (or chrome://tracing): one row per "
          "worker, one per driver step")
    window = {m: tl.end - tl.start for m, tl in tls.items()}
    share = {m: np.mean([u.share for lbl, u in tl.utilization().items() if lbl != "driver"])
             for m, tl in tls.items()}
    print(f"  step: contiguous {window['contiguous']:.2f} s, kk {window['kk']:.2f} s "
          f"({window['kk'] / window['contiguous']:.2f}x); mean worker busy share "
          f"{share['contiguous']:.0%} -> {share['kk']:.0%}")
    return all([
        check("both dispatches merge to the same outputs, in the original order",
              merged["kk"].batch.equals(merged["contiguous"].batch)
              and torch.equal(merged["kk"].batch.sample_ids, batch.sample_ids)),
        check("the balanced step is shorter", window["kk"] < window["contiguous"]),
        check("balanced workers idle less", share["kk"] > share["contiguous"]),
    ])


def run_on_ray() -> bool:
    """Start Ray, launch both roles, run sections 3 and 4, shut Ray down."""
    import ray

    from avrid.workers import RayBackend, start_ray

    start_ray()
    try:
        t0 = time.perf_counter()
        with RayBackend(call_timeout_s=120).launch(launch_plan()) as cluster:
            actor = cluster.group("actor", ActorWorker)
            ref = cluster.group("ref", ActorWorker)
            print(f"  launched actor ({actor.mesh}) and ref ({ref.mesh}) on 4 bundles in "
                  f"{time.perf_counter() - t0:.1f} s")
            ok = collect_ranks(actor)
            print("\n== 4. the timeline: an imbalanced and a balanced dispatch (ref, dp=4) ==")
            ok &= timelines(ref)
            return ok
    finally:
        ray.shutdown()  # stops the raylet and workers this script started, even on error


def main() -> int:
    """Strategies, merge checks, collect ranks and metrics, timelines. Returns the exit status."""
    start = time.perf_counter()
    print("== 1. one shard, three local strategies, one canonical result ==")
    ok = strategies_agree()
    print("\n== 2. versioned and checked: what merge refuses ==")
    ok &= merge_checks()
    print("\n== 3. Ray: actor on dp=2 x tp=2, only the collect ranks (tp=0) send data ==")
    ok &= run_on_ray()
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} in "
          f"{time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
