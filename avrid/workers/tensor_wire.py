"""Chapter 1 — how torch tensors cross between Ray processes: as numpy buffers.

Every shard the driver sends and every result a worker returns is full of tensors. Left to
itself, pickling a tensor goes through torch's own reduction: ``torch.save`` of its storage,
into a fresh in-band byte string, costing ~0.5 ms of Python per tensor whatever its size —
on a small model that is most of a call's overhead. A numpy array instead pickles (protocol 5)
as a small header plus its raw buffer *out of band*, which Ray copies straight into the object
store. So `register_tensor_wire` tells Ray's serializer, in this process, to send a CPU tensor
as (its numpy view, its dtype, requires_grad) and to rebuild it on the other side. A small
tensor (up to `INBAND_BYTES`) goes as plain bytes inside the pickle instead: Ray's record
for each out-of-band buffer costs more than copying a few kilobytes.

Rules it keeps:
- bit-for-bit: the bytes are the tensor's bytes; dtypes numpy lacks (bfloat16, float8) travel
  as the unsigned integer of their width and are viewed back;
- only a view's own elements travel (torch's reduction sends the whole underlying storage);
- the receiver gets an ordinary writable tensor: Ray hands out read-only, shared buffers, so
  one copy is made on receipt (a memcpy, not a pickle);
- anything else (a GPU, sparse, quantized or meta tensor, a tensor subclass such as
  `nn.Parameter`) keeps torch's own reduction, untouched.

Ray's own switch for this (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``) is not used: it hands out
read-only tensors over the object store's shared memory (a write corrupts them) and drops
``requires_grad``. The registration is per process (Ray keeps it in cloudpickle's dispatch
table): the driver registers at launch, each actor when it starts — or, if it had not
imported torch yet, when the first tensor reaches it.

Not here: what is sent (chapter 2's shards, chapter 3's results) or Ray's object store itself.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import ray

_UINT_OF_SIZE = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
INBAND_BYTES = 64 * 1024
"""Tensors up to this size travel as bytes inside the pickle; larger ones as a numpy buffer
out of band (Ray copies it into the object store without pickling it)."""
_registered = False  # in this process (cloudpickle's dispatch table is process-wide)


def _to_wire(t: Any) -> tuple[Any, ...]:
    """A tensor as a picklable tuple: ("np", array, dtype name, requires_grad) for a plain
    CPU tensor, ("torch", bytes) for anything else."""
    import torch

    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return ("torch", _torch_bytes(t))
    dtype = str(t.dtype).removeprefix("torch.")
    flat = t.detach().resolve_conj().resolve_neg().contiguous()
    try:
        array = flat.numpy()
    except TypeError:  # no numpy dtype (bfloat16, float8 ...): the raw bits, as uints
        array = flat.view(getattr(torch, _UINT_OF_SIZE[flat.element_size()])).numpy()
    if array.nbytes <= INBAND_BYTES:
        # Small: its bytes inside the pickle. Ray keeps a bookkeeping record per out-of-band
        # buffer, which costs more than copying a few kilobytes (a shard has ~20 columns).
        return ("bytes", array.tobytes(), dtype, tuple(t.shape), t.requires_grad)
    return ("np", array, dtype, t.requires_grad)


def _from_wire(wire: tuple[Any, ...]) -> Any:
    """The tensor `_to_wire` described, writable and owning its memory."""
    import torch

    if not _registered:  # a process that imported torch late: its replies go by wire too
        register_tensor_wire()

    if wire[0] == "torch":
        return _torch_load(wire[1])
    if wire[0] == "bytes":
        _, raw, dtype, shape, requires_grad = wire
        kind = getattr(torch, dtype)
        # bytearray: a writable copy for the tensor to own (frombuffer shares its memory).
        tensor = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind).reshape(shape)
                  if raw else torch.empty(shape, dtype=kind))
        return tensor.requires_grad_(requires_grad)
    _, array, dtype, requires_grad = wire
    # Ray's zero-copy arrays are read-only views of shared memory: copy once, so that the
    # receiver may write into the tensor like into any other.
    tensor = torch.from_numpy(np.array(array, copy=True)).view(getattr(torch, dtype))
    return tensor.requires_grad_(requires_grad)


def reduce_tensor(t: Any) -> tuple[Any, ...]:
    """The pickle reduction of a tensor by these rules, for a pickler of one's own
    (`call_wire` packs a call's arguments with the standard library's)."""
    return _from_wire, (_to_wire(t),)


def _torch_bytes(t: Any) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getvalue()


def _torch_load(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def register_tensor_wire() -> bool:
    """Send plain CPU tensors as numpy buffers from this process (the driver, or an actor
    just started); returns whether it did. Only where torch is already imported: a process
    that never imported it has no tensors to send, and importing torch costs seconds."""
    global _registered
    if "torch" not in sys.modules or not ray.is_initialized():
        return False
    import torch

    ray.util.register_serializer(torch.Tensor, serializer=_to_wire, deserializer=_from_wire)
    _registered = True
    return True
