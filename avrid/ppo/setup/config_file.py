"""Chapter 5 — a config as a file: YAML or JSON out, and back in, field for field.

``avrid ppo --print-config > run.yaml`` writes the whole config; ``avrid ppo --config run.yaml``
reads it back into the same `PPOConfig` (and printing that prints the same text):

    config_to_dict     PPOConfig -> plain nested dicts (files, state.json, loggers)
    config_from_dict   plain nested dicts -> PPOConfig: strict, type-checked, validated
    dump_config        the text of a config, YAML or JSON (what --print-config prints)
    read_config        a .yaml/.yml/.json file -> PPOConfig (the format by its extension)
    write_config       PPOConfig -> a file, atomically

A file is a whole config, not a patch: a section or field it leaves out takes the field's
default, and a section or field `PPOConfig` does not have is refused, listing the allowed
ones, so a typo never silently turns into a default. A key written twice in one mapping
(two ``train:`` sections, ``steps: 3`` then ``steps: 5``) is refused too, naming the key
and both lines: YAML and JSON readers keep the last one silently, so the first would be lost.

A value in a file has the type its text gives it, and must already be of the field's type
(the annotation in `config.py`): ``steps: 3`` is an int, ``steps: 3.0`` a float and
``steps: "3"`` a string, and only the first is an int field's value. The one conversion is
the lossless one: an int is a valid float (``lr: 1``). YAML is read with YAML 1.2's numbers,
so ``1e-6`` is the float it looks like (PyYAML's YAML 1.1 would make it a string). ``--set``
is text by nature, so overrides.py reads its text *as* the field's type, by the same rule:
``train.steps=3`` is 3, ``train.steps=3.0`` is refused, as in a file. Ranges and choices are
then checked by the sections themselves, exactly as for a config made in Python.

Not here: presets (presets.py), ``--set`` (overrides.py), and how the command line orders
them (`avrid/commands/ppo.py`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.field_help import type_text
from avrid.ppo.setup.validate import need
from avrid.results import atomic_write

FORMATS = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}
"""File extension -> format."""


class DuplicateKeyError(ValueError):
    """A key written twice in one mapping of a config file; the message names it and its
    lines."""


MERGE_TAG = "tag:yaml.org,2002:merge"
"""The tag of YAML's ``<<`` key, which merges another mapping into this one."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping (`DuplicateKeyError`)
    and reading ``1e-6`` as a float (see the module docstring)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}  # key -> the line it was first written on
        for key_node, _ in node.value:
            # `<<: *base` merges another mapping in, whose keys this one may override: only
            # keys written here count. Keys that are not plain scalars are PyYAML's to refuse.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first:
                raise DuplicateKeyError(f"duplicate key {key!r} at line {line} (first at line "
                                        f"{first[key]}): each key may appear once in a "
                                        f"mapping; keep one")
            first[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) needs a dot in a float and a sign in its exponent, so `1e-6` and `1.5e6`
# would be strings; YAML 1.2, and every reader of it, makes them floats. Added to this loader
# only: PyYAML's own SafeLoader, which the user's code may use, is left as it is.
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _json_duplicate(text: str) -> str | None:
    """The first key written twice in one object of the (valid) JSON `text`, as a message
    naming it and its lines; None when there is none.

    `json.loads` keeps the last of two equal keys and says nothing, and its
    ``object_pairs_hook`` sees the pairs but not where they are; so the text is scanned: a
    string followed by ``:`` is a key, in the object on top of the stack.
    """
    tokens = list(re.finditer(r'"(?:[^"\\]|\\.)*"|[{}\[\]:]', text))
    objects: list[dict[str, int] | None] = []  # open objects (key -> offset), None: an array
    for i, token in enumerate(tokens):
        t = token.group()
        if t == "{":
            objects.append({})
        elif t == "[":
            objects.append(None)
        elif t in ("}", "]"):
            objects.pop()
        elif t.startswith('"') and i + 1 < len(tokens) and tokens[i + 1].group() == ":":
            key, keys = json.loads(t), objects[-1]  # json.loads: "st\u0065ps" is "steps"
            assert keys is not None  # a key is always inside an object in valid JSON
            if key in keys:
                line, before = (text.count("\n", 0, at) + 1 for at in (token.start(), keys[key]))
                return (f"duplicate key {key!r} at line {line} (first at line {before}): each "
                        f"key may appear once in an object; keep one")
            keys[key] = token.start()
    return None


def config_to_dict(config: PPOConfig) -> dict[str, dict[str, Any]]:
    """The config as nested dicts of plain values (tuples become lists, mappings dicts), so
    YAML and JSON write it, and reading it back compares equal to what was written.

    Example:
        >>> config_to_dict(PPOConfig())["train"]["steps"]
        150
    """
    return {s.name: {f.name: _plain(getattr(getattr(config, s.name), f.name))
                     for f in dataclasses.fields(getattr(config, s.name))}
            for s in dataclasses.fields(config)}


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def config_from_dict(data: Mapping[str, Any]) -> PPOConfig:
    """A validated `PPOConfig` from nested dicts as `config_to_dict` (or a file) gives them.

    Missing sections and fields take their defaults; an unknown section or field, or a value
    of the wrong type, is a ValueError naming it (and what is allowed).

    Example:
        >>> config_from_dict({"algo": {"name": "grpo"}, "train": {"steps": 5}}).algo.name
        'grpo'
    """
    classes = typing.get_type_hints(PPOConfig)  # section name -> its dataclass
    if not isinstance(data, Mapping):
        raise ValueError(f"a config is a mapping of sections ({', '.join(classes)}), got "
                         f"{_kind(data)}")
    for section in data:
        if section not in classes:
            raise ValueError(f"unknown section {section!r}; allowed: {', '.join(classes)}")
    sections = {}
    for section, values in data.items():
        values = {} if values is None else values  # `train:` with nothing under it in YAML
        need(isinstance(values, Mapping), section,
             f"a section is a mapping of fields, got {_kind(values)}")
        cls = classes[section]
        hints = typing.get_type_hints(cls)
        for name in values:
            if name not in hints:
                raise ValueError(f"{section} has no field {name!r}; fields: "
                                 f"{', '.join(hints)}")
        sections[section] = cls(**{name: _value(value, hints[name], f"{section}.{name}")
                                   for name, value in values.items()})
    return PPOConfig(**sections)


def _value(value: Any, hint: Any, key: str) -> Any:
    """`value` checked against the field's annotation `hint`; ValueError naming `key`."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for kind in typing.get_args(hint) if union else (hint,):
        if kind is type(None) and value is None:
            return None
        if typing.get_origin(kind) is Literal and isinstance(value, str):
            return value  # the section checks the choice, listing the allowed ones
        if kind is bool and isinstance(value, bool):
            return value
        if isinstance(value, bool):  # True is an int to Python, not to a config
            continue
        if kind is int and isinstance(value, int):
            return value
        if kind is float and isinstance(value, int | float):
            return value  # an int is a valid float (1, not 1.0): kept, so the text round-trips
        if kind is str and isinstance(value, str):
            return value
        if (kind is Mapping or typing.get_origin(kind) in (Mapping, dict)) and isinstance(
                value, Mapping):
            return dict(value)
    # A quoted number is a string in a file, as `3.0` is a float: a value keeps its type.
    hint_text = (" (a value in a file keeps its type: write the number without quotes)"
                 if isinstance(value, str) and _is_number(value) else "")
    raise ValueError(f"config field {key!r}: expected {type_text(hint)}, got {_kind(value)} "
                     f"{value!r}{hint_text}")  # the same shape as every other config error


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _kind(value: Any) -> str:
    return {type(None): "null", bool: "a bool", int: "an int", float: "a float",
            str: "a string", list: "a list", dict: "a mapping"}.get(type(value),
                                                                   type(value).__name__)


def dump_config(config: PPOConfig, fmt: str = "yaml") -> str:
    """The text of `config` in `fmt` ("yaml" or "json"); `read_config` reads it back equal.

    Example:
        >>> print(dump_config(PPOConfig()).splitlines()[0])
        model:
    """
    data = config_to_dict(config)
    if fmt == "yaml":
        # Field order as in config.py (not sorted), block style: one field per line.
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    raise ValueError(f"unknown config format {fmt!r}; allowed: yaml, json")


def read_config(path: str | Path) -> PPOConfig:
    """The config in a .yaml/.yml/.json file; a ValueError names the file and what is wrong
    in one line (a parse error's line and column, or the field)."""
    path = Path(path)
    fmt = _format(path)
    text = path.read_text(encoding="utf-8")  # a missing file is an OSError naming it
    try:
        if fmt == "yaml":
            data = yaml.load(text, Loader=StrictLoader)  # a SafeLoader: plain values only
        else:
            data = json.loads(text)
            duplicate = _json_duplicate(text)
            if duplicate is not None:
                raise DuplicateKeyError(duplicate)
    except DuplicateKeyError as e:
        raise ValueError(f"{path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path}: not valid YAML{where}: {e.problem or e.context}") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid {fmt.upper()}: {e}") from None
    if data is None:
        raise ValueError(f"{path}: the file is empty; write one with `avrid ppo --print-config`")
    try:
        return config_from_dict(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def write_config(config: PPOConfig, path: str | Path) -> Path:
    """Write `config` to `path` (.yaml/.yml/.json) through a temporary file, so the file is
    either the old one or the whole new one; returns `path`."""
    path = Path(path)
    text = dump_config(config, _format(path))
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _format(path: Path) -> str:
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"{path}: a config file must end in {', '.join(FORMATS)}, got "
                         f"{path.suffix or 'no extension'!r}")
    return FORMATS[path.suffix.lower()]
