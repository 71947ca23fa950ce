"""Benchmark — one dispatch-and-merge step: avrid's packed shards against a padded, pickled batch.

What is measured: one single-controller step for one role, from the driver's point of view —
hand a batch of rollouts to 8 CPU workers, let each compute a per-token output, and merge the
answers back into one batch on the driver. Per step, each side reports the driver's wall time
and the bytes it serialises (what goes out to the workers, and what comes back).

The batch (defaults: 4096 sequences, mean length L = 1024 tokens): prompt lengths uniform in
[0.1 L, 0.3 L], response lengths uniform in [0.5 L, 1.1 L], so a sequence is L tokens on
average and at most 1.4 L (padding to the longest costs ~1.4x; real reasoning rollouts are
longer-tailed, so this is gentle on the padded baseline). Four per-token columns over the
whole sequence — "tokens" (int64), "logprobs", "mask" (1 on response tokens), "advantages"
(float32) — and two per-sample scalars, "reward" (float32) and "group" (int64). The batch's own
bytes are the sum of its tensors' nbytes: ids, prompt and response lengths, every packed
column's values and offsets, and the scalars (~84 MB at the defaults).

The work, the same on both sides and deliberately cheap so that orchestration dominates: each
worker computes new log-probs = 0.5 * logprobs - mask for every token of its samples (float32)
and the token-weighted sum of them as a metric.

    avrid     ``run_shards(group, BenchWorker.new_logprobs, batch, DispatchConfig())`` on a
              RayBackend group of 8 single-CPU ranks (dp = 8): make the plan (Karmarkar–Karp
              over token counts), split the packed batch into 8 shards, send each inside its
              rank's call (Ray serialises it once, into the call), gather the 8
              `WorkerResult`s (built with `ResultBuilder`, the output a packed column), and
              merge them — ids checked, original order
              restored, metric reduced.
    padded    the path of a single-controller framework that carries padded batches, modelled
              on verl's ONE_TO_ALL dispatch of a `DataProto`: the batch is held padded to its
              longest sequence, (n, max_len) per column; for each of the 8 workers the driver
              pickles the whole padded batch (verl's ``dispatch_one_to_all`` hands the same
              `DataProto` to every rank, and Ray serialises a call's arguments per call, via
              ``DataProto.__getstate__`` = ``torch.save`` to bytes) and sends the bytes to a
              bare Ray actor; each actor unpickles, takes its contiguous chunk of n / 8 rows,
              computes the same output (padded) and pickles its chunk back; the driver
              unpickles and concatenates (the merged output stays padded, as a `DataProto`
              would).
    chunked   for reference, not judged: the same, but the driver pickles each worker only its
              own padded chunk (verl's DP_COMPUTE_PROTO: ``DataProto.chunk``, then each chunk is
              consolidated and serialised for its own call; newer verl sends most DataProto
              methods this way). It isolates what padding and pickling cost from what sending
              the whole batch 8 times costs.

Fairness: both sides use 8 single-CPU actors, one per bundle of an 8-bundle PACK placement
group, on the same Ray instance; they do the same arithmetic on the same tokens; and the
padded batch is made once, before timing (a padded framework holds its batch padded from
generation on), so padding is *not* charged to the baseline's step — its time is printed
apart. Everything else the driver does is in its step: avrid's planning, splitting, calls,
gathering and merge; the baseline's pickling, sends, gathering, unpickling and concatenation.
Both sides' outputs are checked to agree exactly once, outside the timed steps.

How bytes are counted. avrid: after one extra, untimed step, the step's plan splits the batch
again and each shard's ``total_bytes`` under Ray's own serialisation is added (the same
``SerializationContext.serialize`` that Ray runs on a call's arguments); what comes back is
each `WorkerResult` serialised the same way. The shards are a partition of the batch, so outbound /
batch bytes is ~1.0 plus pickle framing (a few hundred bytes per tensor); the target is
outbound <= 1.01 x the batch's own bytes ("moved once"). Baseline: the lengths of the pickled
payloads the driver makes and of those it receives (Ray stores ``bytes`` arguments as they are,
without pickling them again).

Timing: one step per side per repeat, the order rotated every repeat so no side always runs
first; after one untimed warm-up step per side. Medians are reported, and the speedup is the
median over repeats of each repeat's padded/avrid time ratio (with its min and max). Where the
driver's time goes is printed beside it: for avrid, `run_shards`'s own driver spans (plan;
split = cut the batch into shards; submit = call every rank, Ray serialising each shard;
wait = the workers' run; receive = fetching and deserialising the results; merge = checks,
order restored, metrics); for the baselines, send (pickle and submit),
wait (``ray.get``) and merge (unpickle and concatenate).

Memory: the padded batch is ~1.4 x the packed one (~120 MB at the defaults) and is pickled 8
times per step, ~1 GB through the driver and the object store per baseline step; the driver's
peak RSS is printed (~1.9 GB at the defaults) and with 16 actors alive the whole run stays
within a few GB, so the acceptance size runs as is on a 2-core, 24 GiB machine.

Run: ``python benchmarks/bench_results.py [--repeats 5] [--sequences 4096] [--workers 8]
[--seq-len 1024] [--seed 0]``. It always exits 0: it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import pickle
import resource
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from avrid.dispatch import Batch, DispatchConfig, Packed, Shard, make_plan
from avrid.results import Merged, ResultBuilder, WorkerResult, run_shards
from avrid.workers import (
    Mesh,
    RayBackend,
    ResourcePool,
    RoleSpec,
    Worker,
    plan_placement,
    start_ray,
)

TARGET_SPEEDUP = 2.0
TARGET_BYTES = 1.01  # outbound / batch bytes: moved once, 1% allowed for pickle framing
PACKED_COLUMNS = ("tokens", "logprobs", "mask", "advantages")
MB = 1e6
T = TypeVar("T")


def new_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-token work of both sides: cheap on purpose, so orchestration dominates."""
    return logprobs * 0.5 - mask


# ---------------------------------------------------------------- the batch


def make_batch(n: int, seq_len: int, seed: int) -> Batch:
    """n rollouts of mean length `seq_len` (see the module docstring), packed."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(seq_len // 10, 3 * seq_len // 10 + 1, (n,), generator=g)
    response = torch.randint(seq_len // 2, 11 * seq_len // 10 + 1, (n,), generator=g)
    lens = prompt + response
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    total = int(offsets[-1])
    row = torch.repeat_interleave(torch.arange(n), lens)
    pos = torch.arange(total) - offsets[:-1][row]  # position of each token in its sequence
    mask = (pos >= prompt[row]).to(torch.float32)
    columns = {
        "tokens": torch.randint(0, 32000, (total,), generator=g),
        "logprobs": -5.0 * torch.rand(total, generator=g),
        "mask": mask,
        "advantages": torch.randn(n, generator=g)[row] * mask,
    }
    return Batch(sample_ids=torch.arange(n) + 10_000, prompt_lens=prompt, response_lens=response,
                 packed={k: Packed(values=v, offsets=offsets.clone()) for k, v in columns.items()},
                 scalars={"reward": torch.rand(n, generator=g),
                          "group": torch.arange(n) // 8})


def batch_bytes(batch: Batch) -> int:
    """The batch's own bytes: every tensor it holds, once."""
    tensors = [batch.sample_ids, batch.prompt_lens, batch.response_lens, *batch.scalars.values()]
    for col in batch.packed.values():
        tensors += [col.values, col.offsets]
    return sum(t.nbytes for t in tensors)


def pad(batch: Batch) -> dict[str, torch.Tensor]:
    """The batch as a padded framework holds it: (n, max_len) per column, plus per-sample
    columns (ids and lengths stand in for the attention mask)."""
    lens = batch.total_lens
    valid = torch.arange(int(lens.max())) < lens[:, None]
    out = {"sample_ids": batch.sample_ids, "prompt_lens": batch.prompt_lens,
           "response_lens": batch.response_lens, **batch.scalars}
    for name, col in batch.packed.items():
        padded = torch.zeros(valid.shape, dtype=col.values.dtype)
        padded[valid] = col.values
        out[name] = padded
    return out


# ---------------------------------------------------------------- the two kinds of worker


class BenchWorker(Worker):
    """avrid's worker: takes its shard, returns the canonical result."""

    def new_logprobs(self, shard: Shard) -> WorkerResult:
        """New log-probs for every token of the shard, as a packed column, and their sum."""
        builder = ResultBuilder.for_shard(self.identity, shard)
        with builder.span("compute"):
            cols = shard.batch.packed
            out = new_logprobs(cols["logprobs"].values, cols["mask"].values)
            builder.add(shard.batch.sample_ids,
                        packed={"new_logprobs": Packed(values=out,
                                                       offsets=cols["logprobs"].offsets)})
            builder.metric("new_logprob", out, "mean_tokens")
        return builder.build()


@ray.remote
class PaddedWorker:
    """The baseline's bare actor: pickled padded dicts in, pickled padded dicts out."""

    def ping(self) -> None:
        """Readiness check."""

    def new_logprobs(self, payload: bytes, start: int, stop: int) -> bytes:
        """Unpickle, take rows start..stop-1, compute the same output (padded), pickle it."""
        data = pickle.loads(payload)
        lens = (data["prompt_lens"] + data["response_lens"])[start:stop]
        out = new_logprobs(data["logprobs"][start:stop], data["mask"][start:stop])
        valid = torch.arange(out.shape[1]) < lens[:, None]
        metric = (float(out[valid].to(torch.float64).sum()), int(lens.sum()))
        # .clone(): pickling a view would pickle its whole storage (the full batch).
        return pickle.dumps({"sample_ids": data["sample_ids"][start:stop].clone(),
                             "new_logprobs": out, "metric": metric},
                            protocol=pickle.HIGHEST_PROTOCOL)


def start_padded(n: int) -> tuple[list[Any], Any]:
    """`n` bare actors, one per bundle of an n-bundle PACK placement group (as avrid)."""
    pg = placement_group([{"CPU": 1.0}] * n, strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    actors = [PaddedWorker.options(  # type: ignore[attr-defined]
        num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(n)]
    ray.get([a.ping.remote() for a in actors], timeout=180)
    return actors, pg


# ---------------------------------------------------------------- one step of each side


def avrid_step(group: Any, batch: Batch) -> Merged:
    """Plan, send, gather, merge: all of it is `run_shards`."""
    return run_shards(group, BenchWorker.new_logprobs, batch, DispatchConfig())


def padded_step(actors: list[Any], padded: dict[str, torch.Tensor], chunked: bool,
                phases: dict[str, list[float]] | None = None) -> tuple[dict[str, Any], int, int]:
    """One baseline step; returns the merged (padded) outputs and the bytes sent, received.
    `phases`, if given, gets the seconds of "send" (pickle, call), "wait", "merge"."""
    t0 = time.perf_counter()
    n, k = len(padded["sample_ids"]), len(actors)
    bounds = [n * r // k for r in range(k + 1)]  # contiguous, even chunks (as DataProto.chunk)
    refs, sent = [], 0
    for r, actor in enumerate(actors):
        lo, hi = bounds[r], bounds[r + 1]
        if chunked:  # this rank's rows only, made compact (DataProto's consolidate() copies)
            part, start, stop = {key: v[lo:hi].clone() for key, v in padded.items()}, 0, hi - lo
        else:
            part, start, stop = padded, lo, hi
        payload = pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)  # once per call
        sent += len(payload)
        refs.append(actor.new_logprobs.remote(payload, start, stop))
        del payload, part  # Ray has copied the argument into its object store
    t1 = time.perf_counter()
    answers = ray.get(refs)
    t2 = time.perf_counter()
    received = sum(len(a) for a in answers)
    outs = [pickle.loads(a) for a in answers]
    del answers
    merged = {"sample_ids": torch.cat([o["sample_ids"] for o in outs]),
              "new_logprobs": torch.cat([o["new_logprobs"] for o in outs]),
              "metric": sum(o["metric"][0] for o in outs) / sum(o["metric"][1] for o in outs)}
    if phases is not None:
        for name, sec in (("send", t1 - t0), ("wait", t2 - t1),
                          ("merge", time.perf_counter() - t2)):
            phases.setdefault(name, []).append(sec)
    return merged, sent, received


def avrid_bytes(group: Any, batch: Batch) -> tuple[int, int, Merged]:
    """One untimed avrid step, and the bytes of Ray's serialisation of what it sent (each
    shard of the step's plan, as it goes inside its rank's call) and got back (each
    `WorkerResult`)."""
    context = ray._private.worker.global_worker.get_serialization_context()
    merged = avrid_step(group, batch)
    plan = make_plan(batch, group.world_size, DispatchConfig())  # the step's plan, again
    out = sum(context.serialize(shard).total_bytes for shard in plan.split(batch))
    back = sum(context.serialize(r).total_bytes for r in merged.results)
    return out, back, merged


def check_same(batch: Batch, merged: Merged, base: dict[str, Any]) -> str:
    """Whether avrid's packed output and the baseline's padded one hold the same numbers."""
    lens = batch.total_lens
    valid = torch.arange(base["new_logprobs"].shape[1]) < lens[:, None]
    ok = (torch.equal(merged.batch.sample_ids, batch.sample_ids)
          and torch.equal(base["sample_ids"], batch.sample_ids)
          and torch.equal(merged.batch.packed["new_logprobs"].values,
                          base["new_logprobs"][valid])
          and abs(merged.metrics["new_logprob"].value - base["metric"]) < 1e-6)
    return "yes" if ok else "NO"


# ---------------------------------------------------------------- driver


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(args: argparse.Namespace) -> None:
    """Build the batch, start both sets of actors, time the steps, print the table."""
    n, k = args.sequences, args.workers
    batch = make_batch(n, args.seq_len, args.seed)
    own = batch_bytes(batch)
    pad_s, padded = timed(lambda: pad(batch))
    padded_bytes = sum(t.nbytes for t in padded.values())
    lens = batch.total_lens
    print(f"batch: {n} sequences, tokens mean {lens.float().mean():.0f} / max {int(lens.max())} "
          f"(total {int(lens.sum())}), columns {list(PACKED_COLUMNS)} + scalars "
          f"{list(batch.scalars)}; own bytes {own / MB:.1f} MB, padded {padded_bytes / MB:.1f} "
          f"MB ({padded_bytes / own:.2f}x; padding it took {pad_s * 1e3:.0f} ms, not timed)")

    start_ray(num_cpus=2 * k)  # both sides' actors at once; CPUs are logical slots in Ray
    actors: list[Any] = []
    pg = None
    try:
        placement = plan_placement([ResourcePool.uniform("bench", k)],
                                   [RoleSpec(role="bench", worker=BenchWorker,
                                             mesh=Mesh.of(dp=k), pool="bench")])
        with RayBackend().launch(placement) as cluster:
            group = cluster.group("bench", BenchWorker)
            actors, pg = start_padded(k)
            phases: dict[str, dict[str, list[float]]] = {"avrid": {}, "padded": {},
                                                          "chunked": {}}
            sides: dict[str, Callable[[], Any]] = {
                "avrid": lambda: avrid_step(group, batch),
                "padded": lambda: padded_step(actors, padded, False, phases["padded"]),
                "chunked": lambda: padded_step(actors, padded, True, phases["chunked"]),
            }
            # Bytes, and one warm-up step per side (untimed, phases not kept).
            out_bytes, back_bytes, merged = avrid_bytes(group, batch)
            whole = padded_step(actors, padded, chunked=False)
            chunk = padded_step(actors, padded, chunked=True)
            agree = check_same(batch, merged, whole[0])
            del merged
            sent = {"avrid": (out_bytes, back_bytes), "padded": whole[1:], "chunked": chunk[1:]}
            del whole, chunk

            times: dict[str, list[float]] = {name: [] for name in sides}
            names = list(sides)
            for rep in range(args.repeats):
                shift = rep % len(names)
                for name in names[shift:] + names[:shift]:
                    sec, out = timed(sides[name])
                    times[name].append(sec)
                    if name == "avrid":
                        for span in out.driver_spans:
                            phases["avrid"].setdefault(span.name, []).append(span.duration)
                    del out
        report(args, own, sent, times, phases, agree)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        if pg is not None:
            remove_placement_group(pg)
        ray.shutdown()


def report(args: argparse.Namespace, own: int, sent: dict[str, tuple[int, int]],
           times: dict[str, list[float]], phases: dict[str, dict[str, list[float]]],
           agree: str) -> None:
    """Print the side-by-side table, where each side's driver time goes, and the verdicts."""
    def ratios(base: str) -> list[float]:
        return [b / a for b, a in zip(times[base], times["avrid"], strict=True)]

    print(f"\none step to {args.workers} CPU workers and back: {args.repeats} rotated repeats, "
          f"{os.cpu_count()} cores; driver time median [min-max]; bytes per step")
    print(f"{'side':<9}{'driver ms':>20}{'out MB':>9}{'out/batch':>10}{'back MB':>9}"
          f"{'total MB':>10}   driver phases, median ms")
    for name, (out, back) in sent.items():
        t = times[name]
        ms = f"{statistics.median(t) * 1e3:.0f} [{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}]"
        parts = " ".join(f"{k} {statistics.median(v) * 1e3:.0f}"
                         for k, v in phases[name].items())
        print(f"{name:<9}{ms:>20}{out / MB:>9.1f}{out / own:>9.2f}x{back / MB:>9.1f}"
              f"{(out + back) / MB:>10.1f}   {parts}")
    print(f"outputs identical (avrid packed vs padded: values, order, metric): {agree}")
    print(f"driver peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
    chunk, speed = ratios("chunked"), ratios("padded")
    ratio, sp = sent["avrid"][0] / own, statistics.median(speed)
    print(f"\nchunked/avrid (reference, not judged) = {statistics.median(chunk):.2f}x "
          f"[{min(chunk):.2f}-{max(chunk):.2f}]")
    print(f"avrid outbound bytes / batch bytes = {ratio:.4f}x (target <= {TARGET_BYTES}x, "
          f"moved once): {'PASS' if ratio <= TARGET_BYTES else 'FAIL'}")
    print(f"speedup padded/avrid = {sp:.2f}x [{min(speed):.2f}-{max(speed):.2f}] "
          f"(target >= {TARGET_SPEEDUP:g}x): {'PASS' if sp >= TARGET_SPEEDUP else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per side (5)")
    parser.add_argument("--sequences", type=int, default=4096, help="batch size (4096)")
    parser.add_argument("--workers", type=int, default=8, help="CPU workers per side (8)")
    parser.add_argument("--seq-len", type=int, default=1024, help="mean tokens per sequence")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch")
    args = parser.parse_args()
    try:
        run(args)
    except Exception:  # a benchmark reports, it does not fail the caller
        traceback.print_exc()


if __name__ == "__main__":
    main()
