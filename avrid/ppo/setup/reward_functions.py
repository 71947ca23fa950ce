"""Chapter 5 — your reward function, without a class: ``task.reward=module:function``.

A task (`task.py`) brings prompts and a reward; this file lets a plain function replace that
reward, the way verl's ``compute_score`` and TRL's ``reward_funcs`` do. A spec names it:

    "my_rewards:exact"          a module on the import path (the directory you run `avrid`
                                from is on it, for the driver and every Ray worker)
    "path/to/rewards.py:exact"  a Python file, imported from its path (made absolute when the
                                config is made, so a worker in another directory finds it)

The function is called once per sample::

    def exact(prompt: str, response: str, answer: str, **metadata) -> float | dict:
        ...

with the prompt's text, the decoded response (cut at EOS), the task's answer and the prompt's
metadata (`Prompt.metadata`) as keyword arguments (only the keys it names, unless it takes
``**metadata``: ``exact(prompt, response, answer)`` works with any task). It returns a
number, or a dict holding ``"score"`` (the number) and extra values, each logged as the
metric ``reward/<name>``.

A *batched* function scores a whole shard in one call (a learned judge, a code sandbox that
runs many programs at once). It says so with a function attribute, next to its code, so the
config cannot disagree with it::

    def judge(prompts, responses, answers, **metadata):   # lists; metadata: key -> list
        return [...]                                       # one float or dict per sample
    judge.batched = True

Several functions combine by weight (``task.rewards``): a sample's score is
``sum(weight * function's score)``, logged as ``reward/score``; each function's own score is
logged as ``reward/<function name>`` and its extras under their own names (two sources for
one name, e.g. two functions called ``score`` or giving the same extra, is an error).

Every value goes through `task.check_reward`, so a NaN, a string or a dict without "score"
stops the step with one line naming the function, the sample, the prompt and the value. A
spec that cannot be loaded (no colon, no such module or file, no such function, not
callable) fails when the config is made, before anything starts.

Not here: where the function is called from (`roles/reward.py`), the task contract
(`task.py`), or the config fields (`config.py`'s `TaskConfig`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from avrid.ppo.setup.task import Prompt, check_reward

ALLOWED = ("'module:function' (a module on the import path) or 'path/to/file.py:function'")
"""What a reward spec may be; every spec error names it."""

CALL_ARGS = ("prompt", "response", "answer")
"""The positional arguments of a reward function; metadata may not reuse these names."""


def resolve_spec(spec: str) -> str:
    """`spec` with a ``file.py`` part made absolute (relative to the current directory): a
    Ray worker's working directory is not the driver's.

    Example:
        >>> resolve_spec("my_rewards:exact")
        'my_rewards:exact'
    """
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        return f"{Path(where).expanduser().resolve()}:{name}"
    return spec


def load_function(spec: str) -> Callable[..., Any]:
    """The callable `spec` names; ValueError in one line naming the spec and what is allowed
    when it has no colon, its module or file is missing, or it names no callable."""
    # rpartition: a path may hold a colon (C:\...), a function name never does.
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name.isidentifier():
        raise ValueError(f"reward function {spec!r} is not a spec; expected {ALLOWED}")
    if where.endswith(".py"):
        module = _module_from_file(spec, Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"reward function {spec!r}: cannot import module {where!r} ({e}); "
                             f"is it on the PYTHONPATH of the driver and the workers? expected "
                             f"{ALLOWED}") from None
    function = getattr(module, name, None)
    if function is None:
        raise ValueError(f"reward function {spec!r}: {where!r} has no {name!r}; expected "
                         f"{ALLOWED}")
    if not callable(function):
        raise ValueError(f"reward function {spec!r}: {name!r} is {_short(function)} "
                         f"({type(function).__name__}), not callable; expected {ALLOWED}")
    return function


def _module_from_file(spec: str, path: Path) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward function {spec!r}: no file {str(path)!r}; expected {ALLOWED}")
    # One module per file, under a name no import statement can clash with; registered in
    # sys.modules so that dataclasses and pickling inside the user's file work.
    name = f"avrid_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None  # a .py file always has
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"reward function {spec!r}: importing {str(path)!r} raised "
                         f"{type(e).__name__}: {e}") from None
    return module


def parse_weights(text: str) -> dict[str, float]:
    """The ``--set task.rewards=`` text ``spec=weight,spec=weight`` as a mapping; ValueError
    naming the text and the syntax when a part has no ``=``, a weight is not a finite
    number, or a spec repeats.

    Example:
        >>> parse_weights("m:f1=0.7,m:f2=0.3")
        {'m:f1': 0.7, 'm:f2': 0.3}
    """
    weights: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        spec, eq, raw = part.rpartition("=")
        try:
            weight = float(raw) if eq and spec else math.nan
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight) or spec.strip() in weights:
            what = "repeats a function" if spec.strip() in weights else "needs a finite weight"
            raise ValueError(f"task.rewards={text!r}: {part!r} {what}; expected "
                             f"'module:function=weight,module:function=weight'")
        weights[spec.strip()] = weight
    return weights


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardFunction:
    """One loaded reward function, its weight and whether it scores lists (`batched`)."""

    spec: str
    weight: float
    function: Callable[..., Any]
    keywords: frozenset[str] | None
    """The metadata keys it names as parameters; None: all (it takes ``**metadata``, or its
    signature cannot be read)."""

    @property
    def name(self) -> str:
        """The function's name in the spec; with several functions, each one's score is
        logged as reward/<name>."""
        return self.spec.rpartition(":")[2]

    @property
    def batched(self) -> bool:
        """True when the function carries ``batched = True``: called once with lists."""
        return getattr(self.function, "batched", False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """What a reward function sees of one sample, and its id for error messages."""

    sample_id: int
    prompt: Prompt
    response: str


def load_functions(weights: Mapping[str, float]) -> tuple[RewardFunction, ...]:
    """Every spec of `weights` (spec -> weight) loaded; a bad spec, or a `batched` attribute
    that is not a bool, is one ValueError."""
    functions = []
    for spec, weight in weights.items():
        function = load_function(spec)
        flag = getattr(function, "batched", False)
        if not isinstance(flag, bool):  # `batched = 1` must not silently mean "per sample"
            raise ValueError(f"reward function {spec!r}: its attribute batched is {flag!r}; "
                             f"set it to True (lists in, a list out) or leave it out")
        functions.append(RewardFunction(spec=spec, weight=float(weight), function=function,
                                        keywords=_keywords(function)))
    return tuple(functions)


def _keywords(function: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword parameters `function` names, or None when it takes any (``**metadata``):
    ``f(prompt, response, answer)`` is a fine reward function for a task whose prompts carry
    metadata it does not need."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function: pass what there is
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def score_samples(functions: Sequence[RewardFunction], samples: Sequence[Sample]
                  ) -> tuple[list[float], dict[str, list[float]]]:
    """Each sample's combined score ``sum(weight * score)`` and the values to log by name (one
    per sample): every function's extras and, when there are several functions, each one's
    own score under its function's name. ValueError naming the function, sample, prompt and
    value for a bad value, or a name two sources would both log."""
    scores = [0.0] * len(samples)
    logged: dict[str, list[float]] = {}
    owner: dict[str, str] = {}  # logged name -> the function that gave it
    for fn in functions:
        own: list[float] = []
        keys: list[str] | None = None  # the extras' names, as the first sample gave them
        for i, (sample, value) in enumerate(zip(samples, _call(fn, samples), strict=True)):
            score, extras = _read(fn, sample, value)
            scores[i] += fn.weight * score
            own.append(score)
            if keys is None:
                keys = sorted(extras)
                for name in keys:
                    _claim(name, fn, owner)
            elif sorted(extras) != keys:  # a metric is a mean over every sample
                raise ValueError(f"sample {sample.sample_id}: reward function {fn.spec!r} "
                                 f"returned the extras {sorted(extras)}, but {keys} for the "
                                 f"first sample; every sample must give the same keys")
            for name, v in extras.items():
                logged.setdefault(name, []).append(v)
        if len(functions) > 1:
            _claim(fn.name, fn, owner)
            logged[fn.name] = own
    return scores, logged


def _claim(name: str, fn: RewardFunction, owner: dict[str, str]) -> None:
    if name in owner or name == "score":
        first = f"reward function {owner[name]!r}" if name in owner else "the combined score"
        raise ValueError(f"reward function {fn.spec!r} and {first} would both be logged as "
                         f"reward/{name}; rename the extra (or the function)")
    owner[name] = fn.spec


def _call(fn: RewardFunction, samples: Sequence[Sample]) -> Sequence[Any]:
    """The function's raw value for every sample, called once per sample or (batched) once."""
    if not samples:
        return []
    if not fn.batched:
        return [_guarded(fn, s.sample_id, s.prompt.text, s.response, s.prompt.answer,
                         **_metadata(fn, s)) for s in samples]
    keys = sorted({k for s in samples for k in _metadata(fn, s)})
    metadata = {k: [s.prompt.metadata.get(k) for s in samples] for k in keys}
    values = _guarded(fn, samples[0].sample_id,
                      [s.prompt.text for s in samples], [s.response for s in samples],
                      [s.prompt.answer for s in samples], **metadata)
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Sequence) \
            or len(values) != len(samples):
        raise ValueError(f"batched reward function {fn.spec!r} returned "
                         f"{_short(values)} for {len(samples)} samples (sample ids "
                         f"{samples[0].sample_id}..{samples[-1].sample_id}); it must return "
                         f"a list with one float or dict per sample")
    return values


def _guarded(fn: RewardFunction, sample_id: int, *args: Any, **metadata: Any) -> Any:
    """``fn.function(*args, **metadata)``; the user's exception comes back naming the function
    and the sample (its traceback stays attached, for --debug)."""
    try:
        return fn.function(*args, **metadata)
    except Exception as e:
        what = "batch from sample" if fn.batched else "sample"
        message = " ".join(str(e).split())  # one line, whatever the user's error holds
        raise ValueError(f"reward function {fn.spec!r} raised {type(e).__name__}: {message} "
                         f"(on {what} {sample_id})") from e


def _metadata(fn: RewardFunction, sample: Sample) -> Mapping[str, Any]:
    """The sample's metadata that `fn` takes (all of it, with ``**metadata``)."""
    taken = {k: v for k, v in sample.prompt.metadata.items()
             if fn.keywords is None or k in fn.keywords}
    clash = [k for k in taken if k in CALL_ARGS]
    if clash:
        raise ValueError(f"sample {sample.sample_id}: prompt {sample.prompt.index}'s metadata "
                         f"key {clash[0]!r} would shadow reward function {fn.spec!r}'s "
                         f"argument; metadata may not use {', '.join(CALL_ARGS)}")
    return taken


def _read(fn: RewardFunction, sample: Sample, value: Any) -> tuple[float, dict[str, float]]:
    """(score, extras) of one returned value, each checked by `check_reward`."""
    source = f"reward function {fn.spec!r}"
    try:
        if not isinstance(value, Mapping):
            return check_reward(value, source=source, prompt=sample.prompt), {}
        if "score" not in value:
            raise ValueError(f"{source} returned {_short(value)} for prompt "
                             f"{sample.prompt.index} ({sample.prompt.text!r}): a dict must "
                             f"hold 'score' (a number); its other keys are extra values, "
                             f"logged as reward/<key>")
        extras = {}
        for key, v in value.items():
            if key != "score":
                if not isinstance(key, str) or not key:
                    raise ValueError(f"{source} returned the extra key {key!r}: keys are "
                                     f"non-empty strings (the metric is reward/<key>)")
                extras[key] = check_reward(v, source=f"{source} (extra {key!r})",
                                           prompt=sample.prompt)
        return check_reward(value["score"], source=source, prompt=sample.prompt), extras
    except ValueError as e:
        raise ValueError(f"sample {sample.sample_id}: {e}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
