"""Chapter 5 — a GSM8K-style maths task read from a local file, for real pretrained models.

Each record is a word problem and a worked solution whose last line is ``#### <number>`` (the
GSM8K format). The prompt is the question plus a short instruction asking the model to end its
own answer the same way; the reward extracts the last ``#### <number>`` from the response and
compares it numerically with the ground truth. It is the canonical "verifiable reward" of
RLVR papers: no learned reward model, just a check.

What this file is not: it does not download GSM8K (point it at a .jsonl or .parquet you
already have), does not grade the reasoning (only the final number counts), and does not
tokenize (a chat model usually wants ``HFTokenizer(path, chat_template=True)``).
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar

from avrid.ppo.setup.task import Prompt

DEFAULT_INSTRUCTION = "Let's think step by step and output the final answer after '####'."

# "#### 1,234", "#### -3.5", "#### $72": a number after the marker; commas and "$" allowed.
_ANSWER_RE = re.compile(r"####\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")
_NUMBER_RE = re.compile(r"\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)\s*")


def extract_answer(text: str) -> str | None:
    """The number after the LAST ``####`` in `text`, commas removed; None if there is none.

    Example:
        >>> extract_answer("She pays 3 * 4 = 12 dollars.\\n#### 1,234")
        '1234'
        >>> extract_answer("#### 5 ... no wait #### -3.5"), extract_answer("the answer is 7")
        ('-3.5', None)
    """
    found = _ANSWER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def _same_number(a: str, b: str) -> bool:
    # Decimal, not float: "72.00" equals "72" and nothing is lost to binary rounding.
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return False


def _read_rows(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) for each record of a .jsonl or .parquet file; `where` is for errors."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"GSM8K file {path!r} does not exist")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq  # optional: avrid does not depend on pyarrow
        except ImportError as e:
            raise ImportError(f"reading {path!r} needs pyarrow (pip install pyarrow), or "
                              "convert the file to .jsonl (one JSON object per line)") from e
        rows = pq.read_table(path).to_pylist()
        return [(f"{path} row {i}", row) for i, row in enumerate(rows)]
    if not path.endswith((".jsonl", ".json")):
        raise ValueError(f"GSM8K file {path!r} must be .jsonl or .parquet")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object with 'question' and "
                                 f"'answer', got {type(record).__name__}")
            out.append((where, record))
    return out


def _ground_truth(where: str, answer: Any) -> str:
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, str):
        found = extract_answer(answer)
        if found is not None:
            return found
        bare = _NUMBER_RE.fullmatch(answer)  # already-extracted datasets store just "72"
        if bare:
            return bare.group(1).replace(",", "")
    raise ValueError(f"{where}: field 'answer' must end with '#### <number>' (or be a number), "
                     f"got {answer!r}")


def _load_prompts(path: str, instruction: str) -> list[tuple[str, str]]:
    """(prompt text, ground truth) for each record of `path`."""
    out = []
    for where, record in _read_rows(path):
        for key in ("question", "answer"):
            if key not in record:
                raise ValueError(f"{where}: missing field {key!r}")
        question = record["question"]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: field 'question' must be a non-empty string")
        text = f"{question.strip()} {instruction}" if instruction else question.strip()
        out.append((text, _ground_truth(where, record["answer"])))
    if not out:
        raise ValueError(f"GSM8K file {path!r} has no records")
    return out


def _prompts(pairs: Sequence[tuple[str, str]]) -> list[Prompt]:
    return [Prompt(index=i, text=text, answer=answer) for i, (text, answer) in enumerate(pairs)]


class Gsm8kTask:
    """GSM8K-style task: questions and ``#### <number>`` answers from a local file.

    Args:
        path: a .jsonl file (one ``{"question": ..., "answer": ...}`` per line) or a .parquet
            file with those columns (needs pyarrow).
        val_fraction: without `val_path`, this fraction of `path` (at least one record) is held
            out for validation, chosen with `seed`; each split keeps the file's order.
        val_path: a separate validation file; then all of `path` is used for training.
        seed: seed of the train/validation split.
        max_response_tokens: the config default for the response length.
        instruction: appended to each question (after a space); "" for none.
        format_score: reward for a response that has a ``####`` number that is wrong
            (0.0 by default: only correct answers count).

    Reward: 1.0 if the last ``#### <number>`` of the response equals the ground truth
    numerically ("1,234" == "1234", "72.0" == "72"), `format_score` if it is another number,
    0.0 if the response has no such marker.

    Example:
        >>> import json, pathlib, tempfile
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "sums.jsonl"
        >>> rows = [{"question": f"{n} + {n}?", "answer": f"{n} + {n} = {2 * n}\\n#### {2 * n}"}
        ...         for n in range(10)]
        >>> _ = f.write_text("\\n".join(json.dumps(r) for r in rows))
        >>> task = Gsm8kTask(f, val_fraction=0.2, instruction="")
        >>> len(task.train_prompts()), len(task.val_prompts())
        (8, 2)
        >>> p = task.train_prompts()[1]
        >>> p.text, p.answer
        ('1 + 1?', '2')
        >>> task.reward(p, "1 + 1 = 2\\n#### 2"), task.reward(p, "#### 3"), task.reward(p, "2")
        (1.0, 0.0, 0.0)
        >>> import shutil; shutil.rmtree(f.parent)
    """

    name: ClassVar[str] = "gsm8k"
    alphabet: ClassVar[str | None] = None

    def __init__(self, path: str | os.PathLike[str], *, val_fraction: float = 0.1,
                 val_path: str | os.PathLike[str] | None = None, seed: int = 0,
                 max_response_tokens: int = 512, instruction: str = DEFAULT_INSTRUCTION,
                 format_score: float = 0.0) -> None:
        if max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
        self.path = os.fspath(path)
        self.val_path = None if val_path is None else os.fspath(val_path)
        self.seed = seed
        self.max_response_tokens = max_response_tokens
        self.instruction = instruction
        self.format_score = format_score
        pairs = _load_prompts(self.path, instruction)
        if self.val_path is not None:
            self._train = _prompts(pairs)
            self._val = _prompts(_load_prompts(self.val_path, instruction))
            return
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if len(pairs) < 2:
            raise ValueError(f"GSM8K file {self.path!r} has {len(pairs)} record(s); a train/"
                             "validation split needs at least 2 (or pass val_path)")
        order = list(range(len(pairs)))
        random.Random(seed).shuffle(order)
        n_val = min(len(pairs) - 1, max(1, round(len(pairs) * val_fraction)))
        held_out = set(order[:n_val])
        self._train = _prompts([p for i, p in enumerate(pairs) if i not in held_out])
        self._val = _prompts([p for i, p in enumerate(pairs) if i in held_out])

    def __repr__(self) -> str:
        return (f"Gsm8kTask({self.path!r}, train={len(self._train)}, val={len(self._val)}, "
                f"seed={self.seed})")

    def train_prompts(self) -> Sequence[Prompt]:
        return self._train

    def val_prompts(self) -> Sequence[Prompt]:
        return self._val

    def reward(self, prompt: Prompt, response: str) -> float:
        found = extract_answer(response)
        if found is None:
            return 0.0
        return 1.0 if _same_number(found, prompt.answer) else float(self.format_score)
