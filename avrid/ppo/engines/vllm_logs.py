"""Chapter 5 — vLLM's own output, kept off the screen while avrid's engine runs.

Building and driving a ``vllm.LLM`` prints dozens of lines that are not news to a user of
avrid: its config at INFO, CPU-build warnings (no Triton, no tcmalloc in ``LD_PRELOAD``), a
"Chat template warmup failed" traceback that only says there is no tokenizer (there is
none on purpose: prompts are token ids), FutureWarnings from torch about vLLM's code.
`quiet_vllm` is the scope `vllm_engine.VllmEngine` runs all of its work in. Inside it:

- ``VLLM_LOGGING_LEVEL=ERROR`` is set: vLLM reads it when it configures its logging while
  the engine is built (and the processes it starts for tensor parallelism inherit it);
- the ``vllm`` logger is at ERROR: for what vLLM logs before it has configured itself (at
  import, e.g. "Triton is installed, but doesn't include CPU backend");
- Python warnings raised from vLLM's modules are ignored.

On the way out the variable, the logger's level and the warning filters are put back as
they were: avrid is a guest in the process. (vLLM's own handler keeps the level it was
configured with while the engine was built, which keeps its later lines quiet too; a
``vllm.LLM`` the user builds reconfigures it from their settings.)

Nothing is hidden when the user asked to see it: avrid's ``--debug`` (``AVRID_DEBUG=1``,
which Ray workers inherit from the driver) or their own ``VLLM_LOGGING_LEVEL`` or
``VLLM_LOGGING_CONFIG_PATH``. Errors always show.

`QuietVllmSink` is chapter 4's sink inside the same scope.

Not here: the engine (`vllm_engine`). What this cannot silence: lines that vLLM's C++
code prints through torch's C++ logger (one "NUMA binding" warning per engine on the CPU
build), since torch reads that logger's level once, at process start
(``TORCH_CPP_LOG_LEVEL``), and changing it there would hide every C++ warning of the
process. vLLM is never imported here.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from avrid.reshard.engines import VllmSink
from avrid.reshard.layout import ModelLayout

USER_SETTINGS = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH")
"""vLLM's variables that say the user chose vLLM's logging: with either set, avrid keeps out."""


def vllm_logs_wanted() -> bool:
    """Whether vLLM's own output should show: ``AVRID_DEBUG`` set (``avrid ppo --debug``) or
    the user's own vLLM logging settings (`USER_SETTINGS`) in the environment."""
    if os.environ.get("AVRID_DEBUG", "") not in ("", "0"):
        return True
    return any(name in os.environ for name in USER_SETTINGS)


@contextmanager
def quiet_vllm() -> Iterator[None]:
    """Run the body with vLLM's logging at ERROR and vLLM's Python warnings ignored, unless
    `vllm_logs_wanted`; everything changed is restored on the way out, even on an error.

    Inside another `quiet_vllm`, ``VLLM_LOGGING_LEVEL`` is already set (by the outer one),
    so the inner one changes nothing and the outer one restores.

    Example:
        >>> import logging
        >>> with quiet_vllm():
        ...     shown = logging.getLogger("vllm").getEffectiveLevel() < logging.ERROR
        >>> shown == vllm_logs_wanted()
        True
    """
    if vllm_logs_wanted():
        yield
        return
    vllm_logger = logging.getLogger("vllm")  # the parent of every vllm.* module's logger
    level = vllm_logger.level
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    vllm_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            # `module` is matched against the module the warning is reported from, which for
            # a deprecation inside torch is the vLLM line that touched the deprecated name.
            warnings.filterwarnings("ignore", module=r"vllm(\.|$)")
            yield
    finally:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
        vllm_logger.setLevel(level)


class QuietVllmSink(VllmSink):
    """Chapter 4's `VllmSink` with every call inside `quiet_vllm`, like the engine's own
    methods: the weight sync calls the sink directly (`VllmEngine.sink`), not through the
    engine, and vLLM logs while it loads (e.g. "RotaryEmbedding: Failed to load weights",
    harmless: the rotary table is computed when the engine is built and is kept)."""

    def load(self, tensors: Mapping[str, torch.Tensor], *, layout: ModelLayout | None = None,
             rank: int | None = None) -> None:
        with quiet_vllm():
            super().load(tensors, layout=layout, rank=rank)

    def load_stream(self, groups: Iterable[Mapping[str, torch.Tensor]]) -> None:
        with quiet_vllm():
            super().load_stream(groups)

    def finish(self) -> None:
        with quiet_vllm():
            super().finish()

    def checksums(self, layout: ModelLayout | None, rank: int | None = None) -> dict[str, int]:
        with quiet_vllm():
            return super().checksums(layout, rank)
