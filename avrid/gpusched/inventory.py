"""Test tooling — the GPUs a scheduled test run may use, read from the ``--gpus`` option.

Three spellings:

- ``0,1,2,3``: GPU ids as CUDA numbers them in this process, that is positions in an outer
  ``CUDA_VISIBLE_DEVICES`` when one is set (``--gpus 0,1`` under ``CUDA_VISIBLE_DEVICES=4,5,6``
  gives a test physical GPU 4 or 5).
- ``all``: every GPU this process may see (the outer ``CUDA_VISIBLE_DEVICES``, else every GPU
  ``nvidia-smi`` lists), each with its free memory.
- ``fake:N`` or ``fake:NxM``: N simulated GPUs (with M GiB free each), ids ``fake0`` ...
  They name no real device, so a test given one sees no CUDA at all: the mode in which the
  scheduler and the plugin run, and are tested, on a CPU-only machine.

Every inventory has 1 to `MAX_GPUS` GPUs. Each scheduled test is a process of this host, so
no real run comes near the bound; it is there so that a typo (``fake:10000000``) is refused at
once, rather than building millions of GPUs and planning over them for minutes, and so that
every inventory that is allowed plans in well under a second.

Free memory comes from ``nvidia-smi --query-gpu=index,memory.free`` in a subprocess. Not here:
CUDA itself. Nothing imports torch or initialises a driver, so every spelling but ``all``
parses on a host with no GPU, and a missing ``nvidia-smi`` only leaves the memory unknown.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=index,memory.free",
                    "--format=csv,noheader,nounits")
"""The one command run to list GPUs and their free memory (MiB)."""

MAX_GPUS = 1024
"""The most GPUs an inventory may have: far above any one host (the tests run as its
processes), low enough that planning over them stays cheap."""

SPELLINGS = "comma-separated ids (e.g. 0,1,2,3), all, or fake:N / fake:NxM (N GPUs, M GiB each)"
"""What ``--gpus`` accepts, as error messages say it."""


class InventoryError(ValueError):
    """A ``--gpus`` value that names no usable GPUs; the message says what is allowed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """One GPU a test may be given (whole: the scheduler never shares a GPU between tests)."""

    id: str
    """How the scheduler, the plan and the summary name it."""
    device: str
    """What a test given this GPU finds in its ``CUDA_VISIBLE_DEVICES``."""
    memory_gb: float | None = None
    """Free memory in GiB when the run started (nvidia-smi's MiB / 1024); None: unknown."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Inventory:
    """The GPUs of one run and how they were named on the command line."""

    gpus: tuple[Gpu, ...]
    spec: str
    """The ``--gpus`` value it was read from."""
    fake: bool = False
    """Simulated GPUs (``fake:N``): tests get ids that name no real device."""

    def __post_init__(self) -> None:
        ids = [g.id for g in self.gpus]
        if not 1 <= len(ids) <= MAX_GPUS:
            raise InventoryError(f"--gpus {self.spec!r} names {len(ids)} GPUs; an inventory "
                                 f"has 1 to {MAX_GPUS}")
        if len(set(ids)) != len(ids):
            raise InventoryError(f"an inventory needs distinct GPU ids, got {ids}")

    def devices(self, ids: tuple[str, ...]) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` value of a test given the GPUs `ids`.

        >>> inv = parse_gpus("1,0", environ={"CUDA_VISIBLE_DEVICES": "6,7"}, query=None)
        >>> inv.devices(("0", "1"))
        '6,7'
        """
        by_id = {g.id: g.device for g in self.gpus}
        return ",".join(by_id[i] for i in ids)


def query_nvidia_smi(*, timeout_s: float = 30.0) -> dict[int, float | None] | None:
    """Free memory (GiB) of every GPU ``nvidia-smi`` lists, by its index; None where there is
    no ``nvidia-smi`` on PATH. Raises `InventoryError` when it is there but fails."""
    if shutil.which(NVIDIA_SMI_QUERY[0]) is None:
        return None
    try:
        run = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise InventoryError(f"{' '.join(NVIDIA_SMI_QUERY)} failed: {err}") from err
    if run.returncode != 0:
        raise InventoryError(f"{' '.join(NVIDIA_SMI_QUERY)} exited with {run.returncode}: "
                             f"{(run.stderr or run.stdout).strip()}")
    return parse_nvidia_smi(run.stdout)


def parse_nvidia_smi(text: str) -> dict[int, float | None]:
    """``index, free MiB`` lines into {index: free GiB}; a value nvidia-smi cannot read
    (``[N/A]``) is None.

    >>> parse_nvidia_smi("0, 81050\\n1, [N/A]\\n")
    {0: 79.150390625, 1: None}
    """
    out: dict[int, float | None] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        index, _, free = (part.strip() for part in line.partition(","))
        if not index.isdigit():
            raise InventoryError(f"unexpected nvidia-smi line {line!r} (wanted 'index, MiB')")
        try:
            out[int(index)] = float(free) / 1024
        except ValueError:
            out[int(index)] = None
    return out


Query = Callable[[], Mapping[int, float | None] | None]


def parse_gpus(spec: str, *, environ: Mapping[str, str] | None = None,
               query: Query | None = query_nvidia_smi) -> Inventory:
    """The inventory named by a ``--gpus`` value (see the module docstring for the spellings).

    `environ` is where an outer ``CUDA_VISIBLE_DEVICES`` is read (os.environ by default);
    `query` lists free memory (nvidia-smi by default; None: never asked, memory unknown).

    >>> [g.id for g in parse_gpus("fake:3").gpus]
    ['fake0', 'fake1', 'fake2']
    >>> parse_gpus("fake:2x16").gpus[0].memory_gb
    16.0
    """
    text = spec.strip()
    if not text:
        raise InventoryError(f"--gpus is empty; give {SPELLINGS}")
    if text.startswith("fake:"):
        return _fake(text)
    env = os.environ if environ is None else environ
    outer = _outer_devices(env)
    if text == "all":
        return _all(text, outer, query)
    return _listed(text, outer, query)


def _fake(text: str) -> Inventory:
    match = re.fullmatch(r"fake:(\d+)(?:x(\d+(?:\.\d*)?))?", text)
    memory = float(match.group(2)) if match and match.group(2) else None
    if not match or (memory is not None and not (math.isfinite(memory) and memory > 0)):
        raise InventoryError(f"--gpus {text!r}: a simulated inventory is fake:N or fake:NxM "
                             f"with 1 <= N <= {MAX_GPUS} GPUs and M > 0 GiB each (e.g. "
                             f"fake:8, fake:4x80)")
    count = match.group(1).lstrip("0")
    # Checked before anything is built, and by its length first (int() refuses a number of
    # over 4,300 digits): fake:10000000 is a typo, not ten million GPUs to plan on.
    if not count or len(count) > len(str(MAX_GPUS)) or int(count) > MAX_GPUS:
        raise InventoryError(f"--gpus {text!r}: {match.group(1)} simulated GPUs; allowed: "
                             f"1 <= N <= {MAX_GPUS} (e.g. fake:8, fake:4x80)")
    # "fake3" is no CUDA device: a test that does look for CUDA finds none, rather than
    # sharing a real GPU with every other test the simulation runs at the same time.
    return Inventory(gpus=tuple(Gpu(id=f"fake{i}", device=f"fake{i}", memory_gb=memory)
                                for i in range(int(count))), spec=text, fake=True)


def _outer_devices(environ: Mapping[str, str]) -> list[str] | None:
    """The entries of an outer ``CUDA_VISIBLE_DEVICES`` (None: not set, every GPU visible)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def _memory(device: str, free: Mapping[int, float | None] | None) -> float | None:
    """Free GiB of the GPU a device entry names (a UUID or MIG name: unknown)."""
    if free is None or not device.isdigit():
        return None
    return free.get(int(device))


def _all(text: str, outer: list[str] | None, query: Query | None) -> Inventory:
    free = query() if query is not None else None
    if outer is not None:  # only what this process may see, numbered as CUDA numbers it
        if not outer:
            raise InventoryError("--gpus all: CUDA_VISIBLE_DEVICES is set and empty, so no "
                                 "GPU is visible; unset it, or simulate with --gpus fake:N")
        return Inventory(gpus=tuple(Gpu(id=str(i), device=d, memory_gb=_memory(d, free))
                                    for i, d in enumerate(outer)), spec=text)
    if free is None:
        raise InventoryError("--gpus all needs nvidia-smi on PATH to list the GPUs, and there "
                             "is none; name them (--gpus 0,1) or simulate them (--gpus fake:8)")
    if not free:
        raise InventoryError("--gpus all: nvidia-smi lists no GPU; simulate with --gpus fake:N")
    return Inventory(gpus=tuple(Gpu(id=str(i), device=str(i), memory_gb=m)
                                for i, m in sorted(free.items())), spec=text)


def _listed(text: str, outer: list[str] | None, query: Query | None) -> Inventory:
    ids = [part.strip() for part in text.split(",")]
    # ASCII digits only (str.isdigit also takes "²", which int() refuses), and few of them.
    bad = [i for i in ids if not (i.isascii() and i.isdigit() and len(i) <= 6)]
    if bad:
        raise InventoryError(f"--gpus {text!r}: {bad[0]!r} is not a GPU id; give {SPELLINGS}")
    if len(set(map(int, ids))) != len(ids):
        raise InventoryError(f"--gpus {text!r} names a GPU twice")
    if outer is not None:
        high = [i for i in ids if int(i) >= len(outer)]
        if high:
            raise InventoryError(
                f"--gpus {text!r}: id {high[0]} is out of range: CUDA_VISIBLE_DEVICES="
                f"{','.join(outer)} makes {len(outer)} GPU(s) visible, ids 0..{len(outer) - 1}")
    devices = [outer[int(i)] if outer is not None else str(int(i)) for i in ids]
    free = query() if query is not None else None
    if free is not None and outer is None:
        missing = [d for d in devices if int(d) not in free]
        if missing:
            raise InventoryError(f"--gpus {text!r}: nvidia-smi lists no GPU {missing[0]} "
                                 f"(it lists {sorted(free)})")
    gpus = tuple(Gpu(id=str(int(i)), device=d, memory_gb=_memory(d, free))
                 for i, d in zip(ids, devices, strict=True))
    return Inventory(gpus=gpus, spec=text)
