"""Chapter 5 — ``section.field=value`` overrides: the command line's ``--set``.

`with_overrides` parses each assignment into the field's declared type (bool, int, float,
str, None, a `Literal` choice; ``task.options`` as ``key:value,key:value`` typed by the task,
task_options.py; ``task.rewards`` as ``module:function=weight,...``, reward_functions.py) and
returns a new config, checked again by every section and by `validate`. Unknown sections or
fields are refused, listing the allowed ones.

A ``--set`` value is text, so it is read *as* the field's type, and accepted where the same
value written in a config file would be (config_file.py's one rule): ``train.steps=3`` is 3,
``train.steps=3.0`` is refused (3.0 is no int, in a file either); ``train.actor_lr=1e-6`` and
``train.actor_lr=1`` are floats; a bool is one of YAML's words for one (true/false, yes/no,
on/off), not ``1``; a str field takes the text as it is (``model.path=on`` is the path "on").
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.reward_functions import parse_weights
from avrid.ppo.setup.task_options import parse_options

BOOLS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
"""The words ``--set`` reads as a bool (any case): YAML's, so a file and --set agree."""


def with_overrides(config: PPOConfig, assignments: Sequence[str]) -> PPOConfig:
    """A new config with ``section.field=value`` assignments applied and validated again.

    Example:
        >>> c = with_overrides(PPOConfig(), ["algo.name=grpo", "train.steps=5"])
        >>> c.algo.name, c.train.steps
        ('grpo', 5)
    """
    changes: dict[str, dict[str, Any]] = {}
    options: str | None = None  # task.options' text, read below for the task it is meant for
    for text in assignments:
        key, sep, raw = text.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"override {text!r} must look like section.field=value")
        if section not in PPOConfig.__dataclass_fields__:
            raise ValueError(f"override {text!r}: unknown section {section!r}; allowed: "
                             f"{', '.join(PPOConfig.__dataclass_fields__)}")
        current = getattr(config, section)
        names = [f.name for f in dataclasses.fields(current)]
        if name not in names:
            raise ValueError(f"override {text!r}: {section} has no field {name!r}; fields: "
                             f"{', '.join(names)}")
        if key.strip() == "task.options":
            options = raw.strip()
            continue
        hint = typing.get_type_hints(type(current))[name]
        changes.setdefault(section, {})[name] = _parse(raw.strip(), hint, key)
    if options is not None:  # typed by the task's declared options (task_options.py)
        task = changes.get("task", {}).get("name", config.task.name)
        changes.setdefault("task", {})["options"] = parse_options(options, task)
    # One replace per section, after all assignments: fields checked together (e.g. backend
    # and dp) see their new values at once.
    return dataclasses.replace(config, **{sec: dataclasses.replace(getattr(config, sec), **kw)
                                          for sec, kw in changes.items()})


def _parse(raw: str, hint: Any, key: str) -> Any:
    """Turn a command-line string into the field's type (bool, int, float, str, None, dict)."""
    if key.strip() == "task.rewards":  # `spec=weight`: a spec holds ':' (task.options: above)
        return parse_weights(raw)
    origin = typing.get_origin(hint)
    optional = origin in (typing.Union, types.UnionType)  # `float | None` and friends
    args = typing.get_args(hint) if optional else ()
    if raw.lower() in ("none", "null") and type(None) in args:
        return None
    if origin is Literal:
        return raw
    # `bool | Literal["auto"]`: one of the choices is read as itself, anything else as the type.
    if any(raw in typing.get_args(a) for a in args if typing.get_origin(a) is Literal):
        return raw
    kind = next((a for a in args if a is not type(None)), hint)
    try:
        if kind is bool:
            if raw.lower() not in BOOLS:
                raise ValueError
            return BOOLS[raw.lower()]
        if kind in (int, float, str):
            return kind(raw)  # int("3.0") fails: a whole number only, as in a file
    except ValueError:
        allowed = f" ({', '.join(BOOLS)})" if kind is bool else ""
        raise ValueError(f"override {key}={raw!r}: expected a value of type "
                         f"{getattr(kind, '__name__', kind)}{allowed}") from None
    return raw

