"""Chapter 5 — your own data, without a class: ``task.name=file`` reads a local file.

A JSONL file, a Parquet file or a directory written by ``datasets.Dataset.save_to_disk`` is
read with the Hugging Face `datasets` library (``load_dataset("json" | "parquet")`` and
``load_from_disk``). Each row becomes one `Prompt`:

- its text is the row's `prompt_key` column: a string, or a chat of one user message
  (verl's parquet format, ``[{"role": "user", "content": ...}]``), whose content is taken;
  the model's chat template (``model.chat_template``) wraps it again as that message;
- its answer is the `answer_key` column, a string or a number; a dotted key reads inside a
  nested column (``reward_model.ground_truth``, verl's format);
- every other column is its metadata, which a reward function (``task.reward``) receives as
  keyword arguments (``data_source=...``, ``extra_info=...``).

Validation prompts come from a second file (`val_path`) or a held-out share of the rows
(`val_share`, 10 % by default), drawn with `seed`: the two splits never share a row. The
task's own reward is an exact match of the stripped response and answer; a reward function
(``task.reward=my_rewards.py:score``) replaces it. For the tiny CPU model the character
tokenizer's alphabet is every character of the prompts and answers, so a small file of your
own trains on a laptop.

Every problem with the data is one line naming the file and what is wrong: the path, the
file type, an empty file, a key the file has no column for (with the columns it has), and
the row of a prompt that is not text or an answer that is missing.

Not here: finding the task by name (`catalog.py`), the config fields that set it up
(``task.path``, ``task.prompt_key``, ... in `config.py`), tokenizing (`tokenizer.py`), or
downloading anything: every path is local.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

from avrid.ppo.setup.task import Prompt

NO_ANSWER_RESPONSE_TOKENS = 64
"""The default response budget of a file without answers (nothing to size it from)."""

DEFAULT_VAL_SHARE = 0.1
"""The share of rows held out for validation when neither `val_path` nor `val_share` is set."""

ALLOWED_FILES = ".jsonl, .json, .parquet, or a directory written by datasets' save_to_disk"
"""What `path` may be; the unsupported-file error names it."""

Row = tuple[str, dict[str, Any]]
"""(where, row): where names the row in errors ("data.jsonl line 3", "data.parquet row 2")."""


def read_rows(path: str) -> list[Row]:
    """Every row of the local file or dataset directory `path`, with where it is, for errors.

    Example:
        >>> import pathlib, tempfile
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
        >>> _ = f.write_text('{"prompt": "1+1=", "answer": "2"}\\n')
        >>> read_rows(str(f))[0][1]
        {'prompt': '1+1=', 'answer': '2'}
        >>> import shutil; shutil.rmtree(f.parent)
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    kind = "dir" if os.path.isdir(path) else os.path.splitext(path)[1].lower()
    if kind not in ("dir", ".jsonl", ".json", ".parquet"):
        raise ValueError(f"data file {path!r}: unsupported type {kind or '(no extension)'!r}; "
                         f"allowed: {ALLOWED_FILES}")
    if kind != "dir" and not _has_content(path, kind):
        raise ValueError(f"data file {path!r} is empty")
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"reading {path!r} needs the datasets library: pip install "
                          f"datasets") from e
    with _quiet(datasets):
        if kind == "dir":
            rows = _from_disk(datasets, path)
            return [(f"{path} row {i}", row) for i, row in enumerate(rows)]
        try:
            rows = list(datasets.load_dataset(kind.lstrip(".").replace("jsonl", "json"),
                                              data_files=path, split="train"))
        except Exception as e:  # noqa: BLE001 (datasets wraps a parse error in its own types)
            if "corresponds to no data" in str(e):  # datasets' words for a file of no rows
                raise ValueError(f"data file {path!r} has no rows") from e
            raise ValueError(_unreadable(path, kind, e)) from e
    if kind == ".parquet":
        return [(f"{path} row {i}", row) for i, row in enumerate(rows)]
    # A JSON-lines row is named by its line: datasets skips blank lines, so count them here.
    lines = _json_lines(path) if kind == ".jsonl" else []
    if len(lines) != len(rows):
        return [(f"{path} row {i}", row) for i, row in enumerate(rows)]
    return [(f"{path} line {line}", row) for line, row in zip(lines, rows, strict=True)]


def _has_content(path: str, kind: str) -> bool:
    if kind == ".parquet":
        return os.path.getsize(path) > 0
    with open(path, encoding="utf-8") as f:  # datasets fails on an empty JSON file obscurely
        return any(line.strip() for line in f)


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No progress bars or logged errors from `datasets` while it reads: avrid reports the
    one line that matters itself. Their previous state comes back afterwards."""
    bars_were_off = datasets.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL + 10)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.enable_progress_bars()


def _from_disk(datasets: Any, path: str) -> list[dict[str, Any]]:
    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise ValueError(f"data directory {path!r} was not written by datasets' save_to_disk "
                         f"(allowed: {ALLOWED_FILES})") from e
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(loaded)
        raise ValueError(f"data directory {path!r} holds several splits ({splits}); point at "
                         f"one of them, e.g. {os.path.join(path, next(iter(loaded)))!r}")
    return list(loaded)


def _json_lines(path: str) -> list[int]:
    """The 1-based numbers of the non-blank lines of a JSON-lines file."""
    with open(path, encoding="utf-8") as f:
        return [n for n, line in enumerate(f, start=1) if line.strip()]


def _unreadable(path: str, kind: str, error: Exception) -> str:
    """One line on why datasets could not read `path`: for JSON lines, the first bad line."""
    if kind == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{path} line {lineno}: not valid JSON ({e.msg})"
                if not isinstance(record, dict):
                    return (f"{path} line {lineno}: expected a JSON object, got "
                            f"{type(record).__name__}")
    cause = error.__cause__ or error
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return f"data file {path!r} cannot be read as {kind.lstrip('.')}: {first}"


def column(where: str, row: Mapping[str, Any], key: str) -> Any:
    """The value of `key` in `row`; a dotted key reads inside nested columns
    ("reward_model.ground_truth"). None where the row has no such value.

    Example:
        >>> column("r", {"reward_model": {"ground_truth": "7"}}, "reward_model.ground_truth")
        '7'
    """
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def check_keys(path: str, rows: Sequence[Row], keys: Mapping[str, str]) -> None:
    """ValueError naming the file, the key and the file's columns when a key (name ->
    key, e.g. "task.prompt_key" -> "question") names no column of the file."""
    columns = list(rows[0][1])
    for name, key in keys.items():
        top = key if key in columns else key.split(".")[0]
        if top not in columns:
            raise ValueError(f"data file {path!r} has no column {key!r} ({name}); its "
                             f"columns: {', '.join(columns)}")


def prompt_text(where: str, value: Any, key: str) -> str:
    """The prompt of a row: a non-empty string, or the content of a one-message user chat."""
    if value is None:
        raise ValueError(f"{where}: missing field {key!r}")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], Mapping):
        message = value[0]
        if message.get("role") != "user":
            raise ValueError(f"{where}: column {key!r} is a chat whose one message has role "
                             f"{message.get('role')!r}; the file task reads one user message")
        value = message.get("content")
    elif isinstance(value, list):
        roles = [m.get("role") if isinstance(m, Mapping) else type(m).__name__ for m in value]
        raise ValueError(f"{where}: column {key!r} is a list {roles}; a prompt is a string or "
                         f"a chat of one user message ([{{'role': 'user', 'content': ...}}])")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: column {key!r} must hold a non-empty string (or a chat of "
                         f"one user message), got {value!r}")
    return value


def answer_text(where: str, value: Any, key: str) -> str:
    """The answer of a row as text: a string, or a number written as text."""
    if value is None:
        raise ValueError(f"{where}: missing field {key!r}")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{where}: answer {key!r} must be a string or a number, got "
                         f"{type(value).__name__} {value!r}")
    return value if isinstance(value, str) else str(value)


def held_out(count: int, share: float, seed: int) -> set[int]:
    """The positions (of `count` rows) held out for validation: `share` of them, at least one
    and never all, drawn with `seed`. The same arguments give the same positions.

    Example:
        >>> sorted(held_out(10, 0.2, seed=0))
        [7, 8]
    """
    if not 0 < share < 1:
        raise ValueError(f"val_share must be in (0, 1), got {share}")
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return set(order[:min(count - 1, max(1, round(count * share)))])


class FileTask:
    """Prompts and answers from a local JSONL, Parquet or datasets directory (module docstring).

    Args:
        path: the training data (``task.path``).
        prompt_key: the prompt's column (``task.prompt_key``).
        answer_key: the answer's column; dotted for a nested one (``task.answer_key``).
            None: "answer" if the file has that column; a file without it (prompts only,
            for a reward model or a reward function that needs no answer) gives every
            prompt the answer "", and the task's own exact-match reward then refuses to run.
        val_path: a separate validation file; then all of `path` trains (``task.val_path``).
        val_share: without `val_path`, the share of `path`'s rows held out for validation,
            drawn with `seed` (``task.val_share``; None: 10 %).
        seed: the seed of that draw (not ``train.seed``: the validation set stays the same
            whichever seed trains).
        max_response_tokens: the default response budget; None: the longest answer's
            characters + 1 (EOS), enough for a character tokenizer. A model that reasons
            before it answers needs ``rollout.max_response_tokens``.

    Reward: 1.0 where the response, stripped, equals the answer, stripped; else 0.0.

    Example:
        >>> import json, pathlib, tempfile
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "sums.jsonl"
        >>> _ = f.write_text("".join(json.dumps({"q": f"{n}+{n}=", "a": 2 * n, "level": n})
        ...                          + "\\n" for n in range(10)))
        >>> task = FileTask(f, prompt_key="q", answer_key="a", val_share=0.2)
        >>> len(task.train_prompts()), len(task.val_prompts()), task.alphabet
        (8, 2, '+0123456789=')
        >>> p = task.train_prompts()[1]
        >>> p.text, p.answer, dict(p.metadata), task.reward(p, " 2 ")
        ('1+1=', '2', {'level': 1}, 1.0)
        >>> import shutil; shutil.rmtree(f.parent)
    """

    name: ClassVar[str] = "file"

    def __init__(self, path: str | os.PathLike[str], *, prompt_key: str = "prompt",
                 answer_key: str | None = None, val_path: str | os.PathLike[str] | None = None,
                 val_share: float | None = None, seed: int = 0,
                 max_response_tokens: int | None = None) -> None:
        if val_path is not None and val_share is not None:
            raise ValueError("set val_path (a validation file) or val_share (a held-out share "
                             "of path), not both")
        if max_response_tokens is not None and max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
        self.path = os.fspath(path)
        self.val_path = None if val_path is None else os.fspath(val_path)
        self.prompt_key, self.answer_key, self.seed = prompt_key, answer_key or "answer", seed
        # A key the user named must exist; the default one may be absent (prompts only).
        self.answers_required = answer_key is not None
        self.has_answers = True
        prompts = self._load(self.path)
        if self.val_path is not None:
            train, val = prompts, self._load(self.val_path)
        else:
            if len(prompts) < 2:
                raise ValueError(f"data file {self.path!r} has {len(prompts)} row(s); a train/"
                                 f"validation split needs at least 2 (or set val_path)")
            share = DEFAULT_VAL_SHARE if val_share is None else val_share
            val_rows = held_out(len(prompts), share, seed)
            train = [p for i, p in enumerate(prompts) if i not in val_rows]
            val = [p for i, p in enumerate(prompts) if i in val_rows]
        # Each split numbered from 0 in the file's order: a prompt's index is stable.
        self._train = [_numbered(p, i) for i, p in enumerate(train)]
        self._val = [_numbered(p, i) for i, p in enumerate(val)]
        everything = [*self._train, *self._val]
        self.alphabet: str | None = "".join(sorted({ch for p in everything
                                                    for ch in p.text + p.answer}))
        longest = max(len(p.answer) for p in everything)
        self.max_response_tokens = max_response_tokens or (
            1 + longest if self.has_answers else NO_ANSWER_RESPONSE_TOKENS)

    def _load(self, path: str) -> list[Prompt]:
        """The prompts of one file, in its order (each index still 0)."""
        rows = read_rows(path)
        if not rows:
            raise ValueError(f"data file {path!r} has no rows")
        keys = {"task.prompt_key": self.prompt_key}
        if self.answers_required or self.answer_key in rows[0][1]:
            keys["task.answer_key"] = self.answer_key
        else:
            self.has_answers = False
        check_keys(path, rows, keys)
        return [self.make_prompt(where, row) for where, row in rows]

    def make_prompt(self, where: str, row: Mapping[str, Any]) -> Prompt:
        """One row as a prompt: its text, its answer, the other columns as metadata."""
        text = prompt_text(where, column(where, row, self.prompt_key), self.prompt_key)
        answer = (answer_text(where, column(where, row, self.answer_key), self.answer_key)
                  if self.has_answers else "")
        # A dotted answer key leaves its column in the metadata: it may hold more (verl's
        # reward_model has a "style" beside the ground truth).
        metadata = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key)}
        return Prompt(index=0, text=text, answer=answer, metadata=metadata)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.path!r}, train={len(self._train)}, "
                f"val={len(self._val)}, seed={self.seed})")

    def train_prompts(self) -> Sequence[Prompt]:
        return self._train

    def val_prompts(self) -> Sequence[Prompt]:
        return self._val

    def reward(self, prompt: Prompt, response: str) -> float:
        if not self.has_answers:
            raise ValueError(f"data file {self.path!r} has no column {self.answer_key!r}, so "
                             f"the file task's exact-match reward has nothing to match; set "
                             f"task.answer_key, a reward function (task.reward=module:function)"
                             f" or a reward model alone (reward_model.rule_weight=0)")
        return 1.0 if response.strip() == prompt.answer.strip() else 0.0


def _numbered(prompt: Prompt, index: int) -> Prompt:
    return Prompt(index=index, text=prompt.text, answer=prompt.answer, metadata=prompt.metadata)
