"""Chapter 4 demo — resharding: a small decoder's FSDP shards on 4 workers become the
tensor-parallel slices of a tp=2 rollout engine, with the minimum bytes, checked bit for bit.

Run it with ``python -m chapters.ch04_resharding`` (CPU only, well under a minute). It reads
top to bottom:

1. the model and its two layouts: FSDP dim-0 shards over 4 ranks, vLLM's TP layout over 2;
2. the plan (pure, no Ray): bytes moved = the lower bound, next to local copies and the
   all-gather baseline, a source x target byte matrix and the first transfers;
3. Ray, 4 processes over gloo, colocated (TP rank t shares process t with FSDP rank t): the
   planned transfer and the all-gather baseline, both landing the same bits in each
   process's torch engine; the fingerprints of both sides agree;
4. the same sync with one element of one engine tensor corrupted on purpose: the fingerprint
   check raises `StaleWeightsError`, naming the tensor;
5. disaggregated: 2 training processes, 2 rollout processes, nothing local.

It exits 0 when every check passes and 1 otherwise. It uses `avrid.workers` and
`avrid.reshard` and the example worker in ``workers.py``; it defines no library code.
"""

from __future__ import annotations

import time

from avrid.reshard import (
    ModelLayout,
    StaleWeightsError,
    TransferPlan,
    check_same,
    combine,
    decoder_tp_layout,
    fingerprint,
    plan_transfer,
)
from avrid.workers import Mesh, ResourcePool, RoleSpec, WorkerGroup, plan_placement
from chapters.ch04_resharding.workers import (
    SyncReport,
    SyncWorker,
    decoder_shapes,
    full_weights,
)

SEED = 0  # every process makes the same "trained" weights from it
FSDP, TP = 4, 2
BUCKET = 256 * 1024  # bytes per bucket: the most temporary buffer memory a sync adds
STALE = "model.layers.0.mlp.up_proj.weight"


def check(label: str, ok: bool) -> bool:
    """Print one verified claim; the demo's exit status is the AND of all of them."""
    print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    return ok


def brief(text: str, keep: tuple[str, ...] = ("layers.0.", "embed", "lm_head")) -> str:
    """A layout table cut to the embeddings, the head and layer 0 (the rest repeat)."""
    lines = text.splitlines()
    body = [ln for ln in lines[2:-1] if any(k in ln.split(" ")[0] for k in keep)]
    skipped = len(lines) - 3 - len(body)
    return "\n".join(["  " + ln for ln in lines[:2] + body]
                     + [f"  ... {skipped} more params (layers 1+, final norm)", "  " + lines[-1]])


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def show_plan(plan: TransferPlan) -> None:
    """The plan's own description, then the comparison the video is about."""
    for line in plan.describe(max_rows=6).splitlines():
        print("  " + line)
    need = sum(p.bytes_on(t) for _, p in plan.target.params for t in range(plan.target_world))
    print(f"  the target ranks need {mib(need)}: {mib(plan.bytes_local)} already in their "
          f"process,\n  {mib(plan.bytes_moved)} moved (= the lower bound, "
          f"{mib(plan.lower_bound)});")
    print(f"  all-gather-then-slice sends {mib(plan.bytes_naive)}: "
          f"{plan.bytes_naive / max(plan.bytes_moved, 1):.1f}x the planned bytes")


def launch(world: int):  # noqa: ANN201 (a Cluster context manager)
    """`world` one-process workers for the sync, on 4 half-CPU bundles."""
    from avrid.workers import RayBackend

    placement = plan_placement(
        [ResourcePool.uniform("cpu", world, cpus=0.5)],
        [RoleSpec(role="sync", worker=SyncWorker, mesh=Mesh.of(dp=world), pool="cpu",
                  cpus=0.5)])
    return RayBackend(call_timeout_s=120).launch(placement)


def compare(reports: list[SyncReport], expected: dict[str, int]) -> bool:
    """The fingerprint check: trainer side == engine side == the driver's full weights."""
    trained = combine(r.source_sums for r in reports)
    served = combine(r.target_sums for r in reports)
    ok = check("the FSDP shards add up to the full weights' fingerprint", trained == expected)
    try:
        check_same(trained, served)
    except StaleWeightsError as exc:
        print(f"    StaleWeightsError: {exc}")
        return check("fingerprint check passed", False)
    print(f"  fingerprint check passed: {len(served)} tensors, e.g. "
          f"{STALE} = {served[STALE]:#018x}")
    return ok


def show_reports(reports: list[SyncReport]) -> None:
    print(f"  {'process':<8} {'fsdp rank':>9} {'tp rank':>7} {'engine holds':>13} "
          f"{'planned':>9} {'all-gather':>10}")
    for r in reports:
        naive = "-" if r.naive_seconds is None else f"{r.naive_seconds * 1e3:.0f} ms"
        print(f"  {r.process:<8} {str(r.source_rank):>9} {str(r.target_rank):>7} "
              f"{mib(r.engine_bytes):>13} {r.seconds * 1e3:>6.0f} ms {naive:>10}")


def colocated(group: WorkerGroup, plan: TransferPlan, expected: dict[str, int]) -> bool:
    """Section 3: the planned sync and the baseline on 4 processes."""
    reports = group.call(SyncWorker.sync, plan, SEED, naive=True)
    show_reports(reports)
    ok = check("every engine rank holds its TP slices after the planned sync",
               sorted(r.target_rank for r in reports if r.target_rank is not None)
               == list(range(TP)))
    ok &= check("the all-gather baseline lands exactly the same bits",
                all(r.naive_same for r in reports if r.target_rank is not None))
    return compare(reports, expected) and ok


def stale(group: WorkerGroup, plan: TransferPlan) -> bool:
    """Section 4: one flipped element on TP rank 1, caught by the fingerprint check."""
    reports = group.call(SyncWorker.sync, plan, SEED, corrupt=(1, STALE))
    try:
        check_same(combine(r.source_sums for r in reports),
                   combine(r.target_sums for r in reports), where="rollout engine (tp=2)")
    except StaleWeightsError as exc:
        print(f"  StaleWeightsError: {exc}")
        return check("the corrupted element is caught, and the tensor named",
                     STALE in str(exc) and "differ" in str(exc))
    return check("the corrupted element is caught (it was not)", False)


def main() -> int:
    """Layouts, plan, colocated sync, stale weights, disaggregated sync."""
    start = time.perf_counter()
    shapes = decoder_shapes()
    expected = dict(fingerprint(full_weights(shapes, SEED)).checksums)
    source, target = ModelLayout.fsdp(shapes, FSDP), decoder_tp_layout(shapes, TP)
    print(f"== 1. a {len(shapes)}-tensor decoder, trained FSDP over {FSDP}, served tp={TP} ==")
    print(brief(source.describe()))
    print()
    print(brief(target.describe()))

    print("\n== 2. the plan, colocated: tp rank t lives in fsdp rank t's process ==")
    plan = plan_transfer(source, target, same_process={0: 0, 1: 1}, bucket_bytes=BUCKET)
    show_plan(plan)
    ok = check("bytes moved equal the lower bound", plan.bytes_moved == plan.lower_bound)
    ok &= check("the plan moves less than the all-gather baseline",
                plan.bytes_moved < plan.bytes_naive)

    import ray

    from avrid.workers import start_ray

    start_ray()
    try:
        t0 = time.perf_counter()
        with launch(FSDP) as cluster:
            group = cluster.group("sync", SyncWorker)
            print(f"\n== 3. Ray: {group.world_size} processes over gloo (launched in "
                  f"{time.perf_counter() - t0:.1f} s) ==")
            ok &= colocated(group, plan, expected)

            print("\n== 4. a stale weight on purpose: tp rank 1 flips one element ==")
            ok &= stale(group, plan)

            print("\n== 5. disaggregated: fsdp=2 trainers, tp=2 rollout processes ==")
            split = plan_transfer(ModelLayout.fsdp(shapes, 2), target, bucket_bytes=BUCKET)
            show_plan(split)
            ok &= check("bytes moved equal the lower bound, nothing local",
                        split.bytes_moved == split.lower_bound and split.bytes_local == 0)
            reports = group.call(SyncWorker.sync, split, SEED)
            show_reports(reports)
            ok &= compare(reports, expected)
    finally:
        ray.shutdown()  # stops the raylet and workers this script started, even on error
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} in "
          f"{time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
