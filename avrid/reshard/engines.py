"""Chapter 4 — loading synced weights into a rollout engine through one narrow interface.

A weight sync ends in an engine, and every engine is different. `WeightSink` is all the sync
asks of one: `load` a bucket of named tensors (full, or this rank's tensor-parallel slices),
or `load_stream` a whole model's full tensors group by group in one pass, `finish` after the
last bucket, and `checksums` of what it now holds, which the driver compares with the
trainer's (`fingerprint.check_same`) to catch silently stale weights.

- `TorchEngineSink`: a torch module (or a dict of tensors) on any device: an in-place copy
  into each parameter, names, shapes and dtypes checked. Runs and is tested on CPU.
- `VllmSink`: a vLLM `LLM` built with ``worker_extension_cls=VLLM_EXTENSION`` (CPU or GPU).
  Full tensors go to vLLM's in-place `reload_weights` (HF names; it fuses and shards for TP
  itself), a whole sync in ONE reload fed lazily (`load_stream`); a TP rank's slices are
  copied straight into its views of vLLM's fused parameters (`vllm_param_name`,
  `vllm_local_spec`); `finish` resets the prefix cache, because a weight update does not
  (vllm PR#46125 reverted the automatic reset; stale cache = logprob drift).

The pure parts (name mapping, where each slice sits in a fused parameter, copying and
checksumming those views) are tested anywhere against fake fused tensors; the `vllm`-marked
tests run the worker side (`vllm_worker.AvridWorkerExtension`) inside the real engine
(vLLM's CPU build runs it here, TP=2 included). Slice loading skips vLLM's weight loaders,
so it suits unquantised models only. This file plans and moves nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from avrid.reshard.executor import layout_checksums
from avrid.reshard.fingerprint import fingerprint
from avrid.reshard.layout import ModelLayout

VLLM_EXTENSION = "avrid.reshard.vllm_worker.AvridWorkerExtension"
"""Pass as ``LLM(..., worker_extension_cls=VLLM_EXTENSION)`` so `VllmSink` can reach workers."""

# transformers module -> (vLLM fused module, shard id as vLLM's stacked_params_mapping has it)
_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_ORDER = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

# (name, fused name, row offset in the fused local tensor, global shape, bounds, counted)
LocalView = tuple[str, str, int, tuple[int, ...], tuple[tuple[int, int], ...], bool]


class WeightSink(Protocol):
    """What a rollout engine offers a weight sync."""

    def load(self, tensors: Mapping[str, torch.Tensor], *, layout: ModelLayout | None = None,
             rank: int | None = None) -> None:
        """Take some named tensors (one bucket, or everything): full tensors, or with
        `layout` and `rank` that rank's regions of them."""
        ...

    def load_stream(self, groups: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Take a whole model's full tensors in one pass, pulling one group at a time from
        `groups` (a generator may produce each group only when asked, and free it once the
        next is asked for). If `groups` raises, the groups taken so far stay loaded (the
        engine holds old and new weights mixed) and the error is raised."""
        ...

    def finish(self) -> None:
        """After the last bucket: drop whatever depends on the old weights (caches)."""
        ...

    def checksums(self, layout: ModelLayout | None, rank: int | None) -> dict[str, int]:
        """Partial fingerprints (`executor.layout_checksums`) of what the engine holds."""
        ...


class TorchEngineSink:
    """A torch module (e.g. a tiny transformers model) or a dict of tensors as an engine.

    A tensor-parallel engine holds only its slices, so its tensors have the slice shapes.
    Tied parameters are reachable by every name (``remove_duplicate=False``).
    """

    def __init__(self, engine: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        self.tensors: dict[str, torch.Tensor] = (
            dict(engine.named_parameters(remove_duplicate=False))
            if isinstance(engine, torch.nn.Module) else dict(engine))

    def load(self, tensors: Mapping[str, torch.Tensor], *, layout: ModelLayout | None = None,
             rank: int | None = None) -> None:
        """Copy each tensor into the engine's tensor of that name, in place (an optimizer or
        a compiled graph holding the parameter keeps seeing it). Everything is checked
        before anything is copied, so a bad bucket changes nothing."""
        for name, t in tensors.items():
            held = _known(self.tensors, name)
            want = held.shape
            if layout is not None and rank is not None:
                region = layout[name].regions[rank]
                if region is None:
                    raise ValueError(f"{name!r}: rank {rank} holds no part of it")
                want = torch.Size(region.shape)
                if want != held.shape:
                    raise ValueError(f"{name!r}: the engine holds shape {tuple(held.shape)} "
                                     f"but rank {rank}'s region is {tuple(want)}")
            if t.shape != want or t.dtype != held.dtype:
                # No silent casts: a dtype drift would only show as a fingerprint mismatch.
                raise ValueError(f"{name!r}: got {tuple(t.shape)} {t.dtype}, the engine holds "
                                 f"{tuple(want)} {held.dtype}")
        with torch.no_grad():
            for name, t in tensors.items():
                self.tensors[name].data.copy_(t)

    def load_stream(self, groups: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """`load` each group as it comes (each checked before it is copied)."""
        for group in groups:
            self.load(group)
            del group  # not held while the next one is made

    def finish(self) -> None:
        """Nothing to do: a plain torch engine keeps no cache derived from its weights."""

    def checksums(self, layout: ModelLayout | None = None,
                  rank: int | None = None) -> dict[str, int]:
        """Partial fingerprints of rank `rank`'s tensors; without a layout, the whole-tensor
        checksums of everything held."""
        if layout is None:
            return dict(fingerprint(self.tensors).checksums)
        return layout_checksums(layout, rank, self.tensors)


class VllmSink:
    """The adapter for a vLLM ``LLM`` created with ``worker_extension_cls=VLLM_EXTENSION``
    (one engine spans all its TP workers; `collective_rpc` reaches each of them).

    The engine core must run in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    as `avrid.ppo.engines.vllm_engine.VllmEngine` sets): between processes vLLM sends
    `collective_rpc` arguments as msgpack without their types, and tensors arrive as plain
    lists. TP workers below it get their arguments pickled, which carries tensors.

    Tensors stay where they are when the engine has a single worker in this process (vLLM's
    uni-process executor calls the worker directly): a sync on the GPU then streams device
    tensors into the engine with no host copy. With TP workers in other processes they go as
    CPU tensors (what pickling between processes carries).
    """

    def __init__(self, llm: Any) -> None:  # a vllm.LLM: vllm is imported only where needed
        self.llm = llm
        parallel = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None),
                           "parallel_config", None)
        self.in_process = getattr(parallel, "world_size", None) == 1

    def load(self, tensors: Mapping[str, torch.Tensor], *, layout: ModelLayout | None = None,
             rank: int | None = None) -> None:
        """Full tensors (no `rank`): the model's `load_weights`, which takes HF names, fuses
        q/k/v and gate/up and cuts each TP rank's part. With `layout` and `rank`: that
        rank's slices, copied into its views of the fused parameters; other ranks ignore it."""
        sent = {k: v.detach() if self.in_process else v.detach().cpu()
                for k, v in tensors.items()}
        if rank is None:
            self.llm.collective_rpc("avrid_load_full", args=(sent,))
            return
        if layout is None:
            raise ValueError("loading slices needs the layout they were cut with")
        spec = [v for v in vllm_local_spec(layout, rank) if v[0] in sent]
        if len(spec) != len(sent):  # a name the layout lacks, or a region this rank lacks
            stray = sorted(set(sent) - {v[0] for v in spec})
            raise KeyError(f"rank {rank} of the layout holds no region of {stray[:4]}")
        self.llm.collective_rpc("avrid_load_slices", args=(rank, spec, sent))

    def load_stream(self, groups: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """A whole sync as ONE `reload_weights` on the worker (`avrid_load_stream`), which
        pulls the groups from `groups` as it loads: each `reload_weights` call touches every
        module of the model, however few tensors it carries, so one call per group would
        cost (groups x modules). Only an in-process worker can take an iterator (vLLM pickles
        the arguments it sends to workers in other processes, and a generator does not
        pickle): there, each group is one `load` (one reload each), as bounded in memory.

        A failure inside `groups` (a transfer that died) ends the stream where it is: vLLM
        still finishes its reload (every module back off the meta device, the unloaded ones
        with their old weights), then the error is raised; the fingerprint check would show
        the mix, and no version is claimed for it."""
        if not self.in_process:
            for group in groups:
                self.load(group)
                del group  # not held while the next one is made
            return
        failed: list[BaseException] = []
        self.llm.collective_rpc("avrid_load_stream", args=(_pairs(groups, failed),))
        if failed:
            raise failed[0]

    def finish(self) -> None:
        """Reset the prefix cache: vLLM keeps KV blocks computed with the old weights."""
        self.llm.reset_prefix_cache()

    def checksums(self, layout: ModelLayout | None, rank: int | None = None) -> dict[str, int]:
        """Partial fingerprints computed on the workers, on the GPU, of rank `rank`'s slices
        (None: every rank's, added up). `layout` is the TP layout with transformers names
        (`decoder_tp_layout`); a world-size-1 layout for an engine without TP."""
        if layout is None:
            raise ValueError("vLLM holds fused tensors: pass the TP layout with HF names")
        specs = [vllm_local_spec(layout, r) for r in range(layout.world_size)]
        out: dict[str, int] = {}
        for tp_rank, sums in self.llm.collective_rpc("avrid_checksums", args=(specs,)):
            if rank is None or tp_rank == rank:
                for k, v in sums.items():
                    out[k] = (out.get(k, 0) + v) % 2**64
        return out


def _pairs(groups: Iterable[Mapping[str, torch.Tensor]],
           failed: list[BaseException]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of `groups`, one group at a time; an error raised by `groups` is
    put in `failed` and ends the pairs (so vLLM's reload finishes rather than stopping with
    modules on the meta device)."""
    try:
        for group in groups:
            yield from ((name, t.detach()) for name, t in group.items())
            del group  # not held while the next one is made (vLLM keeps what it needs)
    except Exception as exc:  # re-raised by the caller, after the reload
        failed.append(exc)


def vllm_param_name(name: str) -> tuple[str, str | int | None]:
    """(vLLM parameter name, shard id) for a transformers name; shard id None if not fused.

    >>> vllm_param_name("model.layers.0.self_attn.k_proj.weight")
    ('model.layers.0.self_attn.qkv_proj.weight', 'k')
    >>> vllm_param_name("model.layers.3.mlp.up_proj.weight"), vllm_param_name("lm_head.weight")
    (('model.layers.3.mlp.gate_up_proj.weight', 1), ('lm_head.weight', None))
    """
    parts = name.split(".")
    for i in range(len(parts) - 2, -1, -1):  # the module right before weight/bias
        if parts[i] in _FUSED:
            fused, shard = _FUSED[parts[i]]
            return ".".join((*parts[:i], fused, *parts[i + 1:])), shard
    return name, None


def vllm_local_spec(layout: ModelLayout, rank: int) -> list[LocalView]:
    """Where each of rank `rank`'s regions sits in vLLM's local tensors: vLLM concatenates a
    rank's q, k, v (gate, up) pieces along dim 0, so a piece starts after its siblings' rows
    on that rank. Plain tuples, so they cross `collective_rpc` without pickle. `counted` is
    False where a lower rank already speaks for a replicated region (as `layout_checksums`)."""
    out: list[LocalView] = []
    for name, p in layout.params:
        region = p.regions[rank]
        if region is None:
            continue
        fused, _ = vllm_param_name(name)
        offset = 0
        if fused != name:
            parts = name.split(".")
            module = next(m for m in reversed(parts) if m in _FUSED)
            for sibling in _ORDER[_FUSED[module][0]]:
                if sibling == module:
                    break
                other = layout[".".join(sibling if m == module else m for m in parts)]
                held = other.regions[rank]
                offset += held.shape[0] if held is not None else 0
        counted = not (p.allow_overlap and any(
            r is not None and r.intersect(region) is not None for r in p.regions[:rank]))
        out.append((name, fused, offset, p.shape, region.bounds, counted))
    return out


def vllm_local_views(params: Mapping[str, torch.Tensor],
                     spec: Sequence[LocalView]) -> dict[str, torch.Tensor]:
    """Views of a vLLM worker's parameters (`named_parameters`) by transformers name. A
    vocab-parallel tensor is padded past the real rows: the view keeps the real ones."""
    out = {}
    for name, fused, offset, _, bounds, _ in spec:
        whole = _known(params, fused)
        shape = tuple(b - a for a, b in bounds)
        view = whole.narrow(0, offset, shape[0]) if shape else whole
        if tuple(view.shape) != shape:
            raise ValueError(f"{name!r} -> {fused!r}: rows {offset}:{offset + shape[0]} of the "
                             f"local {tuple(whole.shape)} are not the region shape {shape}")
        out[name] = view
    return out


def _known(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise KeyError(f"the engine has no tensor {name!r} ({len(tensors)} known, e.g. "
                       f"{sorted(tensors)[:4]})")
    return tensors[name]
