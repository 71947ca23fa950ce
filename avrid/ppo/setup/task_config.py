"""Chapter 5 — the `task` section of the config: where prompts and rewards come from.

`TaskConfig` names the task (a built-in, your data file, or your own factory), the data
fields the file-reading tasks take (`path`, the keys, the validation split), the task's
other options, and the reward functions that may replace its reward. `kwargs` is what
`catalog.load_task` gets besides the name, everywhere a task is built (driver, reward
workers, evaluation), so a field added here reaches them all.

This file declares and checks the section; it does not read data (`file_task.py`) or find
tasks (`catalog.py`).
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from avrid.ppo.setup.reward_functions import load_functions, resolve_spec
from avrid.ppo.setup.validate import need


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskConfig:
    """Where prompts and rewards come from (see `catalog.load_task`)."""

    name: str = "digits"
    """"digits" (built in), "file" (your data file, `path`), "gsm8k" (needs `path`), or
    "package.module:factory" (your own)."""
    path: str | None = None
    """Local data for the tasks that read it (file, gsm8k): a .jsonl, .json or .parquet
    file, or a directory written by datasets' save_to_disk (see setup/file_task.py)."""
    prompt_key: str | None = None
    """The prompt's column: text, or a chat of one user message. None: the task's own
    ("prompt" for file, "question" for gsm8k)."""
    answer_key: str | None = None
    """The answer's column; dotted for a nested one (reward_model.ground_truth, verl's
    format). None: "answer". The row's other columns reach a reward function as metadata."""
    val_path: str | None = None
    """A separate validation file (same kinds as `path`); then all of `path` trains."""
    val_share: float | None = None
    """Without `val_path`: the share of `path`'s rows held out for validation, drawn with a
    fixed seed (task.options=seed:N); the splits share no row. None: the task's own (0.1)."""
    alphabet: str | None = None
    """The character tokenizer's alphabet (a tiny model, no model.path): every character a
    prompt or an answer may hold. None: the task's (file: every character of its data)."""
    options: Mapping[str, Any] = field(default_factory=lambda: {"op": "reverse", "length": 3})
    """Extra keyword arguments for the task's constructor/factory. On the command line
    key:value,key:value (task.options=op:sort,length:4; empty for none), each value read as
    the type the task declares for it (else true/false, a number, or the text); JSON and
    anything else are refused (see setup/task_options.py). In a file, a mapping."""
    reward: str | None = None
    """Your reward function instead of the task's: "module:function" (a module on the import
    path; the directory you run avrid from is on it, for the Ray workers too) or
    "path/to/file.py:function". Called as function(prompt, response, answer, **metadata) with
    the prompt's text, the decoded response, the task's answer and the prompt's metadata;
    returns a number, or a dict with "score" and extra values logged as reward/<name>. A
    function with the attribute `batched = True` is called once per batch with lists (and
    each metadata key a list) and returns a list. See setup/reward_functions.py."""
    rewards: Mapping[str, float] = field(default_factory=dict)
    """Several reward functions (specs as for `reward`) with weights: a sample's score is
    sum(weight x function's score). In a file a mapping ({"mod:f1": 0.7, "mod:f2": 0.3});
    on the command line task.rewards=mod:f1=0.7,mod:f2=0.3. Not together with `reward`."""

    def __post_init__(self) -> None:
        need(bool(self.name), "task.name", "must name a task: 'digits', 'gsm8k' or "
             "'package.module:factory'")
        need(self.name not in ("file", "gsm8k") or self.path is not None, "task.path",
             f"the {self.name} task needs local data: a .jsonl, .parquet or datasets "
             f"directory (task.path=...)")
        self._check_data_fields()
        for key, value in dict(self.options).items():
            # Options are saved in every checkpoint's state.json and compared on resume, so
            # they must be plain, finite JSON values (a NaN would only fail at the first save).
            need(_plain_json(value), f"task.options.{key}",
                 f"must be a string, a bool, an int, a finite float, None or a list of "
                 f"those, got {value!r}")
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options)))
        self._check_rewards()

    def _check_data_fields(self) -> None:
        need(self.val_path is None or self.val_share is None, "task.val_share",
             "set task.val_path (a validation file) or task.val_share (a held-out share of "
             "task.path), not both")
        need(self.val_share is None or 0 < self.val_share < 1, "task.val_share",
             f"must be in (0, 1), got {self.val_share}")
        for name in ("prompt_key", "answer_key", "alphabet"):
            need(getattr(self, name) is None or bool(getattr(self, name)), f"task.{name}",
                 "must not be empty (or null for the task's own)")
        need(self.alphabet is None or len(set(self.alphabet)) == len(self.alphabet),
             "task.alphabet", f"repeats a character: {self.alphabet!r}")
        # Each is a keyword of the task's constructor (`kwargs`): given twice, which wins?
        twice = sorted(set(self.options) & set(DATA_FIELDS))
        need(not twice, f"task.options.{twice[0] if twice else ''}",
             f"is a field of its own; set task.{twice[0] if twice else ''}, not an option")

    @property
    def kwargs(self) -> dict[str, Any]:
        """What `catalog.load_task` gets besides the name: `options`, then each of `path`,
        `prompt_key`, `answer_key`, `val_path` and `val_share` that is set (a task that does
        not take one fails, naming it)."""
        return {**self.options, **{name: getattr(self, name) for name in DATA_FIELDS
                                   if getattr(self, name) is not None}}

    def _check_rewards(self) -> None:
        need(self.reward is None or not self.rewards, "task.rewards",
             "set task.reward (one function) or task.rewards (several, weighted), not both")
        for spec, weight in dict(self.rewards).items():
            need(isinstance(spec, str), "task.rewards",
                 f"keys are 'module:function' specs, got {spec!r}")
            need(isinstance(weight, int | float) and not isinstance(weight, bool)
                 and math.isfinite(weight), f"task.rewards.{spec}",
                 f"a weight must be a finite number, got {weight!r}")
        # A file spec is made absolute here, where the user's directory is the current one:
        # the Ray workers that import it run elsewhere.
        if self.reward is not None:
            object.__setattr__(self, "reward", resolve_spec(self.reward))
        object.__setattr__(self, "rewards", types.MappingProxyType(
            {resolve_spec(spec): w for spec, w in dict(self.rewards).items()}))
        try:  # imported now, so a bad spec fails before anything starts, not mid-run
            load_functions(self.reward_weights)
        except ValueError as e:
            need(False, "task.reward" if self.reward is not None else "task.rewards", str(e))

    @property
    def reward_weights(self) -> Mapping[str, float]:
        """The reward functions to use (spec -> weight); empty: the task's own reward."""
        return {self.reward: 1.0} if self.reward is not None else dict(self.rewards)


DATA_FIELDS = ("path", "prompt_key", "answer_key", "val_path", "val_share")
"""The fields of `TaskConfig` passed to the task's constructor as keywords (`kwargs`)."""


def _plain_json(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(_plain_json(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, str | bool | int)
