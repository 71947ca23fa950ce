"""What the `avrid` subcommands share: one-line errors, the `ppo` extra, Ray's shutdown.

A user's mistake (a bad value, a missing file, a worker that failed) is reported as one
line naming what was wrong, with exit status 2; a bug in avrid keeps its traceback. Nothing
here imports torch or Ray: `avrid --version` and `avrid chapters` must start fast on the
core install.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import NoReturn

from avrid.workers.errors import PlacementError, WorkerError

USER_ERRORS = (ValueError, TypeError, OSError, ImportError, PlacementError, WorkerError)
"""What `avrid ppo` reports in one line: bad config or input, files, placement, and a
worker's failure (its role, rank, method and message). Anything else is a bug in avrid and
keeps its traceback."""

PPO_NEEDS = {"torch": "torch", "ray": "ray", "transformers": "transformers",
             "safetensors": "safetensors", "tqdm": "tqdm", "matplotlib": "matplotlib",
             "yaml": "pyyaml"}
"""What `avrid ppo` and `avrid export` import (import name: the name pip installs)."""


def need_ppo_extra(command: str) -> None:
    """`pip install avrid` alone has no torch, Ray or models: name what to add, in one line."""
    missing = [dist for mod, dist in PPO_NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        print(f"{command} needs {', '.join(missing)}: pip install 'avrid[ppo]'", file=sys.stderr)
        sys.exit(2)


def fail(command: str, error: BaseException, *, debug: bool) -> NoReturn:
    """Report an error a user can act on in one line (exit status 2), or, with --debug (or
    AVRID_DEBUG=1), raise it again so the whole traceback shows."""
    if debug or os.environ.get("AVRID_DEBUG", "") not in ("", "0"):
        raise error
    # A worker's failure carries the remote traceback: its headline names role, rank, method
    # and the remote exception; the full text is one --debug away.
    text = getattr(error, "headline", None) or str(error).strip() or type(error).__name__
    first = text.splitlines()[0] if text else type(error).__name__
    hint = " (run with --debug for the traceback)" if not isinstance(error, ValueError) else ""
    print(f"{command}: {first}{hint}", file=sys.stderr)
    sys.exit(2)


def import_from_cwd() -> None:
    """Let the user's modules be imported from where the command runs: a custom task
    (`--task my_tasks:make_task`) or reward function is looked up there, by the driver and
    by every Ray worker process (hence PYTHONPATH too)."""
    sys.path.insert(0, os.getcwd())
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)


def ray_running() -> bool:
    """Whether this process is connected to Ray (imported only if something imported it)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def stop_ray() -> None:
    """Shut down the Ray this command started (Ray would do it at exit, where a second Ctrl-C
    interrupts it: a traceback, and its agents left running for minutes)."""
    if ray_running():
        sys.modules["ray"].shutdown()
