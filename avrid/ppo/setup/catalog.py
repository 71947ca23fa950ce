"""Chapter 5 — finding a task by name: the built-ins and your own ``package.module:factory``.

`load_task("digits", length=3)` builds a built-in; `load_task("my_tasks:make_task")` imports
your module and calls the factory. Either way the result is checked against the `Task`
protocol (`task.py`) and must have non-empty prompt lists, so a broken task fails at start.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from avrid.ppo.setup.digits import DigitTask
from avrid.ppo.setup.file_task import FileTask
from avrid.ppo.setup.gsm8k import Gsm8kTask
from avrid.ppo.setup.task import TASK_MEMBERS, Prompt, Task

BUILTIN_TASKS: dict[str, Callable[..., Any]] = {"digits": DigitTask, "file": FileTask,
                                               "gsm8k": Gsm8kTask}
"""The tasks known by name: the digit task, your data file (`file_task.py`) and GSM8K (a
configuration of the file task)."""
_ALLOWED = (f"a built-in task {', '.join(repr(b) for b in BUILTIN_TASKS)} or "
            "'package.module:factory' (a callable returning a Task)")


def task_constructor(spec: str) -> Callable[..., Any]:
    """What `load_task(spec, **kwargs)` calls with the keyword arguments: a built-in task's
    class or your factory, imported. ValueError naming the spec when it names neither.

    Example:
        >>> task_constructor("digits").__name__
        'DigitTask'
    """
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]
    module_name, colon, attr = spec.partition(":")
    if not colon:
        raise ValueError(f"unknown task {spec!r}; expected {_ALLOWED}")
    if not module_name or not attr:
        raise ValueError(f"task spec {spec!r} is not valid; expected {_ALLOWED}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"task spec {spec!r}: cannot import module {module_name!r} ({e}); "
                         "is it on the PYTHONPATH of the driver and the workers?") from e
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"task spec {spec!r}: module {module_name!r} has no callable "
                         f"{attr!r}; expected {_ALLOWED}")
    return factory


def load_task(spec: str, **kwargs: Any) -> Task:
    """A task by name: "digits", "file" or "gsm8k" (both need path=...) or
    "package.module:factory".

    Keyword arguments go to the task's constructor or the factory.

    Example:
        >>> load_task("digits", op="sort", length=2, num_val=10).val_prompts()[0].text
        '15='
    """
    make = task_constructor(spec)
    if spec in ("file", "gsm8k") and "path" not in kwargs:
        raise ValueError(f"task {spec!r} needs path=<a local .jsonl, .parquet or datasets "
                         f"directory>")
    try:
        task = make(**kwargs)
    except TypeError as e:  # wrong keyword arguments: say which task they were meant for
        raise TypeError(f"task {spec!r} with arguments {kwargs}: {e}") from e
    if not isinstance(task, Task):
        missing = [m for m in TASK_MEMBERS if not hasattr(task, m)]
        raise TypeError(f"task spec {spec!r} returned {type(task).__name__}, which is not a "
                        f"Task: missing {missing}")
    for split in ("train_prompts", "val_prompts"):
        prompts = getattr(task, split)()
        if len(prompts) == 0:
            raise ValueError(f"task {spec!r} ({task.name}): {split}() is empty")
        if not isinstance(prompts[0], Prompt):
            raise TypeError(f"task {spec!r} ({task.name}): {split}() must hold Prompt objects, "
                            f"got {type(prompts[0]).__name__}")
    return task
