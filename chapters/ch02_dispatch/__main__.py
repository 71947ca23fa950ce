"""Chapter 2 demo — balance a long-tailed RL batch over data-parallel shards, cut micro-batches
under a token budget, send the shards through Ray workers and put the outputs back in order.

Run it with ``python -m chapters.ch02_dispatch`` (CPU only, well under a minute). It reads top
to bottom:

1. the batch: 64 prompts x 8 responses with long-tailed lengths (a spike at the 4096 cap),
   packed, not padded;
2. balance: the per-shard token cost over 8 shards for contiguous, LPT and Karmarkar–Karp,
   against the lower bound, as a grouped bar chart saved under ``outputs/ch02/``;
3. the plan: Karmarkar–Karp plus token-budget micro-batches, the same count on every shard;
4. the modelled step time (the slowest shard's FLOPs) of each partitioner, next to contiguous;
5. Ray: a dp=4 x tp=2 group of `LogProbWorker`s computes per-sample outputs shard by shard;
   `plan.restore` puts them back in the original order, for 512 samples, for 10 and for 3
   (more shards than samples) — there is no divisibility rule.

It exits 0 when every check passes and 1 otherwise. It uses only `avrid.dispatch`,
`avrid.workers` and the example worker in ``workers.py``; it defines no library code.
"""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch

from avrid.dispatch import (
    Batch,
    DispatchConfig,
    DispatchPlan,
    FlopCost,
    Partition,
    TokenCost,
    dispatch,
    make_plan,
    partition,
)
from avrid.workers import (
    Mesh,
    PlacementPlan,
    ResourcePool,
    RoleSpec,
    WorkerGroup,
    plan_placement,
)
from chapters.ch02_dispatch.workers import LogProbWorker, rollout_batch, toy_logprobs

SHARDS = 8  # data-parallel shards for the planning part (think: 8 GPUs)
BUDGET = 8192  # tokens per micro-batch (verl: ppo_max_token_len_per_gpu)
METHODS = ("contiguous", "lpt", "kk")
# A 7B Llama-like model: what one sequence costs to train on (forward + backward).
FLOPS = FlopCost.from_model(hidden_size=4096, num_layers=32, intermediate_size=11008,
                            vocab_size=32000)
# outputs/ is git-ignored; anchored at the checkout so `avrid demo ch02` works from anywhere.
OUT_DIR = Path(__file__).resolve().parents[2] / "outputs" / "ch02"


def check(label: str, ok: bool) -> bool:
    """Print one verified claim; the demo's exit status is the AND of all of them."""
    print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    return ok


def describe_batch(batch: Batch, max_response: int) -> None:
    """Length statistics, and what packing saves over padding to the longest sequence."""
    resp = batch.response_lens.numpy()
    total = batch.total_lens
    print(f"  {len(batch)} samples, sample ids {batch.sample_ids[0]}..{batch.sample_ids[-1]}")
    print(f"  response length: median {np.median(resp):.0f}, p90 {np.percentile(resp, 90):.0f}, "
          f"max {resp.max()}; {np.mean(resp == max_response):.0%} hit the {max_response} cap")
    padded = len(batch) * int(total.max())
    print(f"  packed tokens: {int(total.sum()):,} (padded to the longest: {padded:,}, "
          f"{padded / int(total.sum()):.1f}x more)")


def balance(batch: Batch, k: int) -> dict[str, Partition]:
    """Partition the per-sample token costs over `k` shards with every method."""
    costs = TokenCost()(batch.prompt_lens.numpy(), batch.response_lens.numpy())
    parts = {m: partition(costs, k, method=m) for m in METHODS}
    print(f"  lower bound: max(total / {k}, longest sample) = "
          f"{parts['kk'].lower_bound:,.0f} tokens")
    for m, p in parts.items():
        print(f"  {m:<10} max {p.max_cost:>9,.0f}  min {min(p.costs):>9,.0f}  "
              f"max / lower bound {p.imbalance:.4f}")
    return parts


def plot_shard_costs(parts: dict[str, Partition], path: Path) -> Path:
    """A grouped bar chart: per shard, one bar per method, and the lower bound as a line."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    k = len(next(iter(parts.values())).costs)
    width = 0.8 / len(parts)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, (m, p) in enumerate(parts.items()):
        ax.bar(np.arange(k) + (j - (len(parts) - 1) / 2) * width, p.costs, width,
               label=f"{m}: max / bound {p.imbalance:.4f}")
    ax.axhline(parts["kk"].lower_bound, color="black", linestyle="--", linewidth=1,
               label="lower bound")
    tallest = max(max(p.costs) for p in parts.values())
    ax.set(xlabel="data-parallel shard", ylabel="tokens per shard", xticks=range(k),
           ylim=(0, tallest * 1.3),  # headroom for the legend above the bars
           title=f"Per-shard cost of {sum(len(s) for s in parts['kk'].shards)} rollouts "
                 f"over {k} shards")
    ax.yaxis.set_major_formatter(lambda y, _: f"{y / 1000:.0f}k")
    ax.legend(loc="upper center", ncol=2, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def show_plan(plan: DispatchPlan, width: int = 100) -> None:
    """`plan.describe()`, each line cut to `width` characters."""
    for line in plan.describe().splitlines():
        print("  " + (line if len(line) <= width else line[:width - 3] + "..."))


def micro_positions(plan: DispatchPlan, shard: int) -> list[list[int]]:
    """Original positions of the samples in each micro-batch of `shard`."""
    pos = plan.shard_positions(shard)
    return [list(pos[lo:hi]) for lo, hi in pairwise(plan.micro_bounds[shard])]


def step_time(plan: DispatchPlan, flops: np.ndarray) -> float:
    """Modelled step time: the slowest shard's sum of micro-batch costs (FLOPs), since a
    synchronous step waits for every shard's last micro-batch."""
    return max(sum(float(flops[mb].sum()) for mb in micro_positions(plan, s))
               for s in range(plan.num_shards))


def micro_counts(plan: DispatchPlan) -> list[int]:
    """Micro-batches per shard."""
    return [len(b) - 1 for b in plan.micro_bounds]


def compare_step_times(batch: Batch, k: int) -> bool:
    """Plan with every method (same budget, same micro-batch count) and compare step times."""
    flops = FLOPS(batch.prompt_lens.numpy(), batch.response_lens.numpy())
    times: dict[str, float] = {}
    for m in METHODS:
        free = make_plan(batch, k, DispatchConfig(method=m, micro_batch_tokens=BUDGET))
        plan = make_plan(batch, k, DispatchConfig(method=m, micro_batch_tokens=BUDGET,
                                                  same_micro_count=True))
        times[m] = step_time(plan, flops)
        print(f"  {m:<10} step {times[m] / times['contiguous']:.3f} x contiguous; "
              f"micro-batches {micro_counts(free)} -> {micro_counts(plan)[0]} each")
    best = float(flops.sum()) / k
    print(f"  (a perfect split would be {best / times['contiguous']:.3f} x contiguous)")
    return check("balancing the tokens shortens the modelled step",
                 times["kk"] < times["contiguous"] and times["lpt"] < times["contiguous"])


def check_plan(plan: DispatchPlan, batch: Batch, config: DispatchConfig) -> bool:
    """What the plan guarantees, checked on this batch."""
    tokens = batch.total_lens.numpy()
    # A single sequence over the budget may fill a micro-batch alone (oversize="own").
    over = [len(mb) > 1 and int(tokens[mb].sum()) > BUDGET
            for s in range(plan.num_shards) for mb in micro_positions(plan, s)]
    return all([
        check("every sample exactly once", sorted(plan.order) == list(range(len(batch)))),
        check("order[inverse[p]] == p (invertible)",
              all(plan.order[i] == p for p, i in enumerate(plan.inverse))),
        check(f"every micro-batch of 2+ sequences within {BUDGET} tokens", not any(over)),
        check("the same micro-batch count on every shard", len(set(micro_counts(plan))) == 1),
        check("deterministic: planning again gives an equal plan",
              make_plan(batch, plan.num_shards, config) == plan),
    ])


def launch_plan() -> PlacementPlan:
    """dp=4 x tp=2: 8 workers, the two TP peers of each DP shard share one bundle."""
    pool = ResourcePool.uniform("cpu", 4, cpus=1)
    role = RoleSpec(role="actor", worker=LogProbWorker, mesh=Mesh.of(dp=4, tp=2), pool="cpu",
                    cpus=0.5, workers_per_bundle=2)
    return plan_placement([pool], [role])


def dispatch_and_restore(group: WorkerGroup, batch: Batch, verbose: bool) -> bool:
    """Plan for the group's DP size, run `LogProbWorker.log_probs`, restore, check."""
    config = DispatchConfig(micro_batch_tokens=BUDGET, same_micro_count=True)
    plan = make_plan(batch, group.mesh.axis_size("dp"), config)
    t0 = time.perf_counter()
    outs = dispatch(group, LogProbWorker.log_probs, plan, batch)
    merged = plan.restore(outs)
    print(f"  {len(batch)} samples over {plan.num_shards} shards, shard sizes "
          f"{np.diff(plan.shard_bounds).tolist()}, dispatched and restored in "
          f"{time.perf_counter() - t0:.2f} s")
    if verbose:
        show_plan(plan)
        ids = batch.sample_ids.tolist()
        print(f"  ids as the workers saw them: {[ids[p] for p in plan.order]}")
        print(f"  ids after plan.restore:      {merged.sample_ids.tolist()}")
    where = torch.tensor([plan.locate(i) for i in batch.sample_ids.tolist()]).reshape(-1, 2)
    return all([
        check("restored sample ids equal the original ids, in order",
              torch.equal(merged.sample_ids, batch.sample_ids)),
        check("every log-prob equals the one computed here on the whole batch",
              torch.allclose(merged.scalars["logprob"], toy_logprobs(batch), rtol=1e-12)),
        check("each sample ran on the dp rank and micro-batch the plan says",
              torch.equal(merged.scalars["dp"], where[:, 0])
              and torch.equal(merged.scalars["micro"], where[:, 1])),
    ])


def run_on_ray(batch: Batch) -> bool:
    """Start Ray, launch the group, dispatch three batch sizes, shut Ray down."""
    import ray

    from avrid.workers import RayBackend, start_ray

    start_ray()
    try:
        t0 = time.perf_counter()
        with RayBackend(call_timeout_s=120).launch(launch_plan()) as cluster:
            group = cluster.group("actor", LogProbWorker)
            print(f"  launched {group.world_size} workers ({group.mesh}) in "
                  f"{time.perf_counter() - t0:.1f} s")
            ok = dispatch_and_restore(group, batch, verbose=False)
            print("  what each rank received (TP peers got the same stored shard):")
            for line in group.call(LogProbWorker.last_shard):
                print("    " + line)
            for n in (10, 3):
                print(f"\n  -- {n} samples over 4 shards: no divisibility rule --")
                ok &= dispatch_and_restore(group, batch.slice(0, n), verbose=True)
            return ok
    finally:
        ray.shutdown()  # stops the raylet and workers this script started, even on error


def main() -> int:
    """Build, balance, plan, model, dispatch. Returns the exit status."""
    start = time.perf_counter()
    print("== 1. a reasoning-RL batch: 64 prompts x 8 responses, long-tailed ==")
    batch = rollout_batch(max_response=4096)
    describe_batch(batch, max_response=4096)

    print(f"\n== 2. balance the tokens over {SHARDS} shards ==")
    parts = balance(batch, SHARDS)
    ok = check("each partition holds every sample exactly once",
               all(sorted(sum(p.shards, ())) == list(range(len(batch)))
                   for p in parts.values()))
    png = plot_shard_costs(parts, OUT_DIR / "shard_costs.png")
    shown = png.relative_to(Path.cwd()) if png.is_relative_to(Path.cwd()) else png
    print(f"  bar chart: {shown}")

    print(f"\n== 3. the plan: Karmarkar-Karp + micro-batches of <= {BUDGET} tokens ==")
    config = DispatchConfig(micro_batch_tokens=BUDGET, same_micro_count=True)
    plan = make_plan(batch, SHARDS, config)
    show_plan(plan)
    sid = int(batch.sample_ids[int(batch.total_lens.argmax())])
    print(f"  the longest sample, id {sid}, is in (shard, micro-batch) {plan.locate(sid)}")
    ok &= check_plan(plan, batch, config)

    print("\n== 4. modelled step time: the slowest shard's FLOPs (7B model) ==")
    ok &= compare_step_times(batch, SHARDS)

    print("\n== 5. dispatch through Ray: dp=4 x tp=2 LogProbWorkers ==")
    ok &= run_on_ray(batch)

    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} in "
          f"{time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
