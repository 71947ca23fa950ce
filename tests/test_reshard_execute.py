"""Resharding over gloo across Ray workers: every target rank ends bit-identical to its slice
of the full weights (planned and naive paths), colocated and disaggregated, and the
fingerprint check catches a corrupted tensor."""

from __future__ import annotations

import pytest
import torch

from avrid.reshard.executor import ProcessMap, slice_checksums
from avrid.reshard.fingerprint import StaleWeightsError, check_same, combine
from avrid.reshard.layout import ModelLayout
from avrid.reshard.planner import plan_transfer
from avrid.reshard.tp_layout import decoder_tp_layout
from avrid.workers import Mesh, ResourcePool, RoleSpec, plan_placement
from tests.helpers import ReshardWorker

pytestmark = [pytest.mark.chapter(4), pytest.mark.usefixtures("ray_cluster")]


def decoder_shapes(layers: int = 2, hidden: int = 16, inter: int = 24,
                   vocab: int = 128) -> dict[str, tuple[tuple[int, ...], str]]:
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((vocab, hidden), "float32")}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": ((hidden, hidden), "float32"),
            f"{p}.self_attn.q_proj.bias": ((hidden,), "float32"),
            f"{p}.self_attn.k_proj.weight": ((8, hidden), "bfloat16"),
            f"{p}.self_attn.v_proj.weight": ((8, hidden), "float32"),
            f"{p}.self_attn.o_proj.weight": ((hidden, hidden), "float32"),
            f"{p}.mlp.gate_proj.weight": ((inter, hidden), "float32"),
            f"{p}.mlp.up_proj.weight": ((inter, hidden), "float32"),
            f"{p}.mlp.down_proj.weight": ((hidden, inter), "float32"),
            f"{p}.input_layernorm.weight": ((hidden,), "float32"),
        })
    shapes["lm_head.weight"] = ((vocab, hidden), "float32")
    return shapes


def full_weights(shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen).to(getattr(torch, dtype))
            for name, (shape, dtype) in shapes.items()}


def run(plan, full: dict, naive: bool = False) -> list[tuple]:  # noqa: ANN001
    from avrid.workers import RayBackend

    world = ProcessMap.for_plan(plan).world_size
    placement = plan_placement([ResourcePool.uniform("cpu", world, cpus=0.5)],
                               [RoleSpec(role="sync", worker=ReshardWorker,
                                         mesh=Mesh.of(dp=world), pool="cpu", cpus=0.5)])
    with RayBackend().launch(placement) as cluster:
        return cluster.group("sync", ReshardWorker).call(ReshardWorker.reshard, plan, full,
                                                         naive=naive)


@pytest.mark.parametrize(("dp", "tp", "colocated"), [
    (4, 2, True), (2, 4, True), (3, 2, True), (2, 2, False)])
def test_targets_are_bit_identical_to_the_full_weights(dp: int, tp: int,
                                                       colocated: bool) -> None:
    shapes = decoder_shapes()
    full = full_weights(shapes)
    same = {t: t for t in range(min(dp, tp))} if colocated else {}
    plan = plan_transfer(ModelLayout.fsdp(shapes, dp), decoder_tp_layout(shapes, tp),
                         same_process=same, bucket_bytes=4096)
    assert plan.bytes_moved == plan.lower_bound
    for naive in (False, True):
        outs = run(plan, full, naive=naive)
        seen = set()
        for dst, out, *_ in outs:
            if dst is None:
                continue
            seen.add(dst)
            for name, p in plan.target.params:
                region = p.regions[dst]
                if region is not None:
                    assert torch.equal(out[name], full[name][region.to_slices()]), (name, dst)
        assert seen == set(range(tp))
        if not naive:
            # The fingerprints of both sides add up to the same whole-tensor checksums.
            expected = combine(o[2] for o in outs)
            check_same(expected, combine(o[3] for o in outs))
            # and slice by slice, replicas included
            check_same(combine(o[4] for o in outs),
                       combine(slice_checksums(plan.target, o[0], o[1]) for o in outs))


def test_fingerprint_check_catches_a_corrupted_tensor() -> None:
    from avrid.reshard.executor import layout_checksums

    shapes = decoder_shapes(layers=1)
    full = full_weights(shapes, seed=3)
    plan = plan_transfer(ModelLayout.fsdp(shapes, 2), decoder_tp_layout(shapes, 2),
                         same_process={0: 0, 1: 1}, bucket_bytes=2048)
    outs = run(plan, full)
    expected = combine(o[2] for o in outs)
    dst, out, *_ = next(o for o in outs if o[0] == 1)
    name = "model.layers.0.mlp.up_proj.weight"
    out[name].view(-1)[5] += 1.0  # one element of one slice on one rank goes stale
    actual = combine([layout_checksums(plan.target, dst, out)]
                     + [o[3] for o in outs if o[0] != 1])
    with pytest.raises(StaleWeightsError, match=r"differ: \['model.layers.0.mlp.up_proj"):
        check_same(expected, actual)
    # A stale *replica* (the norm copy on TP rank 1) escapes the whole-tensor sums, which count
    # each replicated element once, but not the slice-by-slice check, which also names the rank.
    out[name].copy_(full[name][plan.target[name].regions[1].to_slices()])  # mend it
    norm = "model.layers.0.input_layernorm.weight"
    out[norm].view(-1)[0] += 1.0
    check_same(expected, combine([layout_checksums(plan.target, dst, out)]
                                 + [o[3] for o in outs if o[0] != 1]))  # the gap: passes
    with pytest.raises(StaleWeightsError, match=r"differ: \['model.layers.0.input_layernorm"
                                                r".weight@t1'\]"):
        check_same(combine(o[4] for o in outs),
                   combine(slice_checksums(plan.target, o[0], o[1]) for o in outs))


def test_post_sends_returns_before_delivery_and_delivers_the_snapshot() -> None:
    """A sender-only process (chapter 6's trainer) posts every bucket's sends at once and
    returns; the receivers, running `execute` bucket by bucket, get exactly what was posted,
    even though the sender overwrites its live weights before anyone has received."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from avrid.reshard.executor import execute, post_sends
    from avrid.workers.outcome import free_port

    shapes = decoder_shapes(layers=1)
    full = full_weights(shapes, seed=5)
    senders, receivers = 2, 2
    target = ModelLayout.fsdp(shapes, 1)  # each receiver: every tensor whole (replicated)
    target = ModelLayout(world_size=receivers, params=tuple(
        (name, type(p).replicated(p.shape, p.dtype, receivers)) for name, p in target.params))
    plan = plan_transfer(ModelLayout.fsdp(shapes, senders), target, same_process={},
                         bucket_bytes=1024)
    assert len(plan.buckets) > 1  # several buckets, all posted at once by each sender
    port, world = free_port(), senders + receivers
    got: dict[int, dict] = {}
    errors: list[BaseException] = []
    posted = threading.Barrier(world)  # receivers start only once every sender has returned

    def member(rank: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                                  timeout=timedelta(seconds=30))
            group = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=30))
            if rank < senders:
                live = {name: full[name][p.regions[rank].to_slices()].clone()
                        for name, p in plan.source.params if p.regions[rank] is not None}
                snapshot = {name: t.clone() for name, t in live.items()}
                works = post_sends(plan, rank, snapshot, group)
                posted.wait(timeout=30)  # returned while the receivers still wait for us
                for t in live.values():
                    t.add_(1.0)  # the optimizer steps: the snapshot is what travels
                for work in works:
                    work.wait()
            else:
                posted.wait(timeout=30)
                got[rank - senders] = execute(plan, rank, {}, group=group)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sorted(got) == list(range(receivers))
    for out in got.values():
        for name, tensor in full.items():
            assert torch.equal(out[name], tensor), name


def test_post_sends_refuses_a_process_that_also_receives() -> None:
    from avrid.reshard.executor import post_sends

    shapes = decoder_shapes(layers=1)
    plan = plan_transfer(ModelLayout.fsdp(shapes, 2), decoder_tp_layout(shapes, 2),
                         same_process={0: 0, 1: 1}, bucket_bytes=2048)
    with pytest.raises(ValueError, match="must play a source rank and no target rank"):
        post_sends(plan, 0, {}, group=None)  # type: ignore[arg-type]
