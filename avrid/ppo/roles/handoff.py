"""Chapter 5 — one GPU, two tenants: the order in which the trainer and the engine hand it over.

In the hybrid engine the actor (training) and the rollout engine (generating) share each GPU,
taking turns. vLLM's sleep mode exists for exactly this, and the order of the calls decides
how much memory each turn can use and how many bytes cross the PCIe bus:

    after generating    `to_trainer`: the engine sleeps at level 2 — weights AND KV cache
                        released, no host copy: the trainer holds the master weights and the
                        next sync reloads them anyway (level 1 would copy them to pinned host
                        memory and back every step, only to overwrite them). An engine sent
                        only LoRA adapters keeps its base, which never changes: level 0 (only
                        the KV cache released, the base stays on the GPU) where the memory
                        estimate says it fits beside the trainer, else level 1 (the base to
                        pinned host memory and back, ~2 x 15 GB per step at 7B);
                        `trainer_sleep_level` chooses, once, at setup
    weight sync         `wake_for_load`: free the trainer's cached blocks, wake the weights
                        only (the KV cache is the big allocation; not yet), then the sync
                        loads the new weights bucket by bucket (`weight_sync.py`)
    before generating   `wake_for_generate`: free the trainer's cached blocks again (what the
                        sync's buffers left), then wake the KV cache; nothing sleeps between
                        the sync and the generation

`empty_cache` matters because vLLM maps its memory outside PyTorch's caching allocator: blocks
the trainer freed but PyTorch still caches (the activation peak of the last update) are
invisible to vLLM and would stay reserved. A colocated critic in another process empties its
cache after its own update for the same reason (`critic.py`).

On CPU nothing is handed over (vLLM has no sleep mode there, the torch engine keeps its
weights in host memory), but the torch engine still keeps the state: a level-2 sleep drops its
weights, so generating before the next sync fails loudly — the CPU tests check the order.

Not here: what the engine does when it sleeps (`torch_engine.py`, `vllm_engine.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.memory_estimate import SLEEP_DROP, SLEEP_OFFLOAD, estimate

TRAINER_SLEEP_LEVEL = SLEEP_DROP
"""The hybrid engine's sleep level: the trainer holds the master weights (see above)."""


def empty_cache(device: str | torch.device) -> None:
    """Give PyTorch's cached, unused blocks on `device` back to the driver (CUDA); elsewhere
    nothing to give."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def trainer_sleep_level(config: PPOConfig, *, adapters: bool, device: str | torch.device,
                        vocab_size: int) -> int:
    """The level this rank's engine sleeps at after generating (`memory_estimate.SLEEP_*`).
    Sent whole weights at every sync (`adapters` False): `TRAINER_SLEEP_LEVEL`. Sent LoRA
    adapters: what `memory_estimate.sleep_level` chooses for this GPU's memory — 0 (the base
    stays resident) where the trainer's phases leave room for it, else 1. Off CUDA nothing
    sleeps (no sleep mode): 1, the choice without an estimate."""
    if not adapters:
        return TRAINER_SLEEP_LEVEL
    if torch.device(device).type != "cuda":
        return SLEEP_OFFLOAD
    gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    # An engine sent adapters never drops its base (nothing would send it again): at most 1.
    return min(SLEEP_OFFLOAD, estimate(config, gpu_bytes=gpu_bytes,
                                       vocab=vocab_size).sleep_level)


def to_trainer(engine: Any, *, level: int = TRAINER_SLEEP_LEVEL) -> None:
    """The engine releases the GPU to the trainer at `level` (`trainer_sleep_level`; a
    no-op if it already sleeps)."""
    if not engine.asleep:
        engine.sleep(level=level)


def wake_for_load(engine: Any, device: str | torch.device) -> None:
    """Before a weight sync: the weights' memory back, the KV cache's not yet."""
    empty_cache(device)
    engine.wake(tags=["weights"])


def wake_for_generate(engine: Any, device: str | torch.device) -> None:
    """After a weight sync, before generating: the KV cache's memory back."""
    empty_cache(device)
    engine.wake(tags=["kv_cache"])
