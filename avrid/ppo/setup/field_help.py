"""Chapter 5 — every config field explained: what ``avrid ppo --help-config`` prints.

Each field of a section (`config.py`, and the sections it imports: `rollout.py`,
`pipeline.py`) is documented by the string literal on the line below it. Python
keeps a class's docstring at runtime but throws these attribute docstrings away, so
`field_docs` reads them back from the module's source with `ast`: for every annotated
assignment (``steps: int = 150``) directly followed by a string, that string.

`help_config` lists each ``section.field`` with its type, its default and that docstring:

    train.steps: int = 150
        Training steps (one step = generate, score, learn, sync).

Types and defaults are written as they would be in a config file (JSON values, which YAML
reads too): a choice is ``"ppo" | "grpo"``, a field that may be empty is ``int | null``.
`type_text` is also what `config_file` names when a file holds a value of the wrong type.

Not here: reading or writing configs (config_file.py), the checks on values (config.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from avrid.ppo.setup.config import PPOConfig


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in `cls`'s source (fields without one
    are left out).

    Example:
        >>> from avrid.ppo.setup.config import TrainConfig
        >>> field_docs(TrainConfig)["steps"]
        'Training steps (one step = generate, score, learn, sync).'
    """
    # Parse the whole module and find the class by name: the class object itself no longer
    # knows where its source starts once @dataclass(slots=True) has rebuilt it.
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    [node] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    docs = {}
    for statement, following in zip(node.body, node.body[1:], strict=False):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def type_text(hint: Any) -> str:
    """A field's annotation as a config file sees it: ``int``, ``int | null``,
    ``"ppo" | "grpo"``, ``mapping``.

    Example:
        >>> type_text(typing.Literal["ppo", "grpo"]), type_text(float | None)
        ('"ppo" | "grpo"', 'float | null')
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # `float | None` and friends
        return " | ".join(type_text(a) for a in typing.get_args(hint))
    if origin is Literal:
        return " | ".join(json.dumps(choice) for choice in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if hint is Mapping or origin in (Mapping, dict):
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def default_text(f: dataclasses.Field) -> str:
    """A field's default as a config file would hold it (JSON, which YAML reads too)."""
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return json.dumps(dict(value) if isinstance(value, Mapping) else value)


def help_config(section: str | None = None) -> str:
    """Every field of every section (or of `section` only): name, type, default, docstring.
    An unknown section is a ValueError listing the allowed ones."""
    sections = [f.name for f in dataclasses.fields(PPOConfig)]
    if section is not None and section not in sections:
        raise ValueError(f"--help-config: unknown section {section!r}; allowed: "
                         f"{', '.join(sections)}")
    classes = typing.get_type_hints(PPOConfig)
    lines = ["Every field of a config, as `--set section.field=value` and a --config file name "
             "it.", "Defaults are the fields' own; a preset changes some of them (see "
             "`avrid ppo --print-config`).", ""]
    for name in sections if section is None else [section]:
        cls = classes[name]
        lines += [_first_paragraph(f"{name}: ", cls.__doc__), ""]
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            lines.append(f"  {name}.{f.name}: {type_text(hints[f.name])} = {default_text(f)}")
            lines += [f"      {line}".rstrip() for line in docs.get(f.name, "").splitlines()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _first_paragraph(head: str, doc: str | None) -> str:
    text = inspect.cleandoc(doc or "").split("\n\n")[0]
    return textwrap.fill(head + " ".join(text.split()), width=96, subsequent_indent="  ")
