"""Chapter 4 — loading synced weights into a rollout engine through one narrow interface.

A weight sync ends in an engine, and every engine is different. `WeightSink` is all the sync
asks of one: `load` a bucket of named tensors (full, or this rank's tensor-parallel slices),
`finish` after the last bucket, and `checksums` of what it now holds, which the driver
compares with the trainer's (`fingerprint.check_same`) to catch silently stale weights.

- `TorchEngineSink`: a torch module (or a dict of tensors) on any device: an in-place copy
  into each parameter, names, shapes and dtypes checked. Runs and is tested on CPU.
- `VllmSink`: a vLLM `LLM` built with ``worker_extension_cls=VLLM_EXTENSION`` (CPU or GPU).
  Full tensors go to vLLM's in-place `reload_weights` (HF names; it fuses and shards for TP
  itself); a TP rank's slices are copied straight into its views of vLLM's fused parameters
  (`vllm_param_name`, `vllm_local_spec`); `finish` resets the prefix cache, because a weight
  update does not (vllm PR#46125 reverted the automatic reset; stale cache = logprob drift).

The pure parts (name mapping, where each slice sits in a fused parameter, copying and
checksumming those views) are tested anywhere against fake fused tensors; the `vllm`-marked
tests run the worker side inside the real engine (vLLM's CPU build runs it here, TP=2
included). Slice loading skips vLLM's weight loaders, so it suits unquantised models only.
This file plans and moves nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from avrid.reshard.executor import layout_checksums
from avrid.reshard.fingerprint import fingerprint, region_checksum
from avrid.reshard.layout import ModelLayout

VLLM_EXTENSION = "avrid.reshard.engines.AvridWorkerExtension"
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


class AvridWorkerExtension:
    """Mixed into every vLLM worker by ``worker_extension_cls``; `VllmSink` calls these by
    name through `collective_rpc`. `self.model_runner` is the vLLM worker's model runner (GPU
    or CPU; vLLM's CPU worker subclasses the GPU one).

    On CPU vLLM packs each linear layer's weight into a oneDNN (or SGL) kernel format after
    loading and leaves an EMPTY parameter behind, so "what the engine holds" cannot be read
    from `named_parameters`. `_avrid_held` reads it back exactly through the kernel itself:
    ``linear(I) = I @ W^T = W^T``, every product a multiplication by 1 or 0, so nothing
    rounds. The slice path writes a packed layer by unpacking it that way, patching it, and
    letting vLLM's own `process_weights_after_loading` pack it again.
    """

    model_runner: Any

    def _avrid_tp_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def _avrid_params(self) -> dict[str, tuple[torch.nn.Module | None, torch.nn.Parameter]]:
        """vLLM name -> (the module that owns it, the parameter). An engine that serves LoRA
        adapters wraps each adapted layer and keeps its weight as
        ``<layer>.base_layer.weight``: listed under the layer's own name, which is the
        weight's name in an engine without adapters."""
        model = self.model_runner.model
        modules = dict(model.named_modules())
        return {name.replace(_LORA_BASE, "."): (modules.get(name.rpartition(".")[0]), p)
                for name, p in model.named_parameters()}

    def _avrid_held(self, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """This worker's parameters by vLLM name, as its kernels see them (see the class)."""
        return {name: _held_tensor(module, p) for name, (module, p) in self._avrid_params().items()
                if names is None or name in names}

    def avrid_load_full(self, tensors: dict[str, torch.Tensor]) -> int:
        """HF names and full tensors into vLLM's in-place reload, which fuses q/k/v and
        gate/up, cuts this worker's TP part and re-runs the kernel post-processing (the CPU
        packing above). A layer is processed once all its pieces arrived, so a call must carry
        whole layers (the weight sync sends everything in one call)."""
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):  # vLLM >= 0.3x: the documented in-place path
            runner.reload_weights(weights_iterator=iter(tensors.items()))
        else:  # older vLLM: the model's own loader (its parameters stay unpacked on GPU)
            runner.model.load_weights(weights=iter(tensors.items()))
        return len(tensors)

    def avrid_load_slices(self, rank: int, spec: list[LocalView],
                          tensors: dict[str, torch.Tensor]) -> int:
        """Copy rank `rank`'s slices into this worker's fused parameters, if it is that rank."""
        if self._avrid_tp_rank() != rank:
            return 0
        owned = self._avrid_params()
        fused_names = {fused for _, fused, *_ in spec}
        held = self._avrid_held(fused_names)  # unpacked copies where vLLM packed them
        views = vllm_local_views(held, spec)
        for name, view in views.items():
            t = tensors[name]  # copy_ would broadcast or cast silently: check first
            if t.shape != view.shape or t.dtype != view.dtype:
                raise ValueError(f"{name!r}: got {tuple(t.shape)} {t.dtype}, vLLM holds "
                                 f"{tuple(view.shape)} {view.dtype}")
        with torch.no_grad():
            for name, view in views.items():
                view.copy_(tensors[name])
            for fused in fused_names:  # CPU: vLLM packs its kernels' copy again
                module, param = owned[fused]
                if module is None:
                    continue
                if _is_packed(module, param):  # the patched copy is the weight now
                    module.weight = torch.nn.Parameter(held[fused], requires_grad=False)
                if _has_kernel(module):
                    module.quant_method.process_weights_after_loading(module)
        return len(views)

    def avrid_checksums(self, specs: list[list[LocalView]]) -> tuple[int, dict[str, int]]:
        """(TP rank, partial fingerprints of its counted regions), computed where they live."""
        rank = self._avrid_tp_rank()
        held = self._avrid_held({fused for _, fused, *_ in specs[rank]})
        views = vllm_local_views(held, specs[rank])
        return rank, {name: region_checksum(views[name], shape, bounds)
                      for name, _, _, shape, bounds, counted in specs[rank] if counted}


_LORA_BASE = ".base_layer."
"""Where a LoRA-serving vLLM engine keeps an adapted layer's own weight."""

_PROBE_ROWS = 1024
"""Rows of the identity pushed through a packed kernel at once (bounds the probe's memory)."""


def _is_packed(module: torch.nn.Module, param: torch.Tensor) -> bool:
    """vLLM's CPU linear layers keep their weight inside `cpu_linear` and an empty parameter."""
    return param.numel() == 0 and _has_kernel(module)


def _has_kernel(module: torch.nn.Module | None) -> bool:
    """A vLLM CPU layer whose matmul runs a packed copy of its weight (linear layers, and the
    vocab embedding / LM head, which keep their parameter as well)."""
    return callable(getattr(module, "cpu_linear", None))


def _held_tensor(module: torch.nn.Module | None, param: torch.Tensor) -> torch.Tensor:
    """What the engine computes with: `param` itself, or where vLLM packed it for a CPU
    kernel, the kernel's copy read back as (out, in) = linear(I_in)^T, the identity in chunks
    of rows. Where a layer keeps both (LM head), the two must agree; a packed copy that
    missed a load would otherwise hide behind an up-to-date parameter."""
    if not _has_kernel(module) or (param.dim() != 2 and param.numel() > 0):  # e.g. a bias
        return param.detach()
    k = int(module.input_size_per_partition)
    chunks = []
    for start in range(0, k, _PROBE_ROWS):
        rows = min(_PROBE_ROWS, k - start)
        eye = torch.zeros(rows, k, dtype=param.dtype)
        eye[:, start:start + rows] = torch.eye(rows, dtype=param.dtype)
        chunks.append(module.cpu_linear(eye, None, None).to(param.dtype))
    kernel = torch.cat(chunks).t().contiguous()
    if param.numel() == 0:
        return kernel
    if not torch.equal(kernel, param.detach()):
        raise RuntimeError(f"{type(module).__name__}: its packed CPU kernel weight differs from "
                           f"its parameter (a load updated one but not the other)")
    return param.detach()


def _known(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise KeyError(f"the engine has no tensor {name!r} ({len(tensors)} known, e.g. "
                       f"{sorted(tensors)[:4]})")
    return tensors[name]
