"""Chapter 5 — tokenizers: text to token ids and back, for prompts and rewards.

The trainer needs exactly four things from a tokenizer: turn a prompt into ids, turn generated
ids back into text for the reward, know the vocabulary size (to build a tiny model from
scratch) and know which id ends a response (EOS) and which fills a ragged batch (pad). The
`Tokenizer` protocol is those four things and nothing more, so two very different tokenizers
fit behind it:

- `CharTokenizer` — one token per character of a fixed alphabet. The built-in digit task uses
  it with a tiny randomly initialised model that learns on a CPU in minutes.
- `HFTokenizer` — a local Hugging Face tokenizer directory, optionally wrapping each prompt in
  the model's chat template, for real pretrained models.

`load_tokenizer("char:0123456789=")` or `load_tokenizer("/path/to/model")` picks one.

What this file is not: it does not cut responses at EOS (the rollout does, before decoding),
does not batch or pad (the rollout does), and never downloads anything — a path must already
be on disk, because the same tokenizer is rebuilt on every Ray worker from what was pickled.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:  # annotations only: the config and the task do not need a tokenizer
    from avrid.ppo.setup.config import PPOConfig
    from avrid.ppo.setup.task import Task

PAD_ID = 0
EOS_ID = 1


class Tokenizer(Protocol):
    """What the trainer and the rollout need from a tokenizer.

    Optional, not part of the protocol: `max_token_chars`, the most characters one token
    stands for (both tokenizers here have it). Chapter 7's episode loop reads it with
    `getattr` to skip tokenizing an observation too long to fit (`avrid.agents.episodes`).
    """

    @property
    def vocab_size(self) -> int:
        """Number of ids; every id from `encode` is in range(vocab_size)."""
        ...

    @property
    def eos_token_id(self) -> int:
        """The id that ends a response; generation stops when it is sampled."""
        ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a response, `eos_token_id` first (chat models list several)."""
        ...

    @property
    def pad_token_id(self) -> int:
        """The id that fills ragged batches; never the target of a loss."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (the prompt as the model should see it)."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` as it is, inside a sequence: no chat template around it, no
        special tokens added (chapter 7's observations and turn-stop markers)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`. Does not stop at EOS: the caller cuts the response first."""
        ...


@dataclass(frozen=True, slots=True)
class CharTokenizer:
    """One token per character: id 0 is <pad>, id 1 is <eos>, then the alphabet in order.

    Example:
        >>> tok = CharTokenizer("0123456789=")
        >>> tok.encode("381=")
        [5, 10, 3, 12]
        >>> tok.decode([5, 10, 3, 1, 0])  # pad and eos are skipped
        '381'
        >>> tok.vocab_size, tok.eos_token_id, tok.pad_token_id
        (13, 1, 0)
    """

    alphabet: str
    # Derived lookup table; excluded from eq/repr so two tokenizers compare by alphabet only.
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.alphabet:
            raise ValueError("CharTokenizer needs a non-empty alphabet")
        seen: set[str] = set()
        for ch in self.alphabet:
            if ch in seen:
                raise ValueError(f"CharTokenizer alphabet {self.alphabet!r} repeats {ch!r}")
            seen.add(ch)
        object.__setattr__(self, "_ids", {ch: i + 2 for i, ch in enumerate(self.alphabet)})

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 2

    @property
    def max_token_chars(self) -> int:
        """One: every token is one character (pad and eos stand for none)."""
        return 1

    @property
    def eos_token_id(self) -> int:
        return EOS_ID

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (EOS_ID,)

    @property
    def pad_token_id(self) -> int:
        return PAD_ID

    def encode(self, text: str) -> list[int]:
        """Ids of each character; ValueError names the first character not in the alphabet."""
        try:
            return [self._ids[ch] for ch in text]
        except KeyError:
            pos, bad = next((i, ch) for i, ch in enumerate(text) if ch not in self._ids)
            raise ValueError(f"character {bad!r} at position {pos} of {text!r} is not in the "
                             f"tokenizer alphabet {self.alphabet!r}") from None

    def encode_text(self, text: str) -> list[int]:
        """The same as `encode`: a character tokenizer has no template and adds nothing."""
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Characters of `ids`, skipping pad and eos; ValueError on an id out of range."""
        out = []
        for i in ids:
            i = int(i)  # accepts numpy / torch integer scalars too
            if i in (PAD_ID, EOS_ID):
                continue
            if not 2 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is out of range for a CharTokenizer with "
                                 f"vocab_size {self.vocab_size}")
            out.append(self.alphabet[i - 2])
        return "".join(out)


class HFTokenizer:
    """A local Hugging Face tokenizer directory behind the `Tokenizer` protocol.

    Args:
        path: a directory (or tokenizer file) that `AutoTokenizer.from_pretrained` can load
            offline; it must exist — nothing is downloaded.
        chat_template: when True, `encode(text)` wraps `text` as one user message with the
            tokenizer's chat template and appends the generation prompt (the assistant's turn
            header), as instruction-tuned models expect. "auto": the same where the tokenizer
            has a chat template, plain text where it has none (`uses_template` says which).

    The pad id falls back to the EOS id when the tokenizer has no pad token (most decoder-only
    models). `decode` skips special tokens. Pickling keeps only the path and the flag; the
    tokenizer is reloaded from the path on the other side (a Ray worker on the same machine or
    a shared filesystem).
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 chat_template: bool | Literal["auto"] = False) -> None:
        if chat_template not in (True, False, "auto"):
            raise ValueError(f"chat_template must be true, false or 'auto', got "
                             f"{chat_template!r}")
        self.path = os.fspath(path)
        self.chat_template = chat_template
        self._tok = self._load()

    @property
    def uses_template(self) -> bool:
        """Whether `encode` wraps a prompt in the chat template (True, or "auto" with a
        tokenizer that has one)."""
        has_one = bool(getattr(self._tok, "chat_template", None))
        return self.chat_template is True or (self.chat_template == "auto" and has_one)

    def _load(self) -> Any:
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"tokenizer path {self.path!r} does not exist (HFTokenizer "
                                    "loads local files only; download the model first)")
        from transformers import AutoTokenizer  # heavy import: only when a real model is used

        tok = AutoTokenizer.from_pretrained(self.path)
        if tok.eos_token_id is None:
            raise ValueError(f"tokenizer at {self.path!r} has no EOS token; the rollout needs "
                             "one to know where a response ends")
        if self.chat_template is True and not getattr(tok, "chat_template", None):
            raise ValueError(f"chat_template=True but the tokenizer at {self.path!r} has no "
                             "chat template; use chat_template=False (or 'auto')")
        return tok

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "chat_template": self.chat_template}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self.chat_template = state["chat_template"]
        self._tok = self._load()

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, chat_template={self.chat_template})"

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too; `.vocab_size` alone would miss them.
        return len(self._tok)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: the longest token over the vocabulary,
        measured once (a second or so for 150k tokens) and kept. Both its stored form and its
        decoded text count: SentencePiece's "▁the" is " the" in a text although alone it
        decodes to "the", a byte-level BPE's "ĠĠĠ" is three spaces. Not pickled."""
        ids = list(range(len(self._tok)))
        stored = self._tok.convert_ids_to_tokens(ids)
        decoded = self._tok.batch_decode([[i] for i in ids])
        return max(1, max(len(t or "") for t in stored), max(len(t) for t in decoded))

    @property
    def eos_token_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS, then every EOS id of the model's generation config next to it
        (Qwen2.5-Instruct ends a turn with <|im_end|> but lists <|endoftext|> too): a rollout
        that stopped at the tokenizer's EOS alone would run past a finished answer."""
        ids = [self.eos_token_id]
        gen = os.path.join(self.path, "generation_config.json")
        if os.path.isfile(gen):
            import json

            with open(gen, encoding="utf-8") as f:
                listed = json.load(f).get("eos_token_id")
            ids += listed if isinstance(listed, list) else [] if listed is None else [listed]
        return tuple(dict.fromkeys(int(i) for i in ids))

    @property
    def pad_token_id(self) -> int:
        pad = self._tok.pad_token_id
        return self.eos_token_id if pad is None else int(pad)

    def encode(self, text: str) -> list[int]:
        if self.uses_template:
            # return_dict=False: transformers 5 returns a BatchEncoding by default, 4 a list.
            ids = self._tok.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            return [int(i) for i in ids]
        return [int(i) for i in self._tok.encode(text)]

    def encode_text(self, text: str) -> list[int]:
        # No BOS or other special token: the text continues a sequence already begun.
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(spec: str, *, chat_template: bool | Literal["auto"] = False) -> Tokenizer:
    """A tokenizer from a spec: ``"char:<alphabet>"`` or a local tokenizer/model path.

    Example:
        >>> load_tokenizer("char:ab").encode("ba")
        [3, 2]
    """
    if spec.startswith("char:"):
        if chat_template is True:  # "auto": a character tokenizer has none, so none is used
            raise ValueError(f"chat_template=True needs a Hugging Face tokenizer, not {spec!r}")
        return CharTokenizer(spec[len("char:"):])
    return HFTokenizer(spec, chat_template=chat_template)


def response_text(tokens: list[int], tokenizer: Tokenizer) -> str:
    """Decode a response, dropping the first stop token (any EOS id) and anything after it."""
    stops = set(tokenizer.stop_token_ids)
    end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokenizer.decode(tokens[:end])


def make_tokenizer(config: PPOConfig, task: Task) -> Tokenizer:
    """The char tokenizer for tiny models, over `task.alphabet` where the config sets one,
    else the task's; else a local one (`validate` has checked that a char tokenizer has an
    alphabet)."""
    m = config.model
    spec = m.tokenizer or ("char" if m.path is None else m.path)
    if spec == "char":
        return load_tokenizer(f"char:{config.task.alphabet or task.alphabet}")
    return load_tokenizer(spec, chat_template=m.chat_template)
