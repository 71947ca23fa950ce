"""Chapter 5 — the LoRA weight sync: only the adapters move, and the check reads them back.

With ``lora.sync=adapter`` and vLLM (`serves_adapters`), the actor's rollout engine is sent
the base model's weights once, when the worker starts (`weight_sync.WeightSync`, as for any
model), and after each update only the adapters: A and B of every adapted layer, about 1 % of
the weights for rank 8 on a 0.5B model. vLLM applies them in its LoRA kernels
(`engines/vllm_lora.py`), so the engine computes W x + (alpha / r) B A x without anyone
forming the merged W + (alpha / r) B A.

Under FSDP2 each rank holds dim-0 shards of A and B; every rank has an engine of its own and
needs them whole, so each is cast to the engine's dtype and all-gathered (a few MiB; every
rank gathers the same tensors in the same order). The fingerprint is of what the kernels must
then hold (`vllm_lora.held_form`: B scaled by alpha / r, as vLLM stores it) against a read-back
of the kernels' own buffers, so a stale adapter — an old version still served, a load that
missed a layer — stops the run with the tensor names and the version.

Not here: the base weights' transfer (`weight_sync.py`), the merged weights that the torch
engine and ``lora.sync=merged`` take (`lora.py`), the vLLM side (`engines/vllm_lora.py`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from avrid.ppo.engines.vllm_lora import held_form, peft_config, peft_key
from avrid.ppo.roles import lora
from avrid.ppo.roles.weight_sync import SyncReport
from avrid.ppo.setup.config import PPOConfig
from avrid.reshard import ModelLayout, ParamLayout, check_same, fingerprint


def serves_adapters(config: PPOConfig) -> bool:
    """Whether the rollout engine is sent adapters (vLLM, ``lora.sync=adapter``) rather than
    weights (no LoRA, the merged weights, or the torch engine)."""
    lo = config.lora
    return lo.enabled and lo.sync == "adapter" and config.rollout.engine == "vllm"


class AdapterSync:
    """The actor's LoRA adapters -> this rank's vLLM engine, checked by read-back."""

    def __init__(self, model: torch.nn.Module, *, rank: int, engine_dtype: torch.dtype) -> None:
        """`model`: the adapted actor (`lora.attach`), sharded or not; `engine_dtype`: the
        engine's LoRA dtype (its model dtype), which the adapters are cast to before they
        move."""
        self.rank = rank
        self.engine_dtype = engine_dtype
        self.names = [n for n, _ in model.named_parameters() if lora.is_adapter(n)]
        layers = lora.lora_layers(model)
        if not self.names or not layers:
            raise ValueError("the actor has no LoRA adapters to serve (lora.rank is 0?)")
        layer = layers[0][1]
        self.scaling = float(layer.scaling[lora.ADAPTER])
        # What vLLM's PEFT helper reads: the rank, alpha (scaling = alpha / r) and the
        # adapted modules by their leaf names.
        self.config: dict[str, Any] = peft_config(
            layer.r[lora.ADAPTER], layer.lora_alpha[lora.ADAPTER],
            [peft_key(n) for n in self.names])
        self.adapter_bytes = sum(p.numel() for n, p in model.named_parameters()
                                 if n in self.names) * engine_dtype.itemsize
        self._by_key = {peft_key(n): n for n in self.names}

    def shapes(self, model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
        """PEFT key -> (whole shape, dtype name) of every adapter tensor, in order: what
        chapter 6's push sends a rollout pool that serves adapters."""
        params = dict(model.named_parameters())
        return {peft_key(n): (tuple(params[n].shape), str(params[n].dtype).removeprefix("torch."))
                for n in self.names}

    def held_local(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's shards of the adapters in the form the kernels hold them (cast, B
        scaled), by PEFT key: their partial fingerprints, added over the ranks, are what a
        rollout engine serving the pushed adapter must report (the scaling is per element)."""
        params = dict(model.named_parameters())
        local = {peft_key(n): _local(params[n].detach()) for n in self.names}
        return held_form(local, self.scaling, self.engine_dtype)

    def whole(self, model: torch.nn.Module, key: str) -> torch.Tensor:
        """Adapter tensor `key` (a PEFT key) whole, in the engine's dtype (collective under
        FSDP2: every rank calls it for the same keys in the same order)."""
        name = self._by_key[key]
        cast = dict(model.named_parameters())[name].detach().to(self.engine_dtype)
        return cast.full_tensor() if isinstance(cast, DTensor) else cast

    def run(self, model: torch.nn.Module, engine: Any, *, version: int,
            device: str | torch.device = "cpu") -> SyncReport:
        """Gather the adapters whole (collective: every rank at once), serve them as
        `version`, and check what the kernels hold."""
        start = time.perf_counter()
        params = dict(model.named_parameters())
        whole: dict[str, torch.Tensor] = {}
        received = 0
        for name in self.names:  # the same order on every rank: each gather is collective
            cast = params[name].detach().to(device, self.engine_dtype)
            if isinstance(cast, DTensor):
                received += cast.numel() - cast.to_local().numel()
                cast = cast.full_tensor()
            whole[peft_key(name)] = cast
        engine.load_adapter(whole, self.config, version=version)
        served = engine.adapter[0] if engine.adapter is not None else None
        where = f"LoRA adapter (version {version}) of the rollout engine of policy rank {self.rank}"
        if served != version:
            raise RuntimeError(f"{where}: the engine serves version {served}")
        expected = fingerprint(held_form(whole, self.scaling, self.engine_dtype)).checksums
        check_same(expected, engine.adapter_checksums(), where=where)
        return SyncReport(bytes_moved=received * self.engine_dtype.itemsize,
                          engine_bytes=self.adapter_bytes,
                          seconds=time.perf_counter() - start)


def load_base(engine: Any, model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Load `model` (the base: the run's initial policy) into `engine` and check it by
    fingerprint. Chapter 6's rollout pool, serving adapters, builds its base itself, as every
    trainer rank does (`models.initial_policy`: the same seed or checkpoint, the same
    tensors), and is then pushed the adapters alone."""
    tensors = {n: p.detach().to(dtype) for n, p in model.named_parameters()}
    engine.load_weights(tensors.items())
    layout = ModelLayout(world_size=1, params=tuple(
        (n, ParamLayout.replicated(tuple(t.shape), t.dtype, 1)) for n, t in tensors.items()))
    check_same(dict(fingerprint(tensors).checksums), engine.checksums(layout),
               where="rollout engine's base model")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
