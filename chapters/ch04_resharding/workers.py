"""Chapter 4 — the example model and worker of the demo and the notebook: a small decoder's
shapes, its weights made from a seed, and a worker that runs one weight sync.

`decoder_shapes()` names the parameters of a small Qwen2-like decoder the way transformers
does (q/k/v with biases, grouped-query attention, gate/up/down, two norms per layer, untied
embeddings and lm_head), so `decoder_tp_layout` knows how vLLM would shard each of them.

`SyncWorker.sync(plan, seed)` is one process of a weight sync. It makes the full weights from
`seed` (the model is small, so every process can) and keeps only its FSDP source shard —
standing in for a trainer that holds just its shard. It joins the gloo group, runs the plan
(`execute`), loads its target slices into a `TorchEngineSink` — standing in for the rollout
engine of its tensor-parallel rank — and returns a `SyncReport`: the partial checksums of both
sides (`layout_checksums`), which the driver adds up and compares, plus timings. With
``naive=True`` it also runs verl's all-gather-then-slice baseline and checks it lands the
same bits. With `corrupt` it flips one element of one tensor in the engine after loading: the
stale-weights bug, on purpose, for the fingerprint check to catch.

This lives in an importable module, not in the demo's ``__main__``, because Ray pickles a
class by reference (module + name): each worker process must be able to import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from avrid.reshard import (
    ProcessMap,
    TransferPlan,
    execute,
    layout_checksums,
    naive_allgather,
)
from avrid.reshard.engines import TorchEngineSink
from avrid.reshard.tp_layout import decoder_shapes as lib_decoder_shapes
from avrid.workers import Worker

Shapes = dict[str, tuple[tuple[int, ...], str]]


def decoder_shapes(layers: int = 4, hidden: int = 128, heads: int = 8, kv_heads: int = 2,
                   inter: int = 352, vocab: int = 1024, dtype: str = "float32") -> Shapes:
    """Name -> (shape, dtype) of this chapter's small Qwen2-like decoder (vocab a multiple of
    64, as vLLM pads it). The defaults make about 0.97 M parameters, 3.9 MB in float32."""
    return dict(lib_decoder_shapes(layers=layers, hidden=hidden, intermediate=inter,
                                   heads=heads, kv_heads=kv_heads, vocab=vocab, dtype=dtype))


def full_weights(shapes: Shapes, seed: int) -> dict[str, torch.Tensor]:
    """The whole model's weights, the same on every process for the same `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen).to(getattr(torch, dtype))
            for name, (shape, dtype) in shapes.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncReport:
    """What one process of a sync sends back to the driver: checksums, not tensors."""

    process: int
    source_rank: int | None
    """The FSDP rank this process trains as (None: a rollout-only process)."""
    target_rank: int | None
    """The TP rank whose engine this process feeds (None: a training-only process)."""
    source_sums: dict[str, int]
    """Partial checksums of its FSDP shard (`layout_checksums` under the source layout)."""
    target_sums: dict[str, int]
    """Partial checksums of what its engine now holds (under the target layout)."""
    engine_bytes: int
    """Bytes its engine holds after the sync."""
    seconds: float
    """Wall time of `execute` (the planned transfer)."""
    naive_seconds: float | None = None
    """Wall time of the all-gather baseline, when it ran."""
    naive_same: bool | None = None
    """Whether the baseline landed exactly the same bits, when it ran."""


class SyncWorker(Worker):
    """One process of a weight sync: a training shard, a rollout slice, or both."""

    def sync(self, plan: TransferPlan, seed: int, *, naive: bool = False,
             corrupt: tuple[int, str] | None = None) -> SyncReport:
        """Run `plan` from this process's side and report both sides' checksums.

        `corrupt` = (target rank, parameter): that rank adds 1.0 to one element of that
        parameter in its engine after loading — a deliberately stale weight.
        """
        pmap = ProcessMap.for_plan(plan)
        if pmap.world_size != self.identity.world_size:
            raise ValueError(f"the plan needs {pmap.world_size} processes, this group has "
                             f"{self.identity.world_size}")
        me = self.identity.rank
        src, dst = pmap.roles_of(me)
        shapes = {n: (p.shape, p.dtype) for n, p in plan.source.params}
        full = full_weights(shapes, seed)
        shards = {} if src is None else {  # the trainer keeps its FSDP shard only
            n: full[n][p.regions[src].to_slices()].clone()
            for n, p in plan.source.params if p.regions[src] is not None}
        del full
        # The rollout engine of TP rank `dst`: its slices, holding old (zero) weights.
        engine = TorchEngineSink({} if dst is None else {
            n: torch.zeros(p.regions[dst].shape, dtype=getattr(torch, p.dtype))
            for n, p in plan.target.params if p.regions[dst] is not None})
        group = self.init_distributed(timeout_s=60)
        try:
            t0 = time.perf_counter()
            out = execute(plan, me, shards, group)
            seconds = time.perf_counter() - t0
            naive_seconds = naive_same = None
            if naive:
                t0 = time.perf_counter()
                base = naive_allgather(plan.source, plan.target, me, shards, pmap, group)
                naive_seconds = time.perf_counter() - t0
                naive_same = base.keys() == out.keys() and all(
                    torch.equal(base[n], out[n]) for n in out)
        finally:
            self.destroy_distributed()
        if dst is not None:
            engine.load(out, layout=plan.target, rank=dst)
            engine.finish()
            if corrupt is not None and corrupt[0] == dst:
                with torch.no_grad():
                    engine.tensors[corrupt[1]].view(-1)[0] += 1.0
        return SyncReport(
            process=me, source_rank=src, target_rank=dst,
            source_sums=layout_checksums(plan.source, src, shards),
            target_sums=engine.checksums(plan.target, dst) if dst is not None else {},
            engine_bytes=sum(t.numel() * t.element_size() for t in engine.tensors.values()),
            seconds=seconds, naive_seconds=naive_seconds, naive_same=naive_same)
