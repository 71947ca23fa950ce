"""Chapter 1 — a call's arguments and its result cross Ray as one byte string each way.

Ray serialises every argument and return value of an actor call itself. For an object it
runs its own pickling pass (cloudpickle, with a Python hook per object and a record per
out-of-band buffer), and the receiving process runs the matching pass; a `bytes` value it
passes through almost untouched. So the Ray backend pickles a call's arguments itself, with
the standard library's C pickler (~0.04 ms for a 10 KB shard), and sends::

    actor._wire_call.remote("compute_logprobs", blob, *buffers)

The worker unpickles them, runs ``self.compute_logprobs(*args, **kwargs)`` and returns the
result packed the same way; the driver unpickles it (`Worker._wire_call`,
`ray_backend._RayChannel`). Measured on the tiny-ppo log-prob call (2 ranks, 2 cores): its
cost beyond compute went from ~5.5 to ~5.2 ms. Nothing else changes: the method, its
arguments and its result are the same objects on both sides, and an exception raised in
the method reaches the driver exactly as before.

Rules it keeps:
- tensors cross as `tensor_wire` sends them (bit-for-bit, writable on receipt): a small one as
  bytes inside the pickle; a large one's bytes *out of band*, passed to Ray as an argument
  of their own, a numpy array Ray copies into its object store without pickling it — so a
  large batch is not copied into the pickle;
- what the C pickler cannot carry goes Ray's ordinary way, unchanged (`pack` returns None):
  a Ray handle (an ObjectRef — Ray resolves those only among a call's own arguments, and
  counts references while pickling them — or an actor handle), a lambda, a local class.

Not here: which shard goes to which rank (chapter 2) or how results merge (chapter 3).
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from avrid.workers.tensor_wire import reduce_tensor


class _NotPlain(Exception):
    """Raised while pickling a value that must go Ray's ordinary way (a Ray handle)."""


def _refuse(value: object) -> Any:
    raise _NotPlain(type(value).__name__)


def _read_only(items: dict[Any, Any]) -> MappingProxyType:
    return MappingProxyType(items)


def _reduce_mappingproxy(value: MappingProxyType) -> tuple[Any, ...]:
    # Frozen dataclasses here hold read-only dicts; the C pickler has no rule for them (and
    # cannot name their type, which lives nowhere it could import it from).
    return _read_only, (dict(value),)


def _dispatch_table() -> dict[type, Any]:
    """Reduction rules on top of the standard ones; torch and Ray only where imported (a
    process that never imported them has none of their objects to send)."""
    table: dict[type, Any] = {**copyreg.dispatch_table, MappingProxyType: _reduce_mappingproxy}
    if "torch" in sys.modules:
        import torch

        table[torch.Tensor] = reduce_tensor
    if "ray" in sys.modules:
        import ray

        table[ray.ObjectRef] = _refuse
        table[ray.actor.ActorHandle] = _refuse
    return table


def pack(value: Any) -> tuple[bytes, list[np.ndarray]] | None:
    """`value` pickled: the byte string and its out-of-band buffers (large tensors' bytes,
    as flat uint8 arrays). None if it holds something that must go Ray's ordinary way."""
    out = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=buffers.append)
    pickler.dispatch_table = _dispatch_table()
    try:
        pickler.dump(value)
    except (_NotPlain, pickle.PicklingError, TypeError, AttributeError):
        return None  # a Ray handle, a lambda or a local class: Ray's own pickling copes
    return out.getvalue(), [np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers]


def unpack(blob: bytes, buffers: tuple[Any, ...] | list[Any] = ()) -> Any:
    """The value `pack` pickled, from its byte string and out-of-band buffers."""
    return pickle.loads(blob, buffers=buffers)


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A reply that could not be packed (it holds a Ray handle, say): Ray pickles it."""

    value: Any


def pack_result(value: Any) -> bytes | tuple[bytes, list[np.ndarray]] | Unpacked:
    """A worker's reply: the pickled bytes alone when no tensor went out of band (Ray's
    cheapest return), the bytes and the buffers when some did, `Unpacked` when `value`
    cannot go as plain bytes."""
    packed = pack(value)
    if packed is None:
        return Unpacked(value)
    return packed[0] if not packed[1] else packed


def unpack_result(reply: bytes | tuple[bytes, list[Any]] | Unpacked) -> Any:
    """The value a `pack_result` reply stands for."""
    if isinstance(reply, Unpacked):
        return reply.value
    return unpack(reply) if isinstance(reply, bytes) else unpack(*reply)
