"""`VllmEngine`'s refusals that come before vLLM is imported: a second engine in a process
whose torch.distributed world has several ranks (vLLM cuts its groups from that world, so a
rank rebuilding alone would hang), an unknown seed mode, batch seeding across processes.

The first tests fake the world's size and run without vllm installed; the last two build
real engines on two ranks (gloo with vLLM's CPU build, NCCL on two GPUs) and rebuild on one.
Not here: what the engine generates (tests/test_ppo_vllm.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta
from pathlib import Path

import pytest

from avrid.ppo.engines import vllm_engine
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
