"""Chapter 4 — the worker side of `VllmSink`: what runs inside each vLLM worker.

`AvridWorkerExtension` is mixed into every vLLM worker (``LLM(...,
worker_extension_cls=VLLM_EXTENSION)``); `engines.VllmSink` calls its methods by name through
`collective_rpc`: load full tensors (one `reload_weights` per sync, fed lazily), copy a TP
rank's slices into vLLM's fused parameters, and read back exactly what the kernels hold for
the fingerprint check.

Not here: what the trainer side sends or when (`engines.py`, the weight syncs); anything
about vLLM's engine itself (`avrid.ppo.engines.vllm_engine`). vllm is never imported here at
module level, so the file imports anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from avrid.reshard.engines import LocalView, vllm_local_views
from avrid.reshard.fingerprint import region_checksum


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
        whole layers. One call is one `reload_weights`: see `avrid_load_stream`."""
        return self.avrid_load_stream(iter(tensors.items()))

    def avrid_load_stream(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """A whole sync in ONE `reload_weights`, pulling (HF name, full tensor) pairs from
        `weights` as it loads (vLLM's loader iterates lazily), so the caller may produce them
        group by group and free each after it is consumed. Only a worker in the caller's
        process can take an iterator (`VllmSink.load_stream`).

        Why one call: every `reload_weights` moves EVERY module of the model to meta and back
        (`initialize_layerwise_reload`/`finalize_layerwise_reload`), rebuilds the parameter
        name set, and resets the LoRA state, whatever it was given; a module is processed as
        soon as its last piece arrives, so in one call only the modules still incomplete
        hold their pieces. Returns the number of tensors loaded."""
        counted = _Counted(weights)
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):  # vLLM >= 0.3x: the documented in-place path
            runner.reload_weights(weights_iterator=counted)
        else:  # older vLLM: the model's own loader (its parameters stay unpacked on GPU)
            runner.model.load_weights(weights=counted)
        return counted.n

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


class _Counted:
    """An iterator of (name, tensor) pairs that counts what was taken from it."""

    def __init__(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.pairs, self.n = pairs, 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        pair = next(self.pairs)
        self.n += 1
        return pair
