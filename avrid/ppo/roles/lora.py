"""Chapter 5 — LoRA on the actor: PEFT's adapters put into the model, and what a sync sends.

With `lora.rank` > 0 (`setup/lora.py`) every targeted linear layer y = W x becomes
y = W x + (alpha / r) B A x, with A (r x in) and B (out x r) the only trained tensors: B starts
at 0, so the adapted policy starts as the base policy. `attach` puts PEFT's LoRA layers into a
model in place (`peft.inject_adapter_in_model`: no wrapper class, so the model's forward and
everything that calls it stay as they are; the base weights move to
``<layer>.base_layer.weight`` and are frozen by PEFT). AdamW then sees only A and B, and a
checkpoint holds only them (`fsdp.save_shards` skips frozen parameters).

Two things read the adapted model differently from a plain one:

- the reference policy is the base model: `adapters_off` switches every adapter off for the
  reference pass, so a KL term needs no second copy of the weights;
- a rollout engine without adapters (the torch engine; vLLM with `lora.sync=merged`) must be
  sent the MERGED weights W + (alpha / r) B A under the base model's names
  (`merged_local_shards`, `merged_whole`). Under FSDP2 each rank holds the same rows of W
  and of B (both are split on their output dimension, and they have the same number of
  rows), so a rank merges its own rows with the whole of A (r x in: small, all-gathered);
  the fingerprints of the merged shards are then what the engine must hold.

PEFT is imported only when LoRA is on (it takes seconds to import).
Not here: the config (`setup/lora.py`), the sync itself (`weight_sync.py`, chapter 6's push).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from avrid.ppo.engines.models import seeded_init
from avrid.ppo.setup.lora import LoraConfig

ADAPTER = "default"
"""PEFT's name for the one adapter a model holds."""
_BASE = ".base_layer."


def attach(model: torch.nn.Module, lora: LoraConfig, *, seed: int) -> torch.nn.Module:
    """Put LoRA adapters into `model` in place (PEFT), freeze everything else; returns it.

    Every rank (and rank 0's whole copy under meta init) gets the same A from `seed`, so the
    ranks start from the same adapted model; B is 0, so it computes the base model's function.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=lora.targets, bias="none")
    # A's draw: the run's other random draws stay as they were, and in process no other
    # worker seeds or draws meanwhile (the critic's initialisation ran beside it, and the two
    # runs of one seed got different critics).
    with seeded_init(seed):
        try:
            model = inject_adapter_in_model(config, model)
        except ValueError as e:  # PEFT's "Target modules {...} not found in the base model"
            raise ValueError(f"config field 'lora.target_modules': {lora.target_modules!r} "
                             f"matched no linear layer of the model ({e})") from None
    return model


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(module name, PEFT LoRA layer) of every adapted layer, in the model's order."""
    if not any(".lora_A." in n for n, _ in model.named_parameters()):
        return []
    return [(name, m) for name, m in model.named_modules() if _is_lora_layer(m)]


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` as its base model (every adapter switched off) inside the block: the
    reference policy of a LoRA run."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def served_name(name: str) -> str:
    """The base model's name of a parameter of the adapted model (what an engine holds)."""
    return name.replace(_BASE, ".")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA tensor (A or B)."""
    return ".lora_A." in name or ".lora_B." in name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def base_local_shards(shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shards of the BASE model under its own names, from `shards`
    (`fsdp.local_shards(model)`): what an engine that applies the adapters itself holds."""
    return {served_name(n): t for n, t in shards.items() if not is_adapter(n)}


def merged_local_shards(model: torch.nn.Module,
                        shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shards of the MERGED model under the base model's names, from `shards`
    (`fsdp.local_shards(model)`): W + (alpha / r) B A for each adapted weight, fp32; every
    other parameter as it is. Collective under FSDP2 (each A is all-gathered, in order)."""
    out = {served_name(n): t for n, t in shards.items() if not is_adapter(n)}
    for name, layer in lora_layers(model):
        a = _whole(layer.lora_A[ADAPTER].weight.detach()).float()
        b = _local(layer.lora_B[ADAPTER].weight.detach()).float()
        key = f"{name}.weight"
        out[key] = out[key].float() + layer.scaling[ADAPTER] * (b @ a)
    return out


def merged_whole(model: torch.nn.Module, name: str,
                 params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Served tensor `name` whole, fp32 (collective under FSDP2: every rank calls it for the
    same names in the same order). `params`: the adapted model's named parameters."""
    module, leaf = name.rsplit(".", 1)
    if name in params:  # not in an adapted layer: the parameter itself
        return _whole(params[name].detach()).float()
    base = params[f"{module}{_BASE}{leaf}"]  # an adapted layer's weight, or its bias
    if leaf != "weight":
        return _whole(base.detach()).float()
    a = _whole(params[f"{module}.lora_A.{ADAPTER}.weight"].detach()).float()
    b = _whole(params[f"{module}.lora_B.{ADAPTER}.weight"].detach()).float()
    layer = model.get_submodule(module)
    return _whole(base.detach()).float() + layer.scaling[ADAPTER] * (b @ a)


def served_shapes(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (whole shape, dtype name) of every tensor an engine holds, in order: the base
    model's parameters (a DTensor reports its global shape)."""
    return {served_name(n): (tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for n, p in model.named_parameters() if not is_adapter(n)}
