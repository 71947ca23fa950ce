"""Chapter 1 — how torch tensors cross between Ray processes in avrid's calls: as raw bytes.

Every shard the driver sends and every result a worker returns is full of tensors. Left to
itself, pickling a tensor goes through torch's own reduction: ``torch.save`` of its storage,
into a fresh in-band byte string, costing ~0.5 ms of Python per tensor whatever its size —
on a small model that is most of a call's overhead. A numpy array instead pickles (protocol 5)
as a small header plus its raw buffer *out of band*, which Ray copies straight into the object
store. So `reduce_tensor` sends a CPU tensor as (its numpy view, its dtype, requires_grad) and
rebuilds it on the other side. A small tensor (up to `INBAND_BYTES`) goes as plain bytes inside
the pickle instead: Ray's record for each out-of-band buffer costs more than copying a few
kilobytes.

Rules it keeps:
- bit-for-bit: the bytes are the tensor's bytes; dtypes numpy lacks (bfloat16, float8) travel
  as the unsigned integer of their width and are viewed back;
- only a view's own elements travel (torch's reduction sends the whole underlying storage), so
  a transposed or channels-last tensor arrives contiguous, with the same values;
- the receiver gets an ordinary writable tensor: Ray hands out read-only, shared buffers, so
  one copy is made on receipt (a memcpy, not a pickle);
- anything else (a GPU, sparse, quantized or meta tensor, a tensor subclass such as
  `nn.Parameter`) keeps torch's own reduction, untouched.

It is a rule for avrid's own pickler only: `call_wire` puts `reduce_tensor` in the dispatch
table of the pickler it packs each call with. Nothing is registered with Ray, whose serializer
is process-wide and outlives a run (even ``ray.shutdown()``): tensors the user's own Ray tasks
send, in the same process or in avrid's workers, keep plain Ray's behaviour, and a serializer
the user registered for ``torch.Tensor`` (or Ray's ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``,
which hands out read-only tensors and drops ``requires_grad``) stays theirs.

Not here: what is sent (chapter 2's shards, chapter 3's results), how a call is packed
(`call_wire`) or Ray's object store itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_UINT_OF_SIZE = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
INBAND_BYTES = 64 * 1024
"""Tensors up to this size travel as bytes inside the pickle; larger ones as a numpy buffer
out of band (Ray copies it into the object store without pickling it)."""


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
    """The pickle reduction of a tensor by these rules, for a pickler of one's own: put it in
    that pickler's ``dispatch_table`` (as `call_wire` does), never in Ray's serializer."""
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

