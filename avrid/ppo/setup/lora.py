"""Chapter 5 — the `lora` section of the config: train low-rank adapters, not the whole policy.

`LoraConfig` is one of `PPOConfig`'s sections (re-exported by `config.py`, where the others
are). With `rank` > 0 the actor's base weights are frozen (never in AdamW's state, never in
a checkpoint) and only PEFT's LoRA adapters train (`roles/lora.py`): W' = W + (alpha / rank)
x B A on each targeted linear layer. The reference policy is the same model with its
adapters switched off, so a KL term needs no second copy of the weights. The critic is
trained in full either way.

What the rollout engine gets (`sync`): the torch engine has no adapter path, so it is always
given the merged weights W + (alpha / rank) B A, fingerprint-checked like any sync. vLLM
serves the adapters themselves ("adapter": the base once, then A and B only at each sync,
`roles/adapter_sync.py`; chapter 6's push to a rollout pool alike) or takes the merged weights
("merged").

Not here: the adapter modules and the merge (`roles/lora.py`), the rules that tie this
section to others (`validate.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from avrid.ppo.setup.validate import finite, need, one_of

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM 0.32 accepts as its largest adapter rank (`vllm/config/lora.py`): an engine
serving adapters of rank r is built with the smallest of these >= r."""

LoraSync = Literal["adapter", "merged"]
"""What a weight sync sends a vLLM engine: the adapters, or the merged weights."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters on the actor (`--set lora.rank=8`)."""

    rank: int = 0
    """The adapters' rank r; 0 = off (the whole policy trains)."""
    alpha: float = 16.0
    """LoRA's alpha: the update is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (PEFT's `lora_dropout`). The trained
    models run in eval mode so that a forward pass is a function of the weights: any dropout
    here is off, and a value other than 0 is refused."""
    target_modules: str = "all-linear"
    """Which linear layers get adapters: "all-linear" (every linear layer of the decoder, not
    the output head: PEFT's choice) or a comma-separated list of module names, e.g.
    "q_proj,k_proj,v_proj,o_proj"."""
    sync: LoraSync = "adapter"
    """What vLLM is sent at each sync: "adapter" (the LoRA tensors only) or "merged" (the
    merged weights). The torch engine always takes the merged weights."""

    def __post_init__(self) -> None:
        finite("lora", self)
        need(isinstance(self.rank, int) and self.rank >= 0, "lora.rank",
             f"must be an integer >= 0 (0 = off), got {self.rank!r}")
        need(self.alpha > 0, "lora.alpha", f"must be > 0, got {self.alpha}")
        need(self.dropout == 0.0, "lora.dropout",
             f"must be 0: the trained models run in eval mode (a forward pass must be a "
             f"function of the weights for the PPO ratio), got {self.dropout}")
        names = [m.strip() for m in self.target_modules.split(",")]
        need(all(names) and all(m.replace("_", "").replace("-", "").isalnum() for m in names),
             "lora.target_modules", f"must be 'all-linear' or comma-separated module names, "
             f"got {self.target_modules!r}")
        one_of("lora.sync", self.sync, LoraSync, "choice")

    @property
    def enabled(self) -> bool:
        """Whether the actor trains adapters (rank > 0)."""
        return self.rank > 0

    @property
    def vllm_max_rank(self) -> int:
        """The largest rank vLLM serves as an adapter (`MAX_LORA_RANKS`)."""
        return MAX_LORA_RANKS[-1]

    @property
    def targets(self) -> str | list[str]:
        """`target_modules` as PEFT takes it: "all-linear" or a list of names."""
        if self.target_modules == "all-linear":
            return "all-linear"
        return [m.strip() for m in self.target_modules.split(",")]
