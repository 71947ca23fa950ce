"""Loading synced weights into engines: the torch engine on CPU (full weights, buckets, TP
slices, errors, fingerprints), the vLLM adapter's pure parts against fake fused tensors, and
the marked GPU/vLLM tier (vLLM load-then-generate, the executor over NCCL)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from avrid.reshard.engines import (
    TorchEngineSink,
    VllmSink,
    WeightSink,
    vllm_local_spec,
    vllm_local_views,
    vllm_param_name,
)
from avrid.reshard.executor import execute, layout_checksums
from avrid.reshard.fingerprint import StaleWeightsError, check_same, combine, fingerprint
from avrid.reshard.layout import ModelLayout
from avrid.reshard.planner import plan_transfer
from avrid.reshard.tp_layout import decoder_tp_layout
from avrid.reshard.vllm_worker import AvridWorkerExtension
from avrid.workers import Worker

pytestmark = pytest.mark.chapter(4)

HEAD_DIM = 4


def decoder_shapes(layers: int = 2, hidden: int = 16, vocab: int = 100) -> dict:
    """Qwen2-like names; 4 query heads and 2 kv heads of 4; vocab 100 pads unevenly in vLLM."""
    shapes = {"model.embed_tokens.weight": ((vocab, hidden), "float32")}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": ((hidden, hidden), "float32"),
            f"{p}.self_attn.q_proj.bias": ((hidden,), "float32"),
            f"{p}.self_attn.k_proj.weight": ((8, hidden), "bfloat16"),
            f"{p}.self_attn.v_proj.weight": ((8, hidden), "float32"),
            f"{p}.self_attn.o_proj.weight": ((hidden, hidden), "float32"),
            f"{p}.mlp.gate_proj.weight": ((24, hidden), "float32"),
            f"{p}.mlp.up_proj.weight": ((24, hidden), "float32"),
            f"{p}.mlp.down_proj.weight": ((hidden, 24), "float32"),
            f"{p}.input_layernorm.weight": ((hidden,), "float32"),
        })
    shapes["lm_head.weight"] = ((vocab, hidden), "float32")
    return shapes


def vllm_shapes(layers: int = 2) -> dict:
    """One dtype, as in a vLLM engine: a fused q/k/v tensor cannot mix dtypes."""
    return {n: (s, "bfloat16") for n, (s, _) in decoder_shapes(layers).items()}


def full_weights(shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen).to(getattr(torch, d)) for n, (s, d) in shapes.items()}


def module_from_shapes(shapes: dict) -> torch.nn.Module:
    """A zero-initialised module whose named_parameters() are exactly `shapes`' names."""
    root = torch.nn.Module()
    for name, (shape, dtype) in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape,
                                                                    dtype=getattr(torch, dtype))))
    return root


def slices(full: dict, layout: ModelLayout, rank: int) -> dict[str, torch.Tensor]:
    return {n: full[n][p.regions[rank].to_slices()].clone()
            for n, p in layout.params if p.regions[rank] is not None}


# --- the torch engine -------------------------------------------------------------------------

def test_torch_sink_copies_full_weights_in_place() -> None:
    shapes = decoder_shapes()
    full, model = full_weights(shapes), module_from_shapes(shapes)
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    sink: WeightSink = TorchEngineSink(model)
    sink.load(full)
    sink.finish()
    for name, p in model.named_parameters():
        assert torch.equal(p, full[name]), name
        assert before[name] == (p, p.data_ptr())  # same parameter, same storage
        assert not p.requires_grad or p.grad is None
    assert sink.checksums(None, None) == fingerprint(full).checksums
    check_same(fingerprint(full).checksums, sink.checksums(ModelLayout.fsdp(shapes, 1), 0))


def test_torch_sink_loads_a_world_size_one_plan_bucket_by_bucket() -> None:
    shapes = decoder_shapes()
    full, model = full_weights(shapes, seed=1), module_from_shapes(shapes)
    target = decoder_tp_layout(shapes, 1, head_dim=HEAD_DIM)
    plan = plan_transfer(ModelLayout.fsdp(shapes, 1), target, same_process={0: 0},
                         bucket_bytes=1024)
    assert not plan.buckets  # colocated, one rank: only local copies, no process group
    out = execute(plan, 0, full)
    sink = TorchEngineSink(model)
    names = list(out)
    for i in range(0, len(names), 3):
        sink.load({n: out[n] for n in names[i:i + 3]}, layout=target, rank=0)
    sink.finish()
    check_same(fingerprint(full).checksums, sink.checksums(target, 0))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_sharded_torch_engines_add_up_to_the_full_weights(tp: int) -> None:
    shapes = decoder_shapes()
    full = full_weights(shapes, seed=2)
    layout = decoder_tp_layout(shapes, tp, head_dim=HEAD_DIM)
    sinks = []
    for r in range(tp):
        mine = slices(full, layout, r)
        sink = TorchEngineSink({n: torch.zeros_like(t) for n, t in mine.items()})
        sink.load(mine, layout=layout, rank=r)
        sinks.append(sink)
    expected = fingerprint(full).checksums
    check_same(expected, combine(s.checksums(layout, r) for r, s in enumerate(sinks)))
    name = "model.layers.1.self_attn.k_proj.weight"
    # One element of one rank's slice goes stale. Rank 0: a kv head replicated over ranks
    # (tp=4) is fingerprinted by its lowest holder only, so a stale replica would pass.
    sinks[0].tensors[name].view(-1)[3] += 1
    with pytest.raises(StaleWeightsError, match=r"differ: \['model.layers.1.self_attn.k_proj"):
        check_same(expected, combine(s.checksums(layout, r) for r, s in enumerate(sinks)))


def test_torch_sink_rejects_bad_names_shapes_and_dtypes_before_copying() -> None:
    shapes = decoder_shapes(layers=1)
    model = module_from_shapes(shapes)
    sink = TorchEngineSink(model)
    good = {"model.layers.0.mlp.up_proj.weight": torch.ones(24, 16)}
    with pytest.raises(KeyError, match=r"no tensor 'model.layers.0.mlp.upp.weight'.*e\.g\."):
        sink.load({**good, "model.layers.0.mlp.upp.weight": torch.ones(24, 16)})
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight': got \(99, 16\)"):
        sink.load({**good, "model.embed_tokens.weight": torch.ones(99, 16)})
    with pytest.raises(ValueError, match=r"k_proj.weight': got \(8, 16\) torch.float32.*bfloat16"):
        sink.load({**good, "model.layers.0.self_attn.k_proj.weight": torch.ones(8, 16)})
    # Nothing of a bad bucket lands.
    assert dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"].sum() == 0
    layout = decoder_tp_layout(shapes, 2)
    with pytest.raises(ValueError, match=r"holds shape \(24, 16\) but rank 1's region is"):
        sink.load(good, layout=layout, rank=1)  # a full engine is not a TP rank's engine


# --- the vLLM adapter, on fake fused tensors ------------------------------------------------

@pytest.mark.parametrize(("name", "fused", "shard"), [
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.qkv_proj.weight", "q"),
    ("model.layers.7.self_attn.k_proj.bias", "model.layers.7.self_attn.qkv_proj.bias", "k"),
    ("model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.qkv_proj.weight", "v"),
    ("model.layers.2.mlp.gate_proj.weight", "model.layers.2.mlp.gate_up_proj.weight", 0),
    ("model.layers.2.mlp.up_proj.weight", "model.layers.2.mlp.gate_up_proj.weight", 1),
    ("model.layers.2.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight", None),
    ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight", None),
    ("model.embed_tokens.weight", "model.embed_tokens.weight", None),
    ("model.norm.weight", "model.norm.weight", None),
])
def test_vllm_param_name_maps_to_fused_names(name: str, fused: str, shard: object) -> None:
    assert vllm_param_name(name) == (fused, shard)


class FakeVllmWorker(AvridWorkerExtension):
    """A vLLM worker as the extension sees it: fused, vocab-padded local tensors."""

    def __init__(self, layout: ModelLayout, rank: int) -> None:
        rows: dict[str, int] = {}
        rest: dict[str, tuple] = {}
        for name, fused, offset, _, bounds, _ in vllm_local_spec(layout, rank):
            n = bounds[0][1] - bounds[0][0] + (5 if "embed" in name or "lm_head" in name else 0)
            rows[fused] = max(rows.get(fused, 0), offset + n)
            rest[fused] = (tuple(b - a for a, b in bounds[1:]), layout[name].dtype)
        self.rank, self.layout = rank, layout
        self.params = {f: torch.full((rows[f], *rest[f][0]), float("nan"),
                                     dtype=getattr(torch, rest[f][1])) for f in rows}
        self.model_runner = SimpleNamespace(model=SimpleNamespace(
            named_parameters=self.params.items, named_modules=lambda: iter(()),
            load_weights=self._load_weights))

    def _avrid_tp_rank(self) -> int:
        return self.rank

    def _load_weights(self, weights: object) -> set[str]:
        # vLLM's semantics: HF names, full tensors; each rank keeps its own part.
        views = vllm_local_views(self.params, vllm_local_spec(self.layout, self.rank))
        for name, t in weights:
            views[name].copy_(t[self.layout[name].regions[self.rank].to_slices()])
        return set(views)


class FakeLLM:
    def __init__(self, layout: ModelLayout) -> None:
        self.workers = [FakeVllmWorker(layout, r) for r in range(layout.world_size)]
        self.resets = 0

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("mode", ["slices", "full"])
def test_vllm_sink_fills_fused_tensors_and_fingerprints_them(tp: int, mode: str) -> None:
    shapes = vllm_shapes()
    full = full_weights(shapes, seed=4)
    layout = decoder_tp_layout(shapes, tp, head_dim=HEAD_DIM)
    llm = FakeLLM(layout)
    sink: WeightSink = VllmSink(llm)
    if mode == "full":
        sink.load(full)
    else:
        for r in range(tp):
            mine = slices(full, layout, r)
            names = list(mine)
            for i in range(0, len(names), 4):  # bucket by bucket
                sink.load({n: mine[n] for n in names[i:i + 4]}, layout=layout, rank=r)
    sink.finish()
    assert llm.resets == 1
    for r, w in enumerate(llm.workers):
        views = vllm_local_views(w.params, vllm_local_spec(layout, r))
        for name, view in views.items():
            assert torch.equal(view, full[name][layout[name].regions[r].to_slices()]), name
        assert sink.checksums(layout, r) == layout_checksums(layout, r, views)
    expected = fingerprint(full).checksums
    check_same(expected, sink.checksums(layout))
    # A k row inside the fused qkv tensor goes stale: the check names k_proj, not q or v.
    llm.workers[0].params["model.layers.0.self_attn.qkv_proj.weight"][HEAD_DIM * 4 // tp] += 1
    with pytest.raises(StaleWeightsError, match=r"differ: \['model.layers.0.self_attn.k_proj"):
        check_same(expected, sink.checksums(layout))


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_sink_streams_a_sync_into_one_worker_call(tp: int) -> None:
    # In process (one worker, TP=1) the whole stream is ONE call (vLLM: one reload_weights),
    # which pulls the groups as it loads; workers in other processes get one call per group
    # (their arguments are pickled, and a generator does not pickle).
    shapes = vllm_shapes()
    full = full_weights(shapes, seed=5)
    layout = decoder_tp_layout(shapes, tp, head_dim=HEAD_DIM)
    llm = FakeLLM(layout)
    calls: list[str] = []
    rpc = llm.collective_rpc
    llm.collective_rpc = lambda method, **kw: calls.append(method) or rpc(method, **kw)
    sink = VllmSink(llm)
    sink.in_process = tp == 1  # what VllmSink reads from a real engine's parallel config
    names, made = list(full), []

    def groups(fail_at: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(0, len(names), 3):
            if i == fail_at:
                raise RuntimeError("injected transfer failure")
            made.append(i)
            yield {n: full[n] for n in names[i:i + 3]}

    sink.load_stream(groups())
    assert calls == (["avrid_load_stream"] if tp == 1 else ["avrid_load_full"] * len(made))
    check_same(fingerprint(full).checksums, sink.checksums(layout))
    # A stream that fails part-way: what came before it is loaded, then its error is raised.
    calls.clear()
    later = {n: t + 1 for n, t in full.items()}
    full.update(later)
    with pytest.raises(RuntimeError, match="injected transfer failure"):
        sink.load_stream(groups(fail_at=6))
    assert len(calls) == (1 if tp == 1 else 2)
    views = vllm_local_views(llm.workers[0].params, vllm_local_spec(layout, 0))
    assert torch.equal(views[names[0]], later[names[0]][layout[names[0]].regions[0].to_slices()])


def test_vllm_sink_refuses_slices_it_cannot_place() -> None:
    shapes = vllm_shapes(layers=1)
    layout = decoder_tp_layout(shapes, 2, head_dim=HEAD_DIM)
    sink = VllmSink(FakeLLM(layout))
    with pytest.raises(KeyError, match="no region of.*'model.norm.weight'"):
        sink.load({"model.norm.weight": torch.ones(16)}, layout=layout, rank=0)
    with pytest.raises(ValueError, match="needs the layout"):
        sink.load({"model.embed_tokens.weight": torch.ones(64, 16)}, rank=0)
    # (1, 16) into (12, 16): copy_ would broadcast it silently.
    bad = {"model.layers.0.mlp.up_proj.weight": torch.ones(1, 16, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"up_proj.weight': got \(1, 16\)"):
        sink.load(bad, layout=layout, rank=1)


# --- GPU tier (skips cleanly without CUDA); the real vLLM engine: test_reshard_vllm.py ------

class NcclReshardWorker(Worker):
    """Runs a transfer plan over NCCL with CUDA tensors; returns target slices on CPU."""

    def reshard(self, plan: object, full: dict) -> tuple:
        from avrid.reshard.executor import ProcessMap

        group = self.init_distributed(backend="nccl", timeout_s=60)
        try:
            src, dst = ProcessMap.for_plan(plan).roles_of(self.identity.rank)
            shards = {} if src is None else {n: t.cuda() for n, t in
                                             slices(full, plan.source, src).items()}
            out = execute(plan, self.identity.rank, shards, group, device="cuda")
            sums = layout_checksums(plan.target, dst, out)
            return dst, {n: t.cpu() for n, t in out.items()}, sums
        finally:
            self.destroy_distributed()


@pytest.mark.gpu(count=2)
@pytest.mark.usefixtures("ray_cluster")
def test_execute_over_nccl_across_two_gpus() -> None:
    from avrid.workers import Mesh, RayBackend, ResourcePool, RoleSpec, plan_placement

    shapes = decoder_shapes()
    full = full_weights(shapes, seed=5)
    layout = decoder_tp_layout(shapes, 2, head_dim=HEAD_DIM)
    plan = plan_transfer(ModelLayout.fsdp(shapes, 2), layout, same_process={0: 0, 1: 1},
                         bucket_bytes=4096)
    placement = plan_placement([ResourcePool.uniform("gpus", 2, cpus=1, gpus=1)], [
        RoleSpec(role="sync", worker=NcclReshardWorker, mesh=Mesh.of(dp=2), pool="gpus",
                 gpus=1)])
    with RayBackend().launch(placement) as cluster:
        outs = cluster.group("sync", NcclReshardWorker).call(NcclReshardWorker.reshard, plan,
                                                              full)
    for dst, out, _ in outs:
        for name, t in out.items():
            assert torch.equal(t, full[name][layout[name].regions[dst].to_slices()]), name
    check_same(fingerprint(full).checksums, combine(s for _, _, s in outs))
