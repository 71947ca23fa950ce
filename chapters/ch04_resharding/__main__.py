"""Chapter 4 demo — resharding: a small decoder's FSDP shards on 4 workers become the
tensor-parallel slices of a tp=2 rollout engine, with the minimum bytes, checked bit for bit.

Run it with ``python -m chapters.ch04_resharding`` (CPU only, well under a minute). It reads
top to bottom:

1. the model and its two layouts: FSDP dim-0 shards over 4 ranks, vLLM's TP layout over 2;
2. the plan (pure, no Ray): bytes moved = the lower bound, next to local copies and the
   all-gather baseline, a source x target byte matrix and the first transfers; a picture of
   it, ``outputs/ch04/transfer.png`` (who sends which slice of o_proj to whom, and bytes per
   rank pair next to the all-gather's), made by ``figure.py``;
3. Ray, 4 processes over gloo, colocated (TP rank t shares process t with FSDP rank t): the
   planned transfer and the all-gather baseline, both landing the same bits in each
   process's torch engine; the fingerprints of both sides agree;
4. the same sync with one element of one engine tensor corrupted on purpose: the fingerprint
   check raises `StaleWeightsError`, naming the tensor;
5. disaggregated: 2 training processes, 2 rollout processes, nothing local (its picture:
   ``outputs/ch04/transfer_disaggregated.png``).

It exits 0 when every check passes and 1 otherwise. It uses `avrid.workers` and
`avrid.reshard`, `avrid.results`' file writer, the example worker in ``workers.py`` and the
drawing in ``figure.py``; it defines no library code.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path

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
from chapters.ch04_resharding.figure import default_param, save_transfer_figure
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
KEEP = ("layers.0.", "embed", "lm_head")  # the layout rows shown: the other layers repeat
# outputs/ is git-ignored; anchored at the checkout so `avrid demo ch04` works from anywhere.
OUT_DIR = Path(__file__).resolve().parents[2] / "outputs" / "ch04"


def check(label: str, ok: bool) -> bool:
    """Print one verified claim; the demo's exit status is the AND of all of them."""
    print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    return ok


def shown(path: Path) -> Path:
    """`path` relative to the working directory when it lies below it."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def table(header: list[str], rows: list[list[str]], right: Collection[int] = ()) -> str:
    """Columns as wide as their widest cell, for every row; `right` = right-aligned columns."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                      for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     .rstrip() for r in [header, *rows])


def layout_table(layout: ModelLayout) -> str:
    """A layout, cut to the embeddings, the head and layer 0 (the rest repeat); one column
    per rank, ``-`` where a rank holds nothing."""
    w = layout.world_size
    rows = [[n, str(p.shape), p.dtype, p.kind, *("-" if r is None else str(r)
                                                for r in p.regions)]
            for n, p in layout.params if any(k in n for k in KEEP)]
    total = sum(p.nbytes for _, p in layout.params)
    head = ["param", "shape", "dtype", "kind", *(f"rank {r}" for r in range(w))]
    return "\n".join([f"  {len(layout.params)} params over {w} ranks, {total:,} bytes",
                      table(head, rows),
                      f"  ... {len(layout.params) - len(rows)} more params (layers 1+, "
                      f"final norm)",
                      "  bytes per rank: " + ", ".join(f"{layout.bytes_on(r):,}"
                                                       for r in range(w))])


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
    """One row per process; ``-`` where it holds no rank of a role or ran no baseline."""
    def cell(x: object) -> str:
        return "-" if x is None else str(x)

    rows = [[str(r.process), cell(r.source_rank), cell(r.target_rank), mib(r.engine_bytes),
             f"{r.seconds * 1e3:.0f} ms",
             "-" if r.naive_seconds is None else f"{r.naive_seconds * 1e3:.0f} ms"]
            for r in reports]
    print(table(["process", "fsdp rank", "tp rank", "engine holds", "planned", "all-gather"],
                rows, right={1, 2, 3, 4, 5}))


def draw(plan: TransferPlan, name: str) -> None:
    """Save the plan's picture under OUT_DIR and say where."""
    path = save_transfer_figure(plan, OUT_DIR / name)
    print(f"  picture: {shown(path)} (who sends which slice of {default_param(plan)}, "
          f"bytes per rank pair)")


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
    print(f"  trainer, FSDP over {FSDP}:")
    print(layout_table(source))
    print(f"\n  rollout engine, tp={TP} (vLLM's layout):")
    print(layout_table(target))

    print("\n== 2. the plan, colocated: tp rank t lives in fsdp rank t's process ==")
    plan = plan_transfer(source, target, same_process={0: 0, 1: 1}, bucket_bytes=BUCKET)
    show_plan(plan)
    draw(plan, "transfer.png")
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
            draw(split, "transfer_disaggregated.png")
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
