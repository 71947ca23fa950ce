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
  large batch is not copied into the pickle. The rule lives in this pickler's own
  ``dispatch_table``, not in Ray: the user's own Ray code pickles tensors as it always did;
- what must go Ray's ordinary way goes there, unchanged (`pack` returns None; the worker's
  reply is still packed): a Ray handle (an ObjectRef — Ray resolves those only among a
  call's own arguments, and counts references while pickling them — or an actor handle), a
  lambda, a local class; and a class or function the C pickler would send *by name* where
  the worker cannot look that name up: one of ``__main__`` (a script's or a notebook's; a
  Ray worker's ``__main__`` is Ray's own) or of a module registered with
  ``ray.cloudpickle.register_pickle_by_value``. cloudpickle sends those by value;
- a value stored once for several ranks (`Stored`, from `RayBackend`'s ``put``) is packed
  the same way before it goes into Ray's object store;
- what cannot be unpickled where it arrives is a `WireError` naming the class or function
  that could not be found there and, for arguments, saying the method did not run.

Not here: which shard goes to which rank (chapter 2) or how results merge (chapter 3).
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
from dataclasses import dataclass
from types import FunctionType, MappingProxyType
from typing import Any

import numpy as np
from ray import cloudpickle

from avrid.workers.tensor_wire import reduce_tensor


class WireError(RuntimeError):
    """A call's arguments (or its result) could not be unpickled where they arrived; the
    message names the class or function that could not be found there."""


class _NotPlain(Exception):
    """Raised while pickling a value that must go Ray's ordinary way (a Ray handle, code the
    worker must get by value)."""


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


class _CallPickler(pickle.Pickler):
    """The standard library's C pickler with this file's reduction rules, refusing (with
    `_NotPlain`) a class or function it would send by name that a worker cannot look up by
    that name: one of ``__main__`` (a Ray worker's ``__main__`` is Ray's own), or of a module
    registered with ``ray.cloudpickle.register_pickle_by_value`` (and its submodules)."""

    def __init__(self, out: io.BytesIO, buffers: list[pickle.PickleBuffer]) -> None:
        super().__init__(out, protocol=5, buffer_callback=buffers.append)
        self.dispatch_table = _dispatch_table()
        self._by_value = tuple(cloudpickle.list_registry_pickle_by_value())  # usually empty

    def reducer_override(self, obj: Any) -> Any:
        # Called once per object that is not a number, string or built-in container (a
        # shard has ~40): cheap next to pickling, and independent of how many bytes it holds.
        if isinstance(obj, (type, FunctionType)):
            module = getattr(obj, "__module__", None) or ""
            if module == "__main__" or any(module == name or module.startswith(name + ".")
                                           for name in self._by_value):
                raise _NotPlain(f"{module}.{obj.__qualname__}")
        return NotImplemented  # everything else: the C pickler's own rules


def pack(value: Any) -> tuple[bytes, list[np.ndarray]] | None:
    """`value` pickled: the byte string and its out-of-band buffers (large tensors' bytes,
    as flat uint8 arrays). None if it must go Ray's ordinary way: it holds a Ray handle,
    something the C pickler cannot carry, or code the worker can only get by value."""
    out = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    try:
        _CallPickler(out, buffers).dump(value)
    except (_NotPlain, pickle.PicklingError, TypeError, AttributeError):
        # A Ray handle, a lambda, a local class, code from __main__: Ray's cloudpickle copes.
        return None
    return out.getvalue(), [np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers]


class _NameFinder(pickle.Unpickler):
    """An unpickler that remembers the class or function it could not look up (run only
    after a failure, to say what was missing)."""

    missing = ""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except Exception:
            self.missing = f"{module}.{name}"
            raise


def unpack(blob: bytes, buffers: tuple[Any, ...] | list[Any] = (), *,
           failure: str = "a value could not be unpickled here") -> Any:
    """The value `pack` pickled, from its byte string and out-of-band buffers.

    Raises:
        WireError: it cannot be unpickled in this process (say, a class or function it
            refers to by name cannot be imported here): `failure`, then the name that could
            not be found and the error.
    """
    try:
        return pickle.loads(blob, buffers=buffers)
    except Exception as exc:
        finder = _NameFinder(io.BytesIO(blob), buffers=buffers)
        try:  # again, slowly, to learn which name was missing
            finder.load()
        except Exception:
            pass
        cause = f"{type(exc).__name__}: {exc}"
        if finder.missing:
            cause = f"`{finder.missing}` cannot be found here ({cause})"
        raise WireError(
            f"{failure}: {cause}. A class or function crosses by name: its module must be "
            f"importable on both sides, or registered with "
            f"ray.cloudpickle.register_pickle_by_value(module) to be sent by value"
        ) from exc


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A reply that could not be packed (it holds a Ray handle, say): Ray pickles it."""

    value: Any


@dataclass(frozen=True, slots=True)
class Stored:
    """A value packed before it went into Ray's object store (`_RayChannel.put`): the worker
    that receives it as an argument unpacks it (`unstore`)."""

    blob: bytes
    buffers: list[np.ndarray]


def unstore(value: Any, *, failure: str = "a stored value could not be unpickled") -> Any:
    """`value`, or the value a `Stored` stands for (`unpack` says what `failure` means)."""
    if isinstance(value, Stored):
        return unpack(value.blob, value.buffers, failure=failure)
    return value


def pack_result(value: Any) -> bytes | tuple[bytes, list[np.ndarray]] | Unpacked:
    """A worker's reply: the pickled bytes alone when no tensor went out of band (Ray's
    cheapest return), the bytes and the buffers when some did, `Unpacked` when `value`
    cannot go as plain bytes."""
    packed = pack(value)
    if packed is None:
        return Unpacked(value)
    return packed[0] if not packed[1] else packed


def unpack_result(reply: bytes | tuple[bytes, list[Any]] | Unpacked) -> Any:
    """The value a `pack_result` reply stands for (`WireError` if it cannot be unpickled
    here)."""
    if isinstance(reply, Unpacked):
        return reply.value
    blob, buffers = (reply, ()) if isinstance(reply, bytes) else reply
    return unpack(blob, buffers, failure="the result could not be unpickled on the driver")
