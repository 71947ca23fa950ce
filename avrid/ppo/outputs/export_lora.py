"""Chapter 5 — exporting a LoRA run: its base, the merged policy, and the adapter as PEFT
writes it.

A LoRA run's checkpoint holds the adapters only (`roles/lora.py`: the base weights are
frozen, so the run rebuilds them from its seed or `model.path` instead of saving them). An
export needs the base too: `base_policy` rebuilds it exactly as the run did
(`models.initial_policy`); `merged_policy` adds (alpha / r) B A to each adapted weight of it
and returns a plain state dict that `export.export_policy` writes like any other;
`adapter_files` gives the adapter as a PEFT adapter directory holds it
(``adapter_config.json`` and ``adapter_model.safetensors``, keys
``base_model.model.<module>.lora_A.weight``), which `PeftModel.from_pretrained` and vLLM's
`LoRARequest` load onto the base, never onto the merged model: that would add the update
twice (`export.py` lays the three out in separate folders for that reason).

Not here: the directory's layout, its atomic writing and the checks on the destination
(`export.py`, `export_dest.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from avrid.ppo.engines.models import initial_policy
from avrid.ppo.setup.config import PPOConfig

_A, _B = ".lora_A.default.weight", ".lora_B.default.weight"


def is_lora_checkpoint(weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether an actor's checkpointed weights are LoRA adapters (no base weights)."""
    return any(n.endswith(_A) for n in weights)


def adapted_modules(weights: Mapping[str, torch.Tensor]) -> list[str]:
    """The module names that carry an adapter (A and B both present), in order."""
    modules = [n.removesuffix(_A) for n in weights if n.endswith(_A)]
    missing = [m for m in modules if m + _B not in weights]
    if missing:
        raise ValueError(f"the checkpoint's LoRA adapters lack B for {missing[:3]}")
    return modules


def base_policy(config: PPOConfig, tokenizer: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The run's base policy, rebuilt as the run built it (its seed, or `model.path`): the
    state dict the adapters go onto, fp32, under the base model's names."""
    if not config.lora.enabled:
        raise ValueError("the checkpoint holds LoRA adapters but its config has lora.rank=0")
    base = initial_policy(config, vocab_size=int(tokenizer["vocab_size"]),
                          eos_id=int(tokenizer["eos_token_id"]),
                          pad_id=int(tokenizer["pad_token_id"]))
    return {n: t.detach() for n, t in base.state_dict().items()}


def merged_policy(config: PPOConfig, base: Mapping[str, torch.Tensor],
                  adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`base` (`base_policy`) with the adapters merged in: W + (alpha / r) B A for every
    adapted weight, fp32; a new dict (`base` is not changed)."""
    lora = config.lora
    weights = dict(base)
    scale = lora.alpha / lora.rank
    for module in adapted_modules(adapters):
        name = f"{module}.weight"
        if name not in weights:
            raise ValueError(f"the checkpoint's adapter {module!r} has no weight {name!r} in "
                             f"the base model")
        a, b = adapters[module + _A].float(), adapters[module + _B].float()
        weights[name] = weights[name].float() + scale * (b @ a)
    return weights


def adapter_files(config: PPOConfig, adapters: Mapping[str, torch.Tensor], *,
                  base_path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json's content, adapter_model.safetensors' tensors) of a PEFT adapter
    directory holding the run's adapters. The target modules are written out as the names
    that carry an adapter (vLLM needs a list, not "all-linear"); `base_path` is recorded as
    ``base_model_name_or_path``, where ``AutoPeftModelForCausalLM`` loads the base from: an
    absolute path to the run's base (never to a merged model)."""
    from peft import LoraConfig as PeftLoraConfig

    lora = config.lora
    modules = adapted_modules(adapters)
    tensors = {}
    for module in modules:
        for part, suffix in (("lora_A", _A), ("lora_B", _B)):
            tensors[f"base_model.model.{module}.{part}.weight"] = (
                adapters[module + suffix].detach().float().contiguous())
    peft_config = PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
        target_modules=sorted({m.rsplit(".", 1)[-1] for m in modules}), task_type="CAUSAL_LM",
        base_model_name_or_path=base_path)
    text = peft_config.to_dict()
    # JSON-ready: PEFT keeps sets and enums in its dict.
    text = {k: (sorted(v) if isinstance(v, set) else getattr(v, "value", v))
            for k, v in text.items()}
    return text, tensors
