"""Chapter 5 — a model's shape without loading it: what `--estimate-memory` counts bytes of.

`ModelShape` is the handful of numbers that size a Qwen2-style decoder (width, depth, heads,
MLP width, vocabulary, tied head) and its parameter counts; `adapter_params` counts the LoRA
adapters the `lora` section would add to it. `shapes_of(config)` finds the
policy's and the critic's shapes without building a model or needing a GPU, in this order:

1. a local checkpoint directory (`model.path`, `model.critic_path`): its ``config.json``;
2. no such directory: a small built-in table of known checkpoints (`KNOWN_SHAPES`), looked up
   by the directory's basename ("Qwen2.5-0.5B-Instruct" -> Qwen2.5-0.5B), so a preset can be
   estimated on a machine that has not downloaded the model;
3. no `model.path`: the tiny random model of the `model` section (intermediate = 2 x hidden,
   as many key/value heads as heads, untied head), its vocabulary the task's character
   tokenizer's, or `TINY_VOCAB` where the task cannot be read cheaply.

Anything else (an unknown name, no config.json) is an error that says what to provide.

Not here: the bytes of each phase (`memory_estimate.py`), building or loading a model
(`engines.models`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.lora import LoraConfig

TINY_VOCAB = 64
"""The vocabulary assumed for a tiny model when its task's tokenizer cannot be made cheaply
(the char tokenizers of the built-in tasks have 13-20 tokens: the bytes are negligible)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """The numbers that size a Qwen2-style decoder (q/k/v biases, SwiGLU MLP, RMSNorms)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    """The LM head shares the embedding's weight (Qwen2.5-0.5B, 1.5B, 3B)."""
    source: str = ""
    """Where the shape came from, for the printed table."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Width of the keys (or values) of one token: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v (with biases), o, the MLP, two norms."""
        h, kv, i = self.hidden, self.kv_width, self.intermediate
        return (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h

    @property
    def embedding_params(self) -> int:
        """The token embedding (vocab x hidden)."""
        return self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """What is outside the layers: embedding, final norm, the LM head unless tied (FSDP2's
        root unit, gathered whole while the model runs)."""
        head = 0 if self.tied else self.vocab * self.hidden
        return self.embedding_params + self.hidden + head

    @property
    def params(self) -> int:
        """Every parameter of the causal LM (a tied head counted once)."""
        return self.layers * self.layer_params + self.root_params

    @property
    def critic_params(self) -> int:
        """The critic built on this trunk: no LM head, a one-output value head with a bias."""
        return self.layers * self.layer_params + self.embedding_params + self.hidden \
            + self.hidden + 1

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by PEFT's module
        name: what `lora.target_modules` selects from."""
        h, kv, i = self.hidden, self.kv_width, self.intermediate
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def largest_module(self) -> int:
        """Elements of the largest module a weight sync moves whole (the embedding, or the
        fused gate/up projection)."""
        return max(self.embedding_params, 2 * self.hidden * self.intermediate)


def adapter_params(shape: ModelShape, lora: LoraConfig) -> int:
    """Parameters of the LoRA adapters `lora` puts into a model of `shape` (0 with LoRA off):
    A (r x in) and B (out x r) on each targeted linear layer of every decoder layer.
    "all-linear" is every one of them, not the LM head (PEFT's choice, `roles/lora.py`).

    Example (Qwen2.5-7B, rank 16 on every linear layer: about 40M, 0.5% of the model):
        >>> adapter_params(KNOWN_SHAPES["qwen2.5-7b"], LoraConfig(rank=16))
        40370176
    """
    if not lora.enabled:
        return 0
    linears = shape.linears()
    names = list(linears) if lora.targets == "all-linear" else list(lora.targets)
    unknown = [n for n in names if n not in linears]
    if unknown:
        raise ValueError(f"lora.target_modules: {', '.join(unknown)} is not a linear layer "
                         f"of a Qwen2-style decoder, so its adapters cannot be counted; "
                         f"allowed: all-linear or any of {', '.join(linears)}")
    return shape.layers * sum(lora.rank * sum(linears[n]) for n in names)


def _qwen(vocab: int, hidden: int, layers: int, heads: int, kv: int, inter: int,
          tied: bool, name: str) -> ModelShape:
    return ModelShape(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv,
                      intermediate=inter, tied=tied, source=f"built-in table ({name})")


KNOWN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": _qwen(151936, 896, 24, 14, 2, 4864, True, "Qwen2.5-0.5B"),
    "qwen2.5-1.5b": _qwen(151936, 1536, 28, 12, 2, 8960, True, "Qwen2.5-1.5B"),
    "qwen2.5-3b": _qwen(151936, 2048, 36, 16, 2, 11008, True, "Qwen2.5-3B"),
    "qwen2.5-7b": _qwen(152064, 3584, 28, 28, 4, 18944, False, "Qwen2.5-7B"),
}
"""Shapes of known checkpoints (their config.json values), by lower-case name prefix: a
directory named "Qwen2.5-7B-Instruct" is Qwen2.5-7B. (7B's vocabulary is 152064, not the
smaller models' 151936, and its LM head is not tied.)"""


def shape_from_path(path: str) -> ModelShape:
    """The shape of the checkpoint at `path`: its config.json when the directory has one,
    else the built-in table by the directory's basename; else a ValueError naming both."""
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        return shape_from_config_json(json.loads(config_file.read_text()), str(config_file))
    base = Path(path).name.lower()
    for prefix, shape in KNOWN_SHAPES.items():
        if base.startswith(prefix):
            return shape
    raise ValueError(
        f"model.path {path!r}: no config.json there and its name matches no built-in shape "
        f"(known: {', '.join(s.source.split('(')[1][:-1] for s in KNOWN_SHAPES.values())}); "
        f"to estimate its memory give the checkpoint's directory (its config.json is enough: "
        f"hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
        f"intermediate_size, vocab_size, tie_word_embeddings)")


def shape_from_config_json(cfg: dict, where: str) -> ModelShape:
    """A `ModelShape` from a transformers config.json's fields (Qwen2/Llama names)."""
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"{where}: has no {', '.join(missing)} (a decoder's config.json "
                         f"needs {', '.join(need)})")
    return ModelShape(vocab=int(cfg["vocab_size"]), hidden=int(cfg["hidden_size"]),
                      layers=int(cfg["num_hidden_layers"]),
                      heads=int(cfg["num_attention_heads"]),
                      kv_heads=int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
                      intermediate=int(cfg["intermediate_size"]),
                      tied=bool(cfg.get("tie_word_embeddings", False)), source=where)


def tiny_shape(config: PPOConfig, vocab: int | None = None) -> ModelShape:
    """The tiny random model of `config.model` (as `engines.models.tiny_spec` builds it);
    `vocab` None: the task's character tokenizer's, or `TINY_VOCAB`."""
    m = config.model
    source = "the tiny model of the model section"
    if vocab is None:
        vocab, how = _task_vocab(config)
        source += f", vocab {how}"
    return ModelShape(vocab=vocab, hidden=m.hidden_size, layers=m.num_layers,
                      heads=m.num_heads, kv_heads=m.num_heads, intermediate=2 * m.hidden_size,
                      tied=False, source=source)


def _task_vocab(config: PPOConfig) -> tuple[int, str]:
    """The char tokenizer's vocabulary for the run's task, or `TINY_VOCAB` if the task
    cannot be made (a custom factory, a missing file): the bytes of a tiny vocab are noise."""
    from avrid.ppo.setup.catalog import load_task

    try:
        task = load_task(config.task.name, **config.task.kwargs)
        return len(config.task.alphabet or task.alphabet) + 2, "of the task's char tokenizer"
    except Exception:  # noqa: BLE001 (any failure of a user's task: use the stated default)
        return TINY_VOCAB, f"assumed {TINY_VOCAB} (the task could not be read)"


def shapes_of(config: PPOConfig, *, vocab: int | None = None
              ) -> tuple[ModelShape, ModelShape | None]:
    """(policy shape, critic trunk shape or None without a critic) of `config`; `vocab`
    overrides a tiny model's vocabulary (a benchmark that builds the worker with its own)."""
    m = config.model
    policy = shape_from_path(m.path) if m.path is not None else tiny_shape(config, vocab)
    if not config.algo.uses_critic:
        return policy, None
    critic_path = m.critic_path or m.path
    critic = shape_from_path(critic_path) if critic_path is not None else policy
    return policy, critic
