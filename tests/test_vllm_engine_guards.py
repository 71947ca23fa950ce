"""`VllmEngine`'s refusals that come before vLLM builds anything: a second engine in a
process whose torch.distributed world has several ranks (vLLM cuts its groups from that world,
so a rank rebuilding alone would hang), an unknown seed mode, batch seeding across processes,
a vLLM release other than the supported one, a user's V2 model runner; and the variables the
engine is built under (the V1 model runner on every platform), put back afterwards.

The first tests fake the world's size, the installed version or the ``vllm`` module itself
and run without vllm installed; the last two build real engines on two ranks (gloo with
vLLM's CPU build, NCCL on two GPUs) and rebuild on one.
Not here: what the engine generates (tests/test_ppo_vllm.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import types
from datetime import timedelta
from pathlib import Path

import pytest

from avrid.ppo.engines import vllm_engine, vllm_process
from avrid.ppo.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.chapter(5)


def test_a_second_engine_in_a_world_of_several_ranks_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(VllmEngine, "_built_in_world", 2)  # this rank built one, over 2 ranks
    for world in (2, 1):  # the world still up, or torn down by the first engine's close()
        monkeypatch.setattr(vllm_engine, "distributed_world_size", lambda w=world: w)
        with pytest.raises(RuntimeError, match=r"already built in this process, over its "
                                               r"torch.distributed world of 2 ranks: .*every "
                                               r"rank must build its engine at once"):
            VllmEngine("/nonexistent", max_model_len=64)


def test_engines_built_without_a_world_may_be_built_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Built with no world (or a world of one): no group to wait on, so the guard lets it
    # through to the next check (a bad seed mode, refused before vllm is imported).
    monkeypatch.setattr(vllm_engine, "distributed_world_size", lambda: 1)
    monkeypatch.setattr(VllmEngine, "_built_in_world", 1)
    with pytest.raises(ValueError, match="unknown seed_mode 'step'"):
        VllmEngine("/nonexistent", max_model_len=64, seed_mode="step")


def test_batch_seeding_needs_one_process() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        VllmEngine("/nonexistent", max_model_len=64, seed_mode="batch", tensor_parallel_size=2)


def test_another_vllm_release_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_process, "installed_vllm_version", lambda: "0.33.0")
    with pytest.raises(RuntimeError) as caught:
        VllmEngine("/nonexistent", max_model_len=64)
    message = str(caught.value)
    assert message == ("vLLM 0.33.0 is installed, but avrid supports vLLM 0.32 only (it uses "
                       "that release's internals): pip install 'vllm==0.32.*'")
    assert "\n" not in message


class Built(Exception):
    """Raised by the fake ``vllm.LLM`` with the vLLM variables it was built under."""

    def __init__(self, environ: dict[str, str]) -> None:
        super().__init__("built")
        self.environ = environ


def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``vllm`` module whose ``LLM`` raises `Built` with the ``VLLM_*`` variables of
    os.environ: what vLLM would read while the engine is built (its version is the supported
    one; its platform a CPU without sleep mode)."""
    def llm(**kwargs: object) -> None:
        raise Built({name: os.environ[name] for name in os.environ if name.startswith("VLLM_")})

    module = types.ModuleType("vllm")
    module.__version__ = f"{vllm_process.SUPPORTED_VLLM}.0"  # type: ignore[attr-defined]
    module.LLM = llm  # type: ignore[attr-defined]
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_cpu=lambda: True, is_sleep_mode_available=lambda: False, device_type="cpu")
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)


def test_the_engine_is_built_with_the_v1_model_runner_and_the_variables_put_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 runs its V2 model runner by default on CUDA, where a request without a seed
    is sampled from NumPy's global RNG, so ``seed_mode=batch`` (torch's RNG) would do
    nothing there; the CPU build runs V1. The engine asks for V1 everywhere."""
    fake_vllm(monkeypatch)
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")  # the user's: kept
    with pytest.raises(Built) as built:
        VllmEngine("/nonexistent", max_model_len=64, seed_mode="batch")
    seen = built.value.environ
    assert seen.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
    assert seen.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    assert seen.get("VLLM_CPU_OMP_THREADS_BIND") == "0-3"
    # avrid is a guest in the process: nothing it set stays set.
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


def test_a_user_v2_model_runner_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(RuntimeError, match=r"^VLLM_USE_V2_MODEL_RUNNER is set to '1'; "
                                           r"VllmEngine needs '0' \(unset it or set 0\)"):
        VllmEngine("/nonexistent", max_model_len=64)


def _rank(rank: int, backend: str, devices: list[str], init_file: str, model_dir: str,
          results: mp.Queue) -> None:
    """One rank: join a world of two, build an engine with the other rank, close it, then
    (rank 0 only) try to build another alone."""
    if backend == "nccl":
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[rank]  # before CUDA starts here
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    kwargs = {"max_model_len": 64, "dtype": "float32", "load_format": "dummy"}
    if backend == "nccl":
        kwargs.update(gpu_memory_utilization=0.3, enforce_eager=True)
    VllmEngine(model_dir, **kwargs).close()  # both ranks at once: allowed
    if rank == 0:
        try:
            VllmEngine(model_dir, **kwargs).close()
            results.put("built a second engine")
        except RuntimeError as err:
            results.put(str(err))


def rebuild_on_one_rank(tmp_path: Path, backend: str) -> str:
    """What rank 0 gets when it builds a second engine alone, after both ranks built one.
    Before the guard it built one: on a world of its own, the trainer's destroyed by the
    first engine's close() (measured on CPU), or, with the world still up, hung in
    ``new_group``."""
    from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy

    spec = TinyModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                         num_heads=2, num_kv_heads=2, max_positions=256)
    build_tiny_policy(spec, seed=0, pad_token_id=0).save_pretrained(tmp_path / "model")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else ["0", "1"]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, backend, devices, str(tmp_path / "rdv"),
                                             str(tmp_path / "model"), results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.vllm
@pytest.mark.slow
def test_rebuilding_on_one_rank_is_refused_on_cpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("vLLM's CUDA build: the gpu(count=2) test below runs this on GPUs")
    message = rebuild_on_one_rank(tmp_path, "gloo")
    assert "every rank must build its engine at once" in message, message


@pytest.mark.gpu(count=2, duration_s=180)
@pytest.mark.vllm
@pytest.mark.slow
def test_rebuilding_on_one_rank_is_refused_on_gpus(tmp_path: Path) -> None:
    message = rebuild_on_one_rank(tmp_path, "nccl")
    assert "every rank must build its engine at once" in message, message
