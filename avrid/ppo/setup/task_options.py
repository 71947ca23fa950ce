"""Chapter 5 — ``--set task.options=...``: one syntax, read strictly.

The task's keyword arguments are written ``key:value,key:value`` (empty: none), e.g.
``task.options=op:sort,length:4``. Each value is read as the type the task declares for that
keyword — a built-in task's field, or your factory's annotated parameter — so ``length:4`` is
the int 4 for the digit task and ``length:nan`` is refused naming ``length``. Where the task
declares no type (an unannotated parameter, ``**options``), the text reads as ``true``/
``false`` (a bool), a whole number (an int), a decimal number (a float) or else as itself (a
string): ``mode:nan`` is the string "nan", never a float.

Anything else is refused in one line naming the option text, what is wrong and the syntax:
JSON (``{"op": "sort"}`` used to be split at its commas into keys like ``'{"op"'``), a part
without ``:``, a key that is not a Python name or that the task does not take, a key given
twice, an empty value, or a value the declared type cannot read.

A config file needs none of this: there `task.options` is a mapping, and YAML/JSON give each
value its type. Not here: the other fields' ``--set`` parsing (overrides.py), loading the
task (catalog.py).
"""

from __future__ import annotations

import inspect
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from avrid.ppo.setup.catalog import task_constructor

SYNTAX = "key:value,key:value (e.g. task.options=op:sort,length:4; empty for none)"
"""The one syntax of ``--set task.options``; every error names it."""

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][+-]?[0-9]+)?")


def parse_options(text: str, task_name: str) -> dict[str, Any]:
    """The options `text` means for the task `task_name`; ValueError in one line otherwise.

    Example:
        >>> parse_options("op:sort,length:4", "digits")
        {'op': 'sort', 'length': 4}
    """
    head = f"task.options={text!r}"
    if text.lstrip().startswith(("{", "[")):
        raise ValueError(f"{head}: JSON is not read here; write {SYNTAX}")
    declared, open_ended = _declared(task_name)
    options: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, colon, raw = (s.strip() for s in part.partition(":"))
        if not colon or not key.isidentifier():
            problem = "has no ':'" if not colon else f"has key {key!r}, not a name"
            raise ValueError(f"{head}: {part!r} {problem}; write {SYNTAX}")
        if key in options:
            raise ValueError(f"{head}: key {key!r} is given twice; write {SYNTAX}")
        if not raw:
            raise ValueError(f"{head}: key {key!r} has no value; write {SYNTAX}")
        if key not in declared and not open_ended:
            raise ValueError(f"{head}: task {task_name!r} takes no option {key!r}; it takes "
                             f"{', '.join(declared) or 'none'}")
        options[key] = _typed(raw, declared.get(key), head, key)
    return options


def _declared(task_name: str) -> tuple[dict[str, Any], bool]:
    """The task's keyword options (name -> annotation, None where it has none) and whether
    it also takes any other keyword (``**kwargs``). A task that cannot be imported yet
    declares nothing and takes anything: starting the run names what is wrong with it."""
    try:
        make = task_constructor(task_name)
        parameters = inspect.signature(make).parameters.values()
    except Exception:  # e.g. the module raises on import: load_task reports it at start
        return {}, True
    hints = _hints(make)
    declared = {p.name: hints.get(p.name) for p in parameters
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return declared, any(p.kind is p.VAR_KEYWORD for p in parameters)


def _hints(make: Callable[..., Any]) -> dict[str, Any]:
    """The annotations of what `make` is called with: a class's ``__init__`` (a dataclass's
    is generated from its fields) or a factory's parameters."""
    try:
        return typing.get_type_hints(make.__init__ if isinstance(make, type) else make)
    except Exception:  # an annotation that does not resolve: treat as undeclared
        return {}


def _typed(raw: str, hint: Any, head: str, key: str) -> Any:
    """`raw` as the declared type `hint` (None: by its look, see the module docstring)."""
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else (hint,)
    if type(None) in kinds and raw in ("null", "none", "None"):
        return None
    for kind in kinds:
        if kind is bool and raw in ("true", "false"):
            return raw == "true"
        if kind is int and _INT.fullmatch(raw):
            return int(raw)
        if kind is float and _FLOAT.fullmatch(raw):
            return float(raw)
        if kind is str or typing.get_origin(kind) is typing.Literal:
            return raw  # a choice is checked by the task itself, naming the allowed ones
    if hint is None or hint is Any or not any(k in (bool, int, float) for k in kinds):
        return _by_look(raw)
    wanted = " or ".join("null" if k is type(None) else getattr(k, "__name__", str(k))
                         for k in kinds)
    raise ValueError(f"{head}: {key} must be {wanted} (the task declares {key}: {wanted}), "
                     f"got {raw!r}")


def _by_look(raw: str) -> Any:
    if raw in ("true", "false"):
        return raw == "true"
    if _INT.fullmatch(raw):
        return int(raw)
    if _FLOAT.fullmatch(raw) and math.isfinite(float(raw)):
        return float(raw)
    return raw
