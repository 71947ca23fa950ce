"""Chapter 1: avrid's call wire is a guest in the user's Ray (`workers/call_wire.py`,
`workers/tensor_wire.py`).

- Classes and functions a script defines in ``__main__``, and those of a module registered
  with ``ray.cloudpickle.register_pickle_by_value``, pass through ``group.call`` as arguments
  and as results, as they do through plain Ray; what a worker cannot unpickle is reported as
  such, naming it, not as an error of a method that never ran.
- Nothing of avrid stays in Ray's serialization: after a run (closed, and after
  ``ray.shutdown()``) a tensor pickles byte for byte as before it, the user's own tasks keep
  a tensor's strides, memory format and attributes, and a serializer the user (or Ray's
  ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``) registered is left in place.

The first two run as scripts in a fresh interpreter (a real ``__main__``, and a process whose
"before" no earlier test touched), joined to the test session's Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from avrid.workers import Mesh, RayBackend, ResourcePool, RoleSpec, plan_placement
from tests.helpers import TensorEchoWorker, child_env

pytestmark = pytest.mark.chapter(1)

ROOT = Path(__file__).resolve().parents[1]

MAIN_SCRIPT = '''
import json, sys
from dataclasses import dataclass

sys.path.insert(0, sys.argv[2])  # this driver can import these; the workers cannot
import byval_mod, unsent_mod
import ray

ray.cloudpickle.register_pickle_by_value(byval_mod)  # so Ray sends its code by value

from avrid.workers import (Mesh, RayBackend, ResourcePool, RoleSpec, Worker, WorkerError,
                           plan_placement, start_ray)


@dataclass(frozen=True)
class Msg:
    text: str


def double(v):
    return 2 * v


class Echo(Worker):
    def echo(self, value):
        return value

    def apply(self, fn, value):
        return fn(value)

    def make(self):
        return Msg("made"), double, byval_mod.Point(x=1, y=2), byval_mod.triple


def check(name, fn):
    try:
        print(json.dumps({name: fn()}), flush=True)
    except WorkerError as exc:
        print(json.dumps({name: exc.headline}), flush=True)


start_ray(address=sys.argv[1])
plan = plan_placement([ResourcePool.uniform("p", 1, cpus=0.5)],
                      [RoleSpec(role="echo", worker=Echo, mesh=Mesh.of(dp=1), pool="p",
                                cpus=0.5)])
try:
    with RayBackend().launch(plan) as cluster:
        g = cluster.group("echo", Echo)
        check("main dataclass", lambda: g.call(Echo.echo, Msg("hi")) == [Msg("hi")])
        check("main function in", lambda: g.call(Echo.apply, double, 21) == [42])
        check("main function out", lambda: g.call(Echo.echo, double)[0](4) == 8)
        check("by-value class", lambda: g.call(Echo.echo, byval_mod.Point(x=3, y=4))
              == [byval_mod.Point(x=3, y=4)])
        check("by-value function", lambda: g.call(Echo.apply, byval_mod.triple, 5) == [15])

        def made():
            [(msg, fn, point, fn3)] = g.call(Echo.make)
            return msg == Msg("made") and fn(1) == 2 and point == byval_mod.Point(x=1, y=2) \\
                and fn3(2) == 6
        check("made in the worker", made)
        check("not importable there", lambda: g.call(Echo.echo, unsent_mod.Thing()))
finally:
    ray.shutdown()
'''

BYVAL_MOD = '''
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    x: int
    y: int


def triple(v):
    return 3 * v
'''

UNSENT_MOD = '''
class Thing:
    pass
'''

TENSOR_SCRIPT = '''
import json, sys

import ray
import torch

from avrid.workers import Mesh, RayBackend, ResourcePool, RoleSpec, plan_placement, start_ray
from tests.helpers import TensorEchoWorker


PROBE = torch.ones(2)  # one tensor throughout: torch's pickle names its storage's address


def pickled():
    return ray.cloudpickle.dumps(PROBE)


@ray.remote
def describe(t):
    return {"stride": list(t.stride()), "conj": bool(t.is_conj()),
            "channels_last": t.dim() == 4 and t.is_contiguous(
                memory_format=torch.channels_last),
            "note": getattr(t, "note", None)}


def user_task_sees():
    """What a plain Ray task of the user's receives."""
    noted = torch.ones(2)
    noted.note = "kept"
    sent = {"transposed": torch.arange(6.0).reshape(2, 3).t(),
            "channels_last": torch.zeros(1, 3, 2, 2).to(memory_format=torch.channels_last),
            "attribute": noted, "conjugate": torch.tensor([1 + 2j]).conj()}
    return {name: ray.get(describe.remote(t)) for name, t in sent.items()}


before = pickled()
start_ray(address=sys.argv[1])
plain = user_task_sees()
plan = plan_placement([ResourcePool.uniform("p", 1, cpus=0.5)],
                      [RoleSpec(role="echo", worker=TensorEchoWorker, mesh=Mesh.of(dp=1),
                                pool="p", cpus=0.5)])
big = torch.arange(100_000, dtype=torch.float32).reshape(1000, 100).t()
with RayBackend().launch(plan) as cluster:
    [(back, worker_registered)] = cluster.group("echo").call(TensorEchoWorker.echo, big)
    running = pickled()
closed = pickled()
after = user_task_sees()
ray.shutdown()
print(json.dumps({
    "echoed": bool(torch.equal(back, big)), "worker registered": worker_registered,
    "same while running": running == before, "same after close": closed == before,
    "same after shutdown": pickled() == before, "avrid after shutdown": b"avrid" in pickled(),
    "plain": plain, "after": after}))
'''


def run_script(tmp_path: Path, script: str, *args: str) -> str:
    """Run `script` as a fresh driver joined to the session's Ray; its stdout."""
    import ray

    path = tmp_path / "script.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path), ray.get_runtime_context().gcs_address,
                           *args], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_main_and_by_value_code_pass_through_group_call(ray_cluster: None,
                                                        tmp_path: Path) -> None:
    lib = tmp_path / "lib"  # not the script's folder nor the cwd: Ray puts those on
    lib.mkdir()             # the workers' path
    (lib / "byval_mod.py").write_text(BYVAL_MOD)
    (lib / "unsent_mod.py").write_text(UNSENT_MOD)
    out = run_script(tmp_path, MAIN_SCRIPT, str(lib))
    got = {k: v for line in out.splitlines() if line.startswith("{")
           for k, v in json.loads(line).items()}
    for name in ("main dataclass", "main function in", "main function out", "by-value class",
                 "by-value function", "made in the worker"):
        assert got.get(name) is True, (name, got.get(name), out)
    # A class the driver sends by name but the worker cannot import: said so, and named.
    headline = got["not importable there"]
    assert headline.startswith("echo[0].echo() failed:"), headline
    assert "Echo.echo did not run" in headline and "`unsent_mod.Thing`" in headline, headline


def test_nothing_of_avrid_stays_in_ray_serialization(ray_cluster: None,
                                                     tmp_path: Path) -> None:
    out = json.loads(run_script(tmp_path, TENSOR_SCRIPT).strip().splitlines()[-1])
    assert out["echoed"]  # avrid's own call still carried the tensor
    assert not out["worker registered"]
    assert out["same while running"] and out["same after close"]
    assert out["same after shutdown"] and not out["avrid after shutdown"]
    # The user's own tasks, in the process that ran avrid, get what plain Ray gives them.
    assert out["after"] == out["plain"]
    assert out["after"]["transposed"]["stride"] == [1, 3]
    assert out["after"]["channels_last"]["channels_last"]
    assert out["after"]["attribute"]["note"] == "kept"


def _users_serializer() -> Callable[[], None]:
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=lambda t: t.tolist(),
                                 deserializer=torch.tensor)
    return lambda: ray.util.deregister_serializer(torch.Tensor)


def _rays_zero_copy() -> Callable[[], None]:
    # Exactly what Ray does at start-up when RAY_ENABLE_ZERO_COPY_TORCH_TENSORS is set.
    import ray
    from ray._private import tensor_serialization_utils as ts

    context = ray._private.worker.global_worker.get_serialization_context()
    context._register_cloudpickle_reducer(torch.Tensor, ts.zero_copy_tensors_reducer)
    return lambda: context._unregister_cloudpickle_reducer(torch.Tensor)


@pytest.fixture(params=["user's serializer", "Ray's zero-copy reducer"])
def tensor_reducer(request: pytest.FixtureRequest, ray_cluster: None) -> Iterator[object]:
    """A reducer for torch.Tensor registered with Ray before avrid runs (removed after)."""
    import ray

    register = {"user's serializer": _users_serializer,
                "Ray's zero-copy reducer": _rays_zero_copy}[request.param]
    undo = register()
    try:
        yield ray.cloudpickle.CloudPickler.dispatch[torch.Tensor]
    finally:
        undo()


def test_a_tensor_serializer_registered_with_ray_is_left_in_place(tensor_reducer: object) -> None:
    """avrid does not replace it, before, during or after a run; avrid's own calls still
    carry tensors by its wire (bit for bit, and writable: the zero-copy one is neither)."""
    import ray

    plan = plan_placement([ResourcePool.uniform("p", 1, cpus=0.5)],
                          [RoleSpec(role="echo", worker=TensorEchoWorker, mesh=Mesh.of(dp=1),
                                    pool="p", cpus=0.5)])
    sent = torch.randn(3, 4).bfloat16()  # the user's serializer would return float32
    with RayBackend().launch(plan) as cluster:
        assert ray.cloudpickle.CloudPickler.dispatch[torch.Tensor] is tensor_reducer
        [(back, _)] = cluster.group("echo").call(TensorEchoWorker.echo, sent)
        assert ray.cloudpickle.CloudPickler.dispatch[torch.Tensor] is tensor_reducer
    assert ray.cloudpickle.CloudPickler.dispatch[torch.Tensor] is tensor_reducer
    assert back.dtype == torch.bfloat16 and torch.equal(back, sent)
    back[0, 0] = 1.0  # its own writable memory
