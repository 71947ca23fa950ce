"""Write a Qwen2.5-0.5B-shaped checkpoint, a tokenizer and a GSM8K-style file, with no download.

For a GPU smoke run of the `qwen-gsm8k` preset on a machine that cannot reach the Hub (the
GPU machines lent to this project): the model has Qwen2.5-0.5B's exact shape (151936-token
vocabulary, 896 wide, 24 layers, 14 heads, 2 key/value heads, 4864-wide MLP, tied head) with
random bfloat16 weights, so memory and speed are the real model's; the tokenizer is word-level
with as many tokens (a few words, then fillers), with a chat template; the data are easy
word problems in GSM8K's format ("... #### 7"). A random model earns no reward: this checks
that the GPU path runs and fits, not that it learns.

    python benchmarks/qwen_shape.py OUT_DIR
    avrid ppo --preset qwen-gsm8k --set model.path=OUT_DIR/model \
        --set model.tokenizer=OUT_DIR/tokenizer --set task.path=OUT_DIR/gsm8k.jsonl ...

Not here: a real checkpoint's behaviour (tests/test_ppo_gpu.py reads one from
``AVRID_QWEN_PATH`` when it is set).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.setup.memory_shapes import KNOWN_SHAPES

WORDS = ("<pad>", "<eos>", "<unk>", "user", "assistant", "system", ":", "####", "+", "=",
         *"0123456789", "Tom", "has", "apples", "and", "more", ".", "How", "many", "?")


def save_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer of exactly `vocab` tokens with a chat template. Two folders
    (model, tokenizer): beside a Qwen2 config.json, AutoTokenizer would re-read a word-level
    vocabulary as Qwen2's byte-level BPE."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*WORDS, *(f"w{i}" for i in range(vocab - len(WORDS)))]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
    fast.save_pretrained(str(path))


def save_model(path: Path) -> None:
    """Random weights in Qwen2.5-0.5B's shape, bfloat16, saved like a downloaded checkpoint."""
    shape = KNOWN_SHAPES["qwen2.5-0.5b"]
    spec = TinyModelSpec(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_layers=shape.layers,
                         num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                         max_positions=4096, tie_embeddings=shape.tied)
    model = build_tiny_policy(spec, seed=0, eos_token_id=1, pad_token_id=0,
                              dtype=torch.bfloat16)
    model.save_pretrained(str(path))
    count = sum(p.numel() for p in model.parameters())
    print(f"model: {count / 1e6:.0f}M parameters -> {path}")


def save_problems(path: Path, count: int = 512) -> None:
    """`count` problems "Tom has a apples and b more . How many ?" with GSM8K's answer line."""
    lines = []
    for i in range(count):
        a, b = i % 10, (i // 10) % 10
        lines.append(json.dumps({"question": f"Tom has {a} apples and {b} more . How many ?",
                                 "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
    path.write_text("".join(lines))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_model(out / "model")
    save_tokenizer(out / "tokenizer", KNOWN_SHAPES["qwen2.5-0.5b"].vocab)
    save_problems(out / "gsm8k.jsonl")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/qwen_shape.py OUT_DIR")
    main(Path(sys.argv[1]))
