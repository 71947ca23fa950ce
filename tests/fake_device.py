"""Chapter 5 test helper — a fake second device, so CPU-only tests catch device mix-ups.

No GPU runs the test suite, yet on a GPU every op that mixes a CUDA tensor with a CPU one
fails (``logits.gather(1, cpu_index)``, a loss over a CPU mask). This module makes such
mistakes fail on the CPU too. Inside ``with FakeDevice():``

- ``t.to(FAKE)``, and any factory called with ``device=FAKE`` (``torch.zeros(..., device=...)``,
  ``torch.arange``), give an `OnFakeDevice` tensor: a wrapper that holds ordinary CPU data,
  computes with it bit for bit as the CPU does, but reports ``FAKE`` as its device;
- an op whose inputs mix `OnFakeDevice` tensors with plain CPU tensors raises
  `DeviceMixError`, naming the op — as CUDA would. Zero-dimensional CPU tensors may mix, as
  they may with CUDA tensors (a Python scalar made tensor);
- ``t.to("cpu")`` (``t.cpu()``) gives the plain CPU tensor back, so a result can be compared
  with an all-CPU run exactly and checked to hold plain CPU tensors only (`is_plain_cpu`).

``FAKE`` is the ``meta`` device: its type is neither "cpu" nor "cuda", so code that guards a
CUDA-only call with ``device.type == "cuda"`` (``torch.cuda.empty_cache``, NCCL) skips it, and
autograd runs the backward of meta tensors on its CPU queue. (Real meta tensors have no data;
these do.) A model is moved there with ``model.to(FAKE)`` inside the context.

Not here: streams, memory accounting, random generators, or anything a real accelerator does
beyond refusing to mix devices. Two differences to know:

- stricter than CUDA: CUDA lets a CPU tensor index a CUDA one, this refuses it (such an index
  costs a copy per call, so it is a mistake worth seeing);
- ``p.data = new`` on an `OnFakeDevice` tensor changes its reported shape but not the data it
  holds (a wrapper keeps its own Python attribute); in-place writes (``copy_``) work.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("meta")
"""The device an `OnFakeDevice` tensor reports."""


class DeviceMixError(RuntimeError):
    """An op was given tensors on the fake device and plain CPU tensors together."""


class OnFakeDevice(torch.Tensor):
    """A CPU tensor (`held`) that says it lives on `FAKE`. Made by `FakeDevice`, not by hand."""

    held: torch.Tensor

    @staticmethod
    def __new__(cls, held: torch.Tensor) -> OnFakeDevice:
        out = torch.Tensor._make_wrapper_subclass(
            cls, held.shape, strides=held.stride(), storage_offset=held.storage_offset(),
            dtype=held.dtype, layout=held.layout, device=FAKE,
            requires_grad=held.requires_grad)
        out.held = held
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"OnFakeDevice({self.held!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        return _run(func, args, kwargs or {})


def _is_fake_device(device: Any) -> bool:
    return device is not None and torch.device(device) == FAKE


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run `func` on the held CPU data: refuse a device mix, wrap the outputs when an input
    was on the fake device or `device=FAKE` was asked, unless the op moves to the CPU."""
    flat, _ = tree_flatten((args, kwargs))
    fake = [t for t in flat if isinstance(t, OnFakeDevice)]
    plain = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, OnFakeDevice)
             and t.dim() > 0]
    if fake and plain:
        shapes = [tuple(t.shape) for t in plain]
        raise DeviceMixError(f"{func}: expected all tensors on one device, got tensors on "
                             f"{FAKE} (the fake device) and CPU tensors of shapes {shapes}")
    asked = kwargs.get("device")
    if _is_fake_device(asked):
        kwargs = {**kwargs, "device": torch.device("cpu")}
    to_cpu = asked is not None and not _is_fake_device(asked)
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if to_cpu or not (fake or _is_fake_device(asked)):
        return out
    written = _written_argument(func, args, kwargs)
    if written is not None:
        # An in-place or out= op (add_, copy_, cumsum(out=...)) returns the tensor it wrote
        # into: return that wrapper itself, not a new one around the same data.
        return written
    return tree_map(_wrap, out)


def _written_argument(func: Any, args: tuple, kwargs: dict) -> Any:
    """The argument an op writes into and returns (``self`` of ``add_``, ``out``), or None."""
    schema = func._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            return args[i] if i < len(args) else kwargs.get(arg.name)
    return None


def _unwrap(x: Any) -> Any:
    return x.held if isinstance(x, OnFakeDevice) else x


def _wrap(x: Any) -> Any:
    return OnFakeDevice(x) if isinstance(x, torch.Tensor) else x


class FakeDevice(TorchDispatchMode):
    """The context in which ``.to(FAKE)`` and ``device=FAKE`` make `OnFakeDevice` tensors
    (outside it, ops on tensors already made keep working: the tensors carry the rules)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        return _run(func, args, kwargs or {})


def is_plain_cpu(t: torch.Tensor) -> bool:
    """True for an ordinary CPU tensor (not on the fake device, not any tensor subclass
    but a Parameter)."""
    return t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter)


def not_plain_cpu(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors in (name, tensor) pairs that are not plain CPU tensors."""
    return [name for name, t in tensors if not is_plain_cpu(t)]
