"""Resharding layouts and the transfer planner: the layouts FSDP2 and vLLM really use, the
planner's exactness (bytes moved == lower bound, every needed element exactly once) over random
shapes, layouts, colocations and bucket sizes, and the errors for bad input."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from avrid.reshard.layout import (
    LayoutError,
    ModelLayout,
    ParamLayout,
    Region,
    dtype_name,
    dtype_size,
)
from avrid.reshard.planner import TransferPlan, plan_transfer
from avrid.reshard.tp_layout import decoder_tp_layout

pytestmark = pytest.mark.chapter(4)


def rows(layout: ParamLayout) -> list[tuple[int, int] | None]:
    """Each rank's dim-0 range (None for a rank holding nothing)."""
    return [None if r is None else r.bounds[0] for r in layout.regions]


# ---------------------------------------------------------------- regions and layouts


def test_region_arithmetic() -> None:
    a = Region(bounds=((0, 4), (0, 6)))
    b = Region(bounds=((2, 8), (3, 9)))
    assert a.intersect(b) == Region(bounds=((2, 4), (3, 6)))
    assert a.intersect(Region(bounds=((4, 8), (0, 6)))) is None  # touching is not sharing
    parts = a.subtract(b)
    assert sum(p.numel for p in parts) == a.numel - 6 and len(parts) <= 2 * a.ndim
    assert Region(bounds=((2, 4), (3, 6))).relative_to(b) == Region(bounds=((0, 2), (0, 3)))
    t = torch.arange(48).reshape(6, 8)
    assert t[Region(bounds=((1, 3), (2, 5))).to_slices()].tolist() == t[1:3, 2:5].tolist()
    assert Region(bounds=((3, 3), (0, 2))).is_empty and Region(bounds=()).numel == 1
    with pytest.raises(LayoutError, match="is not inside"):
        a.relative_to(b)
    with pytest.raises(LayoutError, match="0 <= start <= stop"):
        Region(bounds=((3, 1),))


def test_fsdp_follows_torch_chunk() -> None:
    assert rows(ParamLayout.fsdp((33, 8), "float32", 2)) == [(0, 17), (17, 33)]
    assert rows(ParamLayout.fsdp((5,), "float32", 4)) == [(0, 2), (2, 4), (4, 5), None]
    for d0 in range(0, 30):
        for world in range(1, 9):
            sizes = [len(c) for c in torch.chunk(torch.empty(d0), world)] if d0 else []
            got = [hi - lo for lo, hi in filter(None, rows(ParamLayout.fsdp((d0,), "int8",
                                                                             world)))]
            assert got == sizes, (d0, world)


def test_tensor_parallel_splits_and_replication() -> None:
    col = ParamLayout.split((8, 6), "bfloat16", 2, 0)
    row = ParamLayout.split((8, 6), "bfloat16", 3, 1)
    assert [str(r) for r in col.regions] == ["[0:4, 0:6]", "[4:8, 0:6]"]
    assert [str(r) for r in row.regions] == ["[0:8, 0:2]", "[0:8, 2:4]", "[0:8, 4:6]"]
    assert col.kind == "column" and row.kind == "row" and col.bytes_on(1) == 4 * 6 * 2
    rep = ParamLayout.replicated((8,), torch.float16, 3)
    assert rep.dtype == "float16" and rep.allow_overlap and rep.bytes_on(2) == 16
    with pytest.raises(LayoutError, match=r"'w'.*dim 1 \(size 6\) divisible by 4"):
        ParamLayout.split((8, 6), "float32", 4, 1, name="w")


def qwen2_shapes(vocab: int = 128, layers: int = 2, hidden: int = 64, inter: int = 128,
                 kv: int = 32, dtype: str = "bfloat16") -> dict[str, tuple[tuple, str]]:
    """Parameter shapes of a small Qwen2-like decoder (q/k/v biases, untied lm_head)."""
    s: dict[str, tuple[tuple, str]] = {"model.embed_tokens.weight": ((vocab, hidden), dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj.weight", (hidden, hidden)),
                            ("self_attn.q_proj.bias", (hidden,)),
                            ("self_attn.k_proj.weight", (kv, hidden)),
                            ("self_attn.k_proj.bias", (kv,)),
                            ("self_attn.v_proj.weight", (kv, hidden)),
                            ("self_attn.v_proj.bias", (kv,)),
                            ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.gate_proj.weight", (inter, hidden)),
                            ("mlp.up_proj.weight", (inter, hidden)),
                            ("mlp.down_proj.weight", (hidden, inter)),
                            ("input_layernorm.weight", (hidden,)),
                            ("post_attention_layernorm.weight", (hidden,))]:
            s[p + name] = (shape, dtype)
    s["model.norm.weight"] = ((hidden,), dtype)
    s["lm_head.weight"] = ((vocab, hidden), dtype)
    return s


def test_decoder_tp_layout_shards_like_vllm() -> None:
    m = decoder_tp_layout(qwen2_shapes(), tp=2)
    kinds = {n: m[n].kind for n in m.names}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "column"
    assert kinds["model.layers.0.self_attn.k_proj.bias"] == "column"
    assert kinds["model.layers.1.mlp.up_proj.weight"] == "column"
    assert kinds["model.layers.0.self_attn.o_proj.weight"] == "row"
    assert kinds["model.layers.1.mlp.down_proj.weight"] == "row"
    assert kinds["model.layers.0.input_layernorm.weight"] == "replicated"
    assert kinds["model.norm.weight"] == "replicated"
    assert kinds["model.embed_tokens.weight"] == kinds["lm_head.weight"] == "vocab"
    assert [str(r) for r in m["lm_head.weight"].regions] == ["[0:64, 0:64]", "[64:128, 0:64]"]
    assert [str(r) for r in m["model.layers.1.mlp.down_proj.weight"].regions] == [
        "[0:64, 0:64]", "[0:64, 64:128]"]
    assert m.bytes_on(0) == m.bytes_on(1)
    assert "model.norm.weight" in m.describe()


def test_vocab_is_padded_to_64_then_split_as_vllm_does() -> None:
    m = decoder_tp_layout({"lm_head.weight": ((100, 8), "float32")}, tp=2)
    assert rows(m["lm_head.weight"]) == [(0, 64), (64, 100)]
    m = decoder_tp_layout({"model.embed_tokens.weight": ((100, 8), "float32")}, tp=4)
    assert rows(m["model.embed_tokens.weight"]) == [(0, 32), (32, 64), (64, 96), (96, 100)]


def test_grouped_query_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    # 2 kv heads of 16 over tp=4: ranks 0,1 hold head 0 and ranks 2,3 head 1 (vLLM's rule).
    shapes = {"l.self_attn.k_proj.weight": ((32, 64), "float32"),
              "l.self_attn.q_proj.weight": ((64, 64), "float32")}
    m = decoder_tp_layout(shapes, tp=4, head_dim=16)
    assert rows(m["l.self_attn.k_proj.weight"]) == [(0, 16), (0, 16), (16, 32), (16, 32)]
    assert rows(m["l.self_attn.q_proj.weight"]) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    with pytest.raises(LayoutError, match="heads divisible by tp=8"):
        decoder_tp_layout(shapes, tp=8, head_dim=16)


def test_decoder_tp_layout_names_unknown_parameters() -> None:
    shapes = {**qwen2_shapes(), "model.rotary.scale": ((4,), "float32"),
              "model.layers.0.mlp.experts.weight": ((4, 4), "float32")}
    with pytest.raises(LayoutError, match=r"model\.rotary\.scale.*experts\.weight.*default="):
        decoder_tp_layout(shapes, tp=2)
    m = decoder_tp_layout(shapes, tp=2, default="replicated")
    assert m["model.rotary.scale"].kind == "replicated"
    with pytest.raises(LayoutError, match=r"embed_tokens.weight': vLLM pads the vocab \(128\) "
                                          r"to 128, which 3 ranks cannot split evenly"):
        decoder_tp_layout(qwen2_shapes(), tp=3)
    with pytest.raises(LayoutError, match=r"'l.mlp.up_proj.weight'.*dim 0 \(size 128\) divis"):
        decoder_tp_layout({"l.mlp.up_proj.weight": ((128, 64), "float32")}, tp=3)


def test_model_layout_fsdp_and_dtypes() -> None:
    m = ModelLayout.fsdp({"w": ((33, 8), torch.bfloat16), "b": ((5,), "float32")}, 4)
    assert m["w"].dtype == "bfloat16" and rows(m["b"]) == [(0, 2), (2, 4), (4, 5), None]
    assert sum(m.bytes_on(r) for r in range(4)) == 33 * 8 * 2 + 5 * 4
    assert dtype_name(torch.float) == "float32" and dtype_name("half") == "float16"
    assert dtype_size("complex64") == 8
    with pytest.raises(LayoutError, match="unknown dtype 'floaty'"):
        ParamLayout.replicated((2,), "floaty", 1)
    with pytest.raises(KeyError, match="no parameter 'x'"):
        m["x"]


# ---------------------------------------------------------------- concrete plans


def test_fsdp_to_tp_disaggregated_and_colocated() -> None:
    shapes = {"model.layers.0.mlp.down_proj.weight": ((4, 6), "float32")}
    src = ModelLayout.fsdp(shapes, 2)  # rows 0:2 | 2:4
    dst = decoder_tp_layout(shapes, 2)  # cols 0:3 | 3:6
    apart = plan_transfer(src, dst, bucket_bytes=1 << 20)
    assert apart.bytes_moved == apart.lower_bound == 4 * 6 * 4 and apart.bytes_local == 0
    assert len(apart.transfers) == 4 and len(apart.buckets) == 1
    together = plan_transfer(src, dst, same_process={0: 0, 1: 1}, bucket_bytes=1 << 20)
    # Each target keeps the quarter its own trainer rank holds and receives the other one.
    assert together.bytes_moved == together.lower_bound == 2 * 2 * 3 * 4
    assert together.bytes_local == 2 * 2 * 3 * 4
    assert {(t.src_rank, t.dst_rank) for t in together.transfers} == {(1, 0), (0, 1)}
    assert apart.bytes_naive == 2 * 4 * 6 * 4


def test_same_layout_colocated_moves_nothing() -> None:
    m = ModelLayout.fsdp(qwen2_shapes(), 3)
    plan = plan_transfer(m, m, same_process={0: 0, 1: 1, 2: 2}, bucket_bytes=64)
    assert plan.bytes_moved == plan.lower_bound == 0 and plan.buckets == ()
    assert plan.bytes_local == sum(p.nbytes for _, p in m.params)


def test_replicated_source_spreads_the_load() -> None:
    shapes = {f"w{i}": ((8, 8), "float32") for i in range(4)}
    src = ModelLayout(world_size=4, params={n: ParamLayout.replicated(s, d, 4)
                                            for n, (s, d) in shapes.items()})
    plan = plan_transfer(src, ModelLayout.fsdp(shapes, 2), bucket_bytes=1 << 20)
    sent = [sum(plan.bytes_between(s, t) for t in range(2)) for s in range(4)]
    assert plan.bytes_moved == plan.lower_bound and sent == [sent[0]] * 4


def test_oversized_transfers_are_cut_to_fit_buckets() -> None:
    shapes = {"w": ((10, 7), "float32")}
    plan = plan_transfer(ModelLayout.fsdp(shapes, 1), ModelLayout.fsdp(shapes, 1),
                         bucket_bytes=12)  # 3 floats: a 7-float row is cut along dim 1
    assert plan.bytes_moved == 10 * 7 * 4
    assert all(b.nbytes <= 12 for b in plan.buckets)
    assert max(t.region.shape[0] for t in plan.transfers) == 1


def test_describe_shows_the_totals() -> None:
    shapes = qwen2_shapes()
    plan = plan_transfer(ModelLayout.fsdp(shapes, 4), decoder_tp_layout(shapes, 2),
                         same_process={0: 0, 1: 1}, bucket_bytes=4096)
    text = plan.describe(max_rows=5)
    for total in (plan.bytes_moved, plan.lower_bound, plan.bytes_local, plan.bytes_naive):
        assert str(total) in text
    assert f"{len(plan.buckets)} buckets" in text and "more transfers" in text


# ---------------------------------------------------------------- properties

DTYPES = ["float32", "bfloat16", "float16", "int8", "float64"]


@st.composite
def param_layouts(draw: st.DrawFn, shape: tuple[int, ...], dtype: str,
                  world: int) -> ParamLayout:
    """FSDP, a TP split on a divisible dim, replication, or TP repeated over DP ranks."""
    kind = draw(st.sampled_from(["fsdp", "split", "replicated", "tp_x_dp"]))
    if kind == "fsdp":
        return ParamLayout.fsdp(shape, dtype, world)
    if kind == "replicated":
        return ParamLayout.replicated(shape, dtype, world)
    tps = [t for t in range(1, world + 1) if world % t == 0] if kind == "tp_x_dp" else [world]
    tp = draw(st.sampled_from(tps))
    dims = [d for d, n in enumerate(shape) if n % tp == 0]
    if not dims:
        return ParamLayout.fsdp(shape, dtype, world)
    split = ParamLayout.split(shape, dtype, tp, draw(st.sampled_from(dims)))
    if kind == "split":
        return split
    # vLLM's dp x tp: rank = dp * tp + tp_rank, each dp replica holding the same tp shards.
    return ParamLayout(shape=shape, dtype=dtype, regions=split.regions * (world // tp),
                       allow_overlap=True)


@st.composite
def model_layouts(draw: st.DrawFn, shapes: dict[str, tuple[tuple[int, ...], str]],
                  world: int) -> ModelLayout:
    return ModelLayout(world_size=world, params={
        n: draw(param_layouts(s, d, world)) for n, (s, d) in shapes.items()})


@st.composite
def problems(draw: st.DrawFn) -> tuple[ModelLayout, ModelLayout, dict[int, int], int]:
    shapes = {f"p{i}": (tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))),
                        draw(st.sampled_from(DTYPES)))
              for i in range(draw(st.integers(1, 3)))}
    s_world, t_world = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    src, dst = draw(model_layouts(shapes, s_world)), draw(model_layouts(shapes, t_world))
    same: dict[int, int] = {}
    if draw(st.booleans()):
        partners = draw(st.permutations(range(s_world)))
        same = {t: s for t, s in zip(range(t_world), partners, strict=False)
                if draw(st.booleans())}
    itemsize = max(dtype_size(d) for _, d in shapes.values())
    bucket = draw(st.one_of(st.integers(itemsize, 64), st.integers(itemsize, 100_000)))
    return src, dst, same, bucket


@given(problems())
def test_plan_moves_exactly_the_lower_bound_once(problem: tuple) -> None:
    src, dst, same, bucket = problem
    plan = plan_transfer(src, dst, same_process=same, bucket_bytes=bucket)
    assert plan.bytes_moved == plan.lower_bound
    into: dict[tuple[str, int], list[Region]] = {}
    for tr in plan.transfers:
        into.setdefault((tr.param, tr.dst_rank), []).append(tr.region)
    expected_bound = 0
    for name, tl in dst.params:
        sl = src[name]
        for t, need in enumerate(tl.regions):
            want = np.zeros(tl.shape, dtype=bool)
            if need is not None:
                want[need.to_slices()] = True
            if need is not None and t in same and sl.regions[same[t]] is not None:
                want[sl.regions[same[t]].to_slices()] = False  # already in the same process
                local = need.intersect(sl.regions[same[t]])
                copies = [c for c in plan.local if c.param == name and c.dst_rank == t]
                assert [c.region for c in copies] == ([local] if local else [])
            got = np.zeros(tl.shape, dtype=np.int64)
            for region in into.get((name, t), []):
                got[region.to_slices()] += 1
            assert np.array_equal(got, want.astype(np.int64)), (name, t)
            expected_bound += int(want.sum()) * tl.itemsize
    assert plan.lower_bound == expected_bound
    for tr in plan.transfers:
        assert src[tr.param].regions[tr.src_rank].contains(tr.region)
        assert dst[tr.param].regions[tr.dst_rank].contains(tr.region)
        assert tr.nbytes == tr.region.numel * dst[tr.param].itemsize > 0
    for i, b in enumerate(plan.buckets):
        assert b.index == i and 0 < b.nbytes <= bucket
        assert b.nbytes == sum(t.nbytes for t in b.transfers)
    # Deterministic: the same input gives an equal plan.
    assert plan == plan_transfer(src, dst, same_process=dict(same), bucket_bytes=bucket)
    assert f"moved        {plan.bytes_moved} bytes" in plan.describe()


@given(problems())
def test_transfer_order_is_param_then_target_then_source(problem: tuple) -> None:
    src, dst, same, bucket = problem
    plan = plan_transfer(src, dst, same_process=same, bucket_bytes=bucket)
    order = {n: i for i, n in enumerate(dst.names)}
    keys = [(order[t.param], t.dst_rank, t.src_rank) for t in plan.transfers]
    assert keys == sorted(keys)


# ---------------------------------------------------------------- bad input


def two_fsdp(shape: tuple[int, ...] = (8, 4), dtype: str = "float32") -> ModelLayout:
    return ModelLayout.fsdp({"w": (shape, dtype)}, 2)


def test_uncovered_parameter_is_refused() -> None:
    gap = ParamLayout(shape=(8, 4), dtype="float32",
                      regions=(Region(bounds=((0, 3), (0, 4))), Region(bounds=((4, 8), (0, 4)))))
    with pytest.raises(LayoutError, match=r"parameter 'w' .*does not cover it: no rank holds "
                                          r"\[3:4, 0:4\]"):
        ModelLayout(world_size=2, params={"w": gap})


def test_overlapping_regions_are_refused_unless_allowed() -> None:
    regions = (Region(bounds=((0, 5), (0, 4))), Region(bounds=((3, 8), (0, 4))))
    with pytest.raises(LayoutError, match=r"'w': ranks 0 and 1 both hold \[3:5, 0:4\]"):
        ModelLayout(world_size=2, params={"w": ParamLayout(shape=(8, 4), dtype="float32",
                                                           regions=regions)})
    ok = ParamLayout(shape=(8, 4), dtype="float32", regions=regions, allow_overlap=True)
    plan = plan_transfer(ModelLayout(world_size=2, params={"w": ok}), two_fsdp(),
                         bucket_bytes=1024)
    assert plan.bytes_moved == plan.lower_bound == 8 * 4 * 4


def test_region_outside_the_shape_or_wrong_world_is_refused() -> None:
    with pytest.raises(LayoutError, match=r"rank 1's region \[4:9, 0:4\] does not fit"):
        ParamLayout(shape=(8, 4), dtype="float32",
                    regions=(Region(bounds=((0, 4), (0, 4))), Region(bounds=((4, 9), (0, 4)))))
    with pytest.raises(LayoutError, match="regions for 2 ranks but .* world_size 3"):
        ModelLayout(world_size=3, params={"w": ParamLayout.fsdp((8,), "float32", 2)})


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'w': source shape \(8, 4\) but target shape "
                                         r"\(8, 5\)"):
        plan_transfer(two_fsdp(), two_fsdp((8, 5)), bucket_bytes=1024)


def test_dtype_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="'w': source dtype float32 but target dtype bfloat16"):
        plan_transfer(two_fsdp(), two_fsdp(dtype="bfloat16"), bucket_bytes=1024)


def test_bucket_smaller_than_one_element_is_refused() -> None:
    with pytest.raises(ValueError, match=r"bucket_bytes=3 is smaller than one element of 'w' "
                                         r"\(float32, 4 bytes\)"):
        plan_transfer(two_fsdp(), two_fsdp(), bucket_bytes=3)
    with pytest.raises(ValueError, match="bucket_bytes must be an integer"):
        plan_transfer(two_fsdp(), two_fsdp(), bucket_bytes=4.0)  # type: ignore[arg-type]


def test_mismatched_parameter_names_are_refused() -> None:
    other = ModelLayout.fsdp({"w": ((8, 4), "float32"), "extra": ((2,), "float32")}, 2)
    with pytest.raises(ValueError, match=r"only in source: \[\], only in target: \['extra'\]"):
        plan_transfer(two_fsdp(), other, bucket_bytes=1024)


def test_same_process_out_of_range_or_shared_is_refused() -> None:
    with pytest.raises(ValueError, match="target rank 2 to source rank 0; allowed: target 0..1"):
        plan_transfer(two_fsdp(), two_fsdp(), same_process={2: 0}, bucket_bytes=1024)
    with pytest.raises(ValueError, match="target ranks 0 and 1 in the process of source rank 0"):
        plan_transfer(two_fsdp(), two_fsdp(), same_process={0: 0, 1: 0}, bucket_bytes=1024)


def test_plan_is_a_frozen_picklable_value() -> None:
    plan = plan_transfer(two_fsdp(), two_fsdp(), bucket_bytes=1024)
    assert isinstance(plan, TransferPlan)
    assert pickle.loads(pickle.dumps(plan)) == plan  # layouts and plans travel to workers
    with pytest.raises(AttributeError):
        plan.lower_bound = 0  # type: ignore[misc]


def test_decoder_shapes_from_a_config_feed_both_layouts() -> None:
    from avrid.reshard.tp_layout import decoder_shapes

    shapes = decoder_shapes(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2,
                            vocab=128, dtype="bfloat16")
    assert len(shapes) == 2 * 12 + 3
    assert shapes["model.layers.1.self_attn.v_proj.weight"] == ((32, 64), "bfloat16")
    plan = plan_transfer(ModelLayout.fsdp(shapes, 4), decoder_tp_layout(shapes, 2, head_dim=16),
                         same_process={0: 0, 1: 1}, bucket_bytes=1 << 16)
    assert plan.bytes_moved == plan.lower_bound > 0
