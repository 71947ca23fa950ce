"""Chapter 5 — one GPU, two tenants: the order in which the trainer and the engine hand it over.

In the hybrid engine the actor (training) and the rollout engine (generating) share each GPU,
taking turns. vLLM's sleep mode exists for exactly this, and the order of the calls decides
how much memory each turn can use and how many bytes cross the PCIe bus:

    after generating    `to_trainer`: the engine sleeps at level 2 — weights AND KV cache
                        released, no host copy: the trainer holds the master weights and the
                        next sync reloads them anyway (level 1 would copy them to pinned host
                        memory and back every step, only to overwrite them). An engine sent
                        only LoRA adapters keeps its base: level 1 for it
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

TRAINER_SLEEP_LEVEL = 2
"""The hybrid engine's sleep level: the trainer holds the master weights (see above)."""


def empty_cache(device: str | torch.device) -> None:
    """Give PyTorch's cached, unused blocks on `device` back to the driver (CUDA); elsewhere
    nothing to give."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def to_trainer(engine: Any, *, keep_weights: bool = False) -> None:
    """The engine releases the GPU to the trainer (a no-op if it already sleeps).
    `keep_weights`: the next sync does not reload them (an engine sent only LoRA adapters
    keeps its base model): level 1, weights offloaded to host memory and brought back."""
    if not engine.asleep:
        engine.sleep(level=1 if keep_weights else TRAINER_SLEEP_LEVEL)


def wake_for_load(engine: Any, device: str | torch.device) -> None:
    """Before a weight sync: the weights' memory back, the KV cache's not yet."""
    empty_cache(device)
    engine.wake(tags=["weights"])


def wake_for_generate(engine: Any, device: str | torch.device) -> None:
    """After a weight sync, before generating: the KV cache's memory back."""
    empty_cache(device)
    engine.wake(tags=["kv_cache"])
