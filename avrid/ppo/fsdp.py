"""Chapter 5 — FSDP2 over a role's data-parallel group, and getting state in and out of it.

`fully_shard` (PyTorch's FSDP2) turns each parameter into a DTensor sharded on dim 0 over the
group: a rank keeps 1/dp of the weights, gradients and AdamW state, and all-gathers a layer's
weights just before using them. The same code runs with gloo on CPU and NCCL on GPU.

Each decoder layer is sharded as its own unit, then the root: a layer's weights are gathered,
used and freed in turn, so only one layer is ever whole (the point of FSDP).

What this file adds around it:

- `shard_model`: wrap a model over the worker's process group (a 1-rank group is left as a
  plain module: there is nothing to shard, and the in-process backend has no device mesh);
- `local_shards` / `full_state_dict`: a rank's own shards (what chapter 4's weight sync sends)
  and the whole weights (what a checkpoint stores);
- `optimizer_state` / `load_optimizer_state`: AdamW state as plain tensors (picklable, saved
  per rank) and back into DTensors shaped like the parameters.

It does not decide when to sync or save; the workers and the trainer do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def shard_model(model: torch.nn.Module, group: ProcessGroup | None, world_size: int,
                device: str) -> torch.nn.Module:
    """Apply FSDP2 to each decoder layer and the root over `group`; a no-op for one rank."""
    if world_size == 1 or group is None:
        return model
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device_type=device)
    # transformers decoders keep their blocks in `model.model.layers` (Qwen2, Llama, ...).
    trunk = getattr(model, "model", None)
    for layer in getattr(trunk, "layers", []):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter (the whole tensor when not sharded)."""
    return {name: (p.to_local() if _is_dtensor(p) else p).detach()
            for name, p in model.named_parameters()}


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (an all-gather per sharded parameter), on CPU."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if _is_dtensor(p) else p
        out[name] = full.detach().to("cpu", copy=True)
    return out


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with every DTensor replaced by this rank's local tensor."""
    state = optimizer.state_dict()
    return {"state": {k: {n: (v.to_local().cpu() if _is_dtensor(v) else
                              v.cpu() if isinstance(v, torch.Tensor) else v)
                          for n, v in s.items()} for k, s in state["state"].items()},
            "param_groups": state["param_groups"]}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load `optimizer_state` output back: local tensors become DTensors like their params."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    restored: dict[int, dict[str, Any]] = {}
    for key, entry in state["state"].items():
        p = params[int(key)]
        restored[int(key)] = {}
        for name, v in entry.items():
            if isinstance(v, torch.Tensor) and _is_dtensor(p) and v.dim() > 0:
                v = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                       shape=p.shape, stride=p.stride())
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                v = v.to(p.device)
            restored[int(key)][name] = v
    optimizer.load_state_dict({"state": restored, "param_groups": state["param_groups"]})
