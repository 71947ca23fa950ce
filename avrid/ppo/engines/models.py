"""Chapter 5 — building and loading the policy and critic, and left-padding prompts for the
rollout engine.

The policy is a causal LM (logits per position); the critic is the same decoder with a
one-output head (a value per position). Both are plain transformers Qwen2 models, so the
tiny random CPU model of the tests has the architecture and the parameter names of the GPU
preset (Qwen2.5-0.5B-Instruct), and weight syncs, vLLM's name mapping and the TP layouts of
chapter 4 see the same names on both.

`pad_left` (the engine's prompt batch) keeps the one convention rollout and trainer must
share for their log-probs to agree: position ids count from 0 at each row's first real token,
whatever the padding, as `columns.model_inputs` (the trainer's right-padded batch) counts
them, so a row's numbers do not depend on the batch it was padded into. (With RoPE a shifted
numbering changes the result by rounding only, since attention sees relative offsets, but
the tests pin the gap near 1e-6 and a shift can run past `max_positions`.)

Not here: sampling (`torch_engine`), the trainer's forward passes (`columns`, `forward`), the RL
math (`logprobs`), optimisers, FSDP wrapping, tokenizers.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

# Imported up front, not inside the builders: transformers resolves its classes lazily, and two
# worker threads (the in-process backend) resolving the same name at once can fail to import.
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

from avrid.ppo.engines import packed_attention
from avrid.ppo.setup.config import PPOConfig

# The kernel a model is BUILT with (tests, the chapter notebooks). A run's trained models, its
# reference and the torch engine's copy of the actor then run `memory.attention`
# (`trainer_attention`; sdpa on CPU by default). eager is the explicit softmax(QK^T)V: the
# engine, decoding one query at a time through the KV cache, and the trainer, running the whole
# sequence, then compute the same expression. Measured on a tiny model, 16 prompts of 1-23
# tokens, 24 new tokens: max |gap| 9.5e-7 for both kernels in float32, but 2.8e-3 (eager)
# against 5.5e-3 (sdpa) in bfloat16; sdpa never stores the heads x L x L weights.
ATTN_IMPLEMENTATION = "eager"


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyModelSpec:
    """The shape of a small random Qwen2 decoder (CPU tests, demos).

    Example:
        >>> TinyModelSpec(vocab_size=16).num_kv_heads
        4
        >>> TinyModelSpec(vocab_size=16, num_heads=3)
        Traceback (most recent call last):
        ...
        ValueError: hidden_size (64) must be divisible by num_heads (3)
    """

    vocab_size: int
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    max_positions: int = 64
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:  # grouped-query attention: whole groups only
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by "
                             f"num_kv_heads ({self.num_kv_heads})")


def tiny_config(spec: TinyModelSpec, *, eos_token_id: int | None = None,
                pad_token_id: int | None = None,
                num_labels: int | None = None) -> Qwen2Config:
    """The `Qwen2Config` for `spec` (eos/pad ids checked against the vocabulary)."""

    for name, tok in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if tok is not None and not 0 <= tok < spec.vocab_size:
            raise ValueError(f"{name} must be in [0, {spec.vocab_size}), got {tok}")
    extra = {} if num_labels is None else {"num_labels": num_labels}
    return Qwen2Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=spec.tie_embeddings,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, **extra)


def build_tiny_policy(spec: TinyModelSpec, *, seed: int, eos_token_id: int | None = None,
                      pad_token_id: int | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A randomly initialised `Qwen2ForCausalLM`; the same `seed` gives the same weights.

    The caller's global RNG is left as it was (initialisation runs in a forked RNG), so
    building a model in the middle of a seeded experiment does not shift its samples.

    Example:
        >>> spec = TinyModelSpec(vocab_size=16)
        >>> a, b = build_tiny_policy(spec, seed=1), build_tiny_policy(spec, seed=1)
        >>> bool(torch.equal(a.lm_head.weight, b.lm_head.weight))
        True
    """

    config = tiny_config(spec, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    return _build(Qwen2ForCausalLM, config, seed, dtype)


def build_tiny_critic(spec: TinyModelSpec, *, seed: int,
                      dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A randomly initialised `Qwen2ForTokenClassification` with one label: a value per token
    (its `score` head a `ValueHead`, so the output is never a view; see there).

    Example:
        >>> critic = build_tiny_critic(TinyModelSpec(vocab_size=16), seed=0)
        >>> tuple(critic.score.weight.shape)
        (1, 64)
    """

    model = _build(Qwen2ForTokenClassification, tiny_config(spec, num_labels=1), seed, dtype)
    return _with_value_head(model)


_INIT_LOCK = threading.Lock()


@contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Draws from torch's process-global RNG seeded with `seed`, its state put back after,
    and one worker at a time: the in-process backend's workers share the process, and one
    seeding it while another draws its weights would make both depend on the timing."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _build(cls: type, config: object, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    config._attn_implementation = ATTN_IMPLEMENTATION  # type: ignore[attr-defined]
    # transformers initialises from torch's process-global RNG. Two workers sharing a process
    # (the in-process backend's threads) must not seed and draw from it at the same time.
    with seeded_init(seed):
        model = cls(config)
    return model.to(dtype).eval()


def load_policy(path: str | Path, *, dtype: torch.dtype = torch.float32,
                attn_implementation: str = ATTN_IMPLEMENTATION) -> torch.nn.Module:
    """A causal LM from a LOCAL checkpoint directory (never downloads)."""

    return AutoModelForCausalLM.from_pretrained(
        _local(path), dtype=dtype, attn_implementation=attn_implementation,
        local_files_only=True).eval()


def load_critic(path: str | Path, *, dtype: torch.dtype = torch.float32,
                attn_implementation: str = ATTN_IMPLEMENTATION) -> torch.nn.Module:
    """A critic from a LOCAL causal-LM checkpoint: its decoder, plus a one-output `score`
    head that is NEWLY initialised (the checkpoint has none; transformers warns about it),
    as a `ValueHead`. The LM head is dropped. Its values are noise until PPO has trained it."""

    return _with_value_head(AutoModelForTokenClassification.from_pretrained(
        _local(path), num_labels=1, dtype=dtype, attn_implementation=attn_implementation,
        local_files_only=True).eval())


class ValueHead(torch.nn.Linear):
    """The critic's one-output `score` head: an `nn.Linear` whose output is never a view.

        V = x W^T + b        computed as linear(x, W), then + b out of place

    `nn.Linear` with a bias computes a (B, L, H) input as one addmm over (B*L, H) and returns
    it reshaped to (B, L, 1): a VIEW. It is the critic's final output, so under FSDP2 the
    wrapped root module returns a view, and FSDP2 warns on every forward that an in-place op
    on it would drop its pre-backward hook ("can cause wrong gradients"). Computing the bias
    add out of place returns a fresh tensor: the same function, nothing left to warn about.
    The parameters keep their names (`score.weight`, `score.bias`), so checkpoints are the same.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, self.weight)  # no bias: matmul, not a view
        return out if self.bias is None else out + self.bias


def _with_value_head(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its `score` Linear swapped for a `ValueHead` holding the same parameters."""
    old = model.score
    # On the meta device: no memory and no draw from the RNG; the real parameters move over.
    head = ValueHead(old.in_features, old.out_features, bias=old.bias is not None,
                     device="meta")
    head.weight, head.bias = old.weight, old.bias
    model.score = head
    return model


def _local(path: str | Path) -> str:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"no local checkpoint directory at {str(p)!r}")
    return str(p)


def pad_left(prompts: Sequence[Sequence[int]],
             pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token lists into a batch: real tokens end at the last column (where a
    decoder continues). Returns (input_ids, attention_mask, position_ids), each (B, L)
    int64, L the longest row; pads have mask 0 and position 0, real tokens count from 0.

    Example:
        >>> ids, mask, pos = pad_left([[5, 6, 7], [8]], pad_id=0)
        >>> ids.tolist(), mask.tolist(), pos.tolist()
        ([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
    """
    if not prompts:
        raise ValueError("nothing to pad: no sequences")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every sequence needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    # Count real tokens from 0 (the trainer's numbering); pads get 0, they are never attended.
    positions = (mask.cumsum(-1) - 1).clamp(min=0) * mask
    return ids, mask, positions


FLASH_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
"""The compute dtypes flash-attn runs ("only supports fp16 and bf16", at the first forward)."""


def trainer_attention(choice: str, device: str, *, packed: bool, dtype: torch.dtype) -> str:
    """The attention kernel the trained models run for `memory.attention` = `choice` on
    `device` in compute dtype `dtype` (`model.dtype`), on `packed` rows
    (`memory.pack_sequences`) or right-padded ones.

    "auto" is flash-attn 2 on CUDA where the package is installed and the compute dtype is
    one it runs (`FLASH_ATTENTION_DTYPES`: an fp32 model would reach flash-attn in fp32, since
    transformers casts nothing, and fail at its first forward), else SDPA. SDPA on packed rows
    ("auto" or "sdpa") is `packed_attention`'s kernel, one sequence at a time: transformers'
    own would attend over a block-diagonal N x N mask. "eager" is itself (on packed rows: that
    N x N mask).

    Example:
        >>> fp32 = torch.float32
        >>> trainer_attention("auto", "cpu", packed=True, dtype=fp32), trainer_attention(
        ...     "auto", "cpu", packed=False, dtype=fp32)
        ('avrid_packed_sdpa', 'sdpa')
        >>> trainer_attention("eager", "cpu", packed=True, dtype=fp32)
        'eager'
    """
    if (choice == "auto" and device == "cuda" and dtype in FLASH_ATTENTION_DTYPES
            and importlib.util.find_spec("flash_attn")):
        return "flash_attention_2"
    if choice in ("auto", "sdpa"):
        return packed_attention.register() if packed else "sdpa"
    return choice


def tiny_spec(config: PPOConfig, vocab_size: int) -> TinyModelSpec:
    """The tiny model's shape from the config's `model` section (policy and critic share it).

    Example:
        >>> spec = tiny_spec(PPOConfig(), vocab_size=16)
        >>> spec.intermediate_size == 2 * spec.hidden_size, spec.num_kv_heads == spec.num_heads
        (True, True)
    """
    m = config.model
    return TinyModelSpec(vocab_size=vocab_size, hidden_size=m.hidden_size,
                         intermediate_size=2 * m.hidden_size, num_layers=m.num_layers,
                         num_heads=m.num_heads, num_kv_heads=m.num_heads)


def initial_policy(config: PPOConfig, *, vocab_size: int, eos_id: int,
                   pad_id: int) -> torch.nn.Module:
    """The fp32 policy of a run as it is at step 0: the tiny random one from the run's seed
    (the same in every process), or the local checkpoint `model.path`."""
    if config.model.path is None:
        return build_tiny_policy(tiny_spec(config, vocab_size), seed=config.train.seed,
                                 eos_token_id=eos_id, pad_token_id=pad_id, dtype=torch.float32)
    return load_policy(config.model.path, dtype=torch.float32)


def load_seeded_critic(path: str | Path, *, seed: int,
                       dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """`load_critic` with its new value head drawn from `seed`: transformers draws it from the
    process's global RNG, whose state depends on whatever the process did before (it differed
    from run to run), so a run's critic would not be a function of its seed. Drawn in a forked
    RNG under the init lock, as `build_tiny_critic` draws its weights."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return load_critic(path, dtype=dtype)
