"""Chapter 5 — FSDP2 over a role's data-parallel group, and getting state in and out of it.

`fully_shard` (PyTorch's FSDP2) turns each parameter into a DTensor sharded on dim 0 over the
group: a rank keeps 1/dp of the weights, gradients and AdamW state, and all-gathers a layer's
weights just before using them. The same code runs with gloo on CPU and NCCL on GPU.

Each decoder layer is sharded as its own unit, then the root: a layer's weights are gathered,
used and freed in turn, so only one layer is ever whole (the point of FSDP).

What this file adds around it:

- `shard_model`: wrap a model over the worker's process group (a 1-rank group is left as a
  plain module: there is nothing to shard, and the in-process backend has no device mesh) —
  except for low-precision training, below;
- `mixed_precision` / `cast_parameters`: bf16 training keeps fp32 master weights. Parameters
  and AdamW state stay fp32 (in a bf16 parameter most lr=1e-6 updates round to nothing: ~95%
  of one step's on the tiny model, tests/test_ppo_bf16.py); FSDP2's `MixedPrecisionPolicy`
  casts each layer's gathered weights to bf16 for the forward/backward and reduces gradients
  in fp32. The mechanism lives inside `fully_shard`, so a bf16 run shards even one rank (over
  a 1-rank group). Models that are never trained (the rollout engine, the frozen reference)
  simply hold bf16 parameters (`cast_parameters`);
- `offload` (`memory.cpu_offload`): FSDP2's `CPUOffloadPolicy` keeps the shards of the
  parameters and their gradients in host memory (AdamW's state follows its parameters), and
  gathers a layer onto the device for its forward/backward only; like mixed precision it
  lives inside `fully_shard`, so an offloaded model shards even one rank;
- `shard_frozen`: the frozen reference sharded over the actor's group (no gradients, no
  optimizer): each rank holds 1/dp of it, in the dtype it computes in;
- `local_shards` / `full_state_dict`: a rank's own shards (what chapter 4's weight sync sends)
  and the whole weights (what a checkpoint stores) — always the fp32 masters;
- `optimizer_state` / `load_optimizer_state`: AdamW state as plain tensors (picklable, saved
  per rank by checkpoints written before sharding) and back into DTensors shaped like the
  parameters;
- `save_shards` / `load_shards`: what a checkpoint stores now — every rank writes its own
  shards of the model and of AdamW with `torch.distributed.checkpoint` (DCP) and reads them
  back, nothing gathered (the layout: `avrid.ppo.outputs.shards`).

It does not decide when to sync or save; the workers and the trainer do.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup

MODEL_DIR, OPTIM_DIR = "model", "optim"
"""Where `save_shards` puts a model's weights and its optimizer's state under the directory
it is given; `avrid.ppo.outputs.shards` reads the same names (roles may not import outputs)."""


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def mixed_precision(dtype: torch.dtype) -> bool:
    """Whether training in `dtype` needs fp32 master weights and FSDP2's mixed precision."""
    return dtype != torch.float32


def backend(device: str, *, offload: bool = False) -> str:
    """The torch.distributed backend of a trained role's process group on `device`: gloo on
    the CPU, NCCL on CUDA, and both when offloaded on CUDA ("cuda:nccl,cpu:gloo"): the
    shards and gradients then live in host memory, and what reduces over them outside
    FSDP2's own hooks (the global gradient norm, a full-tensor gather) runs on the CPU."""
    if device != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if offload else "nccl"


def shard_model(model: torch.nn.Module, group: ProcessGroup | None, world_size: int,
                device: str, *, compute_dtype: torch.dtype = torch.float32,
                offload: bool = False) -> torch.nn.Module:
    """Apply FSDP2 to each decoder layer and the root over `group`.

    `model` holds fp32 parameters; with a lower `compute_dtype` (bf16) the forward/backward
    runs in it and gradients are reduced in fp32, while parameters and optimizer state stay
    fp32. With `offload` the shards of the parameters and gradients live in host memory
    (`offload_policy`). Both need `fully_shard` even for one rank, so `group` is then
    required. An fp32 model on one rank without offload is returned as it is.
    """
    low = mixed_precision(compute_dtype)
    if not (low or offload) and (world_size == 1 or group is None):
        return model
    if group is None:
        what = f"training in {compute_dtype}" if low else "memory.cpu_offload"
        raise ValueError(f"{what} uses FSDP2 ({'mixed precision' if low else 'CPU offload'}),"
                         f" which needs a process group (a 1-rank one for one rank)")
    if low and (bad := sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32"})):
        raise ValueError(f"mixed precision keeps fp32 master weights; the model holds {bad}")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # fp32 passes no policy at all (not an all-None one): plain FSDP2, no casts anywhere.
    kwargs = ({"mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype,
                                                 reduce_dtype=torch.float32)} if low else {})
    return _fully_shard(model, group, device, offload=offload, **kwargs)


def shard_frozen(model: torch.nn.Module, group: ProcessGroup, device: str, *,
                 offload: bool = False) -> torch.nn.Module:
    """FSDP2 over `group` for a model that is never trained (the frozen reference).

    Its parameters are kept in the dtype they hold (bf16 for a bf16 run: the shards, the
    all-gathers and the forward are all bf16, so the function is the unsharded bf16 model's
    and each rank holds 1/dp of it, not an fp32 master). No policy casts anything.

    FSDP2 keeps the root's parameters gathered after a forward (the backward would gather
    them again); a model without backward should be `reshard`-ed after its passes, or its
    root's (embedding, head) weights stay whole on every rank.
    """
    return _fully_shard(model, group, device, offload=offload)


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered parameter of an FSDP2 `model` (a no-op for a plain module)."""
    _resharded(model)


def _fully_shard(model: torch.nn.Module, group: ProcessGroup, device: str, *, offload: bool,
                 **kwargs: Any) -> torch.nn.Module:
    """`fully_shard` on each decoder layer, then the root, over `group`'s mesh on `device`."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device_type=device)
    if offload:
        # Pinned host memory makes the device copies asynchronous; it exists on CUDA only.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")
    # transformers decoders keep their blocks in `model.model.layers` (Qwen2, Llama, ...).
    trunk = getattr(model, "model", None)
    for layer in getattr(trunk, "layers", []):
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast `model`'s parameters (not its buffers) to `dtype` in place; returns the model.

    Buffers keep their dtype as they do under `MixedPrecisionPolicy`, which casts only
    parameters: e.g. the rotary `inv_freq` stays fp32, so a bf16 engine or reference computes
    the same function as the bf16 actor. Tied parameters are one object, cast once.
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


def _resharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every FSDP unit holding its sharded (master) parameters.

    FSDP2 does not reshard the root after a forward (backward would gather it again at once),
    so after a no-grad forward the root's parameters are the gathered ones — whole, and in
    the compute dtype under mixed precision. Reading state then would see those instead of
    the fp32 shards; resharding first is a no-op when nothing is gathered.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter (the whole tensor when not sharded)."""
    return {name: (p.to_local() if _is_dtensor(p) else p).detach()
            for name, p in _resharded(model).named_parameters()}


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (an all-gather per sharded parameter), on CPU."""
    out = {}
    model = _resharded(model)
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


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                directory: str | Path) -> None:
    """Write this rank's shards of `model` and `optimizer` under `directory` (created).

    Call on every rank of the role at once: DCP plans the files over the process group (the
    default one of a Ray worker). The tensors written are the rank's own (FSDP2 shards, the
    whole parameters of an unsharded model): `get_state_dict`'s default, sharded, form.
    """
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    # Frozen parameters (a LoRA actor's base weights) are not saved: the run rebuilds them.
    weights, optim = get_state_dict(_resharded(model), optimizer, options=_trained_only(model))
    with _dcp_quiet():
        save(weights, checkpoint_id=directory / MODEL_DIR, no_dist=not _distributed())
        save(optim, checkpoint_id=directory / OPTIM_DIR, no_dist=not _distributed())


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                directory: str | Path) -> None:
    """Put the shards `save_shards` wrote back into `model` (sharded as when it was saved)
    and `optimizer`, every rank at once. Bit-exact: each rank reads its own pieces' bytes."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(directory)
    model = _resharded(model)
    # The targets (shapes and placements): the trained parameters, as `save_shards` wrote.
    weights, optim = get_state_dict(model, optimizer, options=_trained_only(model))
    with _dcp_quiet():
        load(weights, checkpoint_id=directory / MODEL_DIR, no_dist=not _distributed())
        load(optim, checkpoint_id=directory / OPTIM_DIR, no_dist=not _distributed())
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim,
                   options=_trained_only(model))


def _trained_only(model: torch.nn.Module) -> Any:
    """DCP's options for a checkpoint of the trained parameters only. Strict unless some
    parameters are frozen (they are absent from the checkpoint by design)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    strict = all(p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def _distributed() -> bool:
    """Whether this process joined a default process group (a Ray worker of a role that has
    one). A role without one (one fp32 rank; the in-process backend, whose groups are not
    the default one and which runs dp = 1) saves and loads as a single process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextmanager
def _dcp_quiet() -> Iterator[None]:
    """DCP warns on every save and load without a process group that it assumes one process:
    for a role without a group that is what is meant, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
