"""Chapter 5 — a GSM8K-style maths task read from a local file, for real pretrained models.

Each record is a word problem and a worked solution whose last line is ``#### <number>`` (the
GSM8K format). The prompt is the question plus a short instruction asking the model to end its
own answer the same way; the reward extracts the last ``#### <number>`` from the response and
compares it numerically with the ground truth. It is the canonical "verifiable reward" of
RLVR papers: no learned reward model, just a check.

It is a configuration of the file task (`file_task.py`): the same reader, splits and errors,
with GSM8K's column names, its instruction and its reward. What this file is not: it does
not download GSM8K (point it at a .jsonl, .parquet or datasets directory you already have),
does not grade the reasoning (only the final number counts), and does not tokenize (a chat
model usually wants ``HFTokenizer(path, chat_template=True)``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar

from avrid.ppo.setup.file_task import FileTask, column, prompt_text
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


def _ground_truth(where: str, answer: Any, key: str) -> str:
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, str):
        found = extract_answer(answer)
        if found is not None:
            return found
        bare = _NUMBER_RE.fullmatch(answer)  # already-extracted datasets store just "72"
        if bare:
            return bare.group(1).replace(",", "")
    raise ValueError(f"{where}: field {key!r} must end with '#### <number>' (or be a number), "
                     f"got {answer!r}")


class Gsm8kTask(FileTask):
    """GSM8K-style task: questions and ``#### <number>`` answers from a local file, read as
    the file task reads any file (`file_task.FileTask`), with GSM8K's columns, instruction and
    reward.

    Args:
        path: a .jsonl file (one ``{"question": ..., "answer": ...}`` per line), a .parquet
            file with those columns, or a datasets directory (as `FileTask` reads them).
        prompt_key, answer_key: the question's and the worked answer's columns.
        val_share: without `val_path`, this share of `path` (at least one record) is held
            out for validation, chosen with `seed`; each split keeps the file's order.
        val_path: a separate validation file; then all of `path` is used for training.
        seed: seed of the train/validation split.
        max_response_tokens: the config default for the response length.
        instruction: appended to each question (after a space); "" for none.
        format_score: reward for a response that has a ``####`` number that is wrong
            (0.0 by default: only correct answers count).

    Reward: 1.0 if the last ``#### <number>`` of the response equals the ground truth
    numerically ("1,234" == "1234", "72.0" == "72"), `format_score` if it is another number,
    0.0 if the response has no such marker. No alphabet: its paragraphs of English need a
    real tokenizer (``model.path``).

    Example:
        >>> import json, pathlib, tempfile
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "sums.jsonl"
        >>> rows = [{"question": f"{n} + {n}?", "answer": f"{n} + {n} = {2 * n}\\n#### {2 * n}"}
        ...         for n in range(10)]
        >>> _ = f.write_text("\\n".join(json.dumps(r) for r in rows))
        >>> task = Gsm8kTask(f, val_share=0.2, instruction="")
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

    def __init__(self, path: str | os.PathLike[str], *, prompt_key: str = "question",
                 answer_key: str = "answer", val_share: float | None = None,
                 val_path: str | os.PathLike[str] | None = None, seed: int = 0,
                 max_response_tokens: int = 512, instruction: str = DEFAULT_INSTRUCTION,
                 format_score: float = 0.0) -> None:
        if max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
        self.instruction = instruction  # read by make_prompt, which the reading calls
        self.format_score = format_score
        super().__init__(path, prompt_key=prompt_key, answer_key=answer_key,
                         val_path=val_path, val_share=val_share, seed=seed,
                         max_response_tokens=max_response_tokens)
        self.alphabet = None

    def make_prompt(self, where: str, row: Mapping[str, Any]) -> Prompt:
        """The question with the instruction after it; the number the worked answer ends
        with as the ground truth."""
        question = prompt_text(where, column(where, row, self.prompt_key), self.prompt_key)
        answer = column(where, row, self.answer_key)
        if answer is None:
            raise ValueError(f"{where}: missing field {self.answer_key!r}")
        text = f"{question.strip()} {self.instruction}" if self.instruction else question.strip()
        metadata = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key)}
        return Prompt(index=0, text=text, answer=_ground_truth(where, answer, self.answer_key),
                      metadata=metadata)

    def reward(self, prompt: Prompt, response: str) -> float:
        found = extract_answer(response)
        if found is None:
            return 0.0
        return 1.0 if _same_number(found, prompt.answer) else float(self.format_score)
