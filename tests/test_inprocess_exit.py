"""The in-process backend lets the driver exit cleanly: closing a group waits until each rank's
OS thread has ended, its native thread-locals included, so the interpreter never exits while a
rank thread still runs C++ that needs the GIL (issue 25, item 8: "terminate called without an
active exception", exit -6 instead of 2).

Why a thread-local: `Thread.join` returns once a thread's Python part is done; torch destroys
the thread's native thread-locals after that, and one that holds a Python object takes the
GIL to drop it. If the interpreter is exiting by then, Python stops the thread inside that C++
destructor and the process aborts. `StashWorker` puts a Python object there on purpose (torch's
private `_stash_obj_in_tls`, what its own backward uses) whose finalizer takes half a second,
so that the exit wins the race every time on code that only joins the Python thread.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from avrid.workers import Worker
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(1)

ROOT = Path(__file__).resolve().parents[1]


class SlowToDrop:
    """Takes half a second to be dropped: the rank thread's native teardown lasts that long."""

    def __del__(self) -> None:
        time.sleep(0.5)


class StashWorker(Worker):
    """Leaves a Python object in torch's native thread-local storage of its rank thread."""

    def stash(self) -> None:
        torch._C._stash_obj_in_tls("avrid-test", SlowToDrop())


SCRIPT = """
import sys
from avrid.workers import InProcessBackend, Mesh, ResourcePool, RoleSpec, plan_placement
from tests.test_inprocess_exit import StashWorker

plan = plan_placement([ResourcePool.uniform("p", 2, cpus=1)],
                      [RoleSpec(role="w", worker=StashWorker, mesh=Mesh.of(dp=2), pool="p")])
with InProcessBackend(concurrent=True).launch(plan) as cluster:
    cluster.group("w", StashWorker).call(StashWorker.stash)
sys.exit(2)  # what `avrid ppo` does after an error: exit at once, status 2
"""


def test_the_driver_exits_with_its_status_after_rank_threads_used_torch() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "terminate called" not in done.stderr, done.stderr
