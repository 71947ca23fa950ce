"""Chapter 1: a call's arguments and its result cross Ray as one pickled byte string each way
(`workers/call_wire.py`): the same objects arrive, tensors bit for bit and writable, large
tensors out of band; Ray handles, values only cloudpickle carries and code from `__main__` or
a by-value module the ordinary way (with the reply still packed); what cannot be unpickled
is named. `test_wire_guest.py` runs the `__main__` case as a real script."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import ray
import torch

from avrid.dispatch import Batch, make_plan
from avrid.results import ResultBuilder
from avrid.workers import (
    Mesh,
    RayBackend,
    ResourcePool,
    RoleSpec,
    Worker,
    WorkerError,
    WorkerIdentity,
    plan_placement,
)
from avrid.workers.call_wire import (
    Stored,
    Unpacked,
    WireError,
    pack,
    pack_result,
    unpack,
    unpack_result,
)
from avrid.workers.tensor_wire import INBAND_BYTES
from tests.test_tensor_wire import same_bits, samples

pytestmark = pytest.mark.chapter(1)


def a_batch(n: int = 6) -> Batch:
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 5, (n,), generator=gen)
    response = torch.randint(0, 5, (n,), generator=gen)
    return Batch.from_rows(
        sample_ids=list(range(10, 10 + n)), prompt_lens=prompt.tolist(),
        response_lens=response.tolist(),
        packed={"tokens": [torch.randint(0, 50, (int(k),), generator=gen)
                           for k in prompt + response]},
        scalars={"score": torch.randn(n, generator=gen).bfloat16()})


def test_tensors_round_trip_bit_identical_and_writable() -> None:
    values = samples()
    sent = torch.arange(INBAND_BYTES, dtype=torch.int32)
    blob, buffers = pack(((values,), {"big": sent}))
    assert len(buffers) == 1  # only the tensor over INBAND_BYTES went out of band
    arrived = bytes(buffers[0])  # the out-of-band buffer as it arrived
    (back,), kwargs = unpack(blob, buffers)
    for name, tensor in values.items():
        assert same_bits(tensor, back[name]), name
        assert back[name].requires_grad == tensor.requires_grad
    big = kwargs["big"]
    assert torch.equal(big, torch.arange(INBAND_BYTES, dtype=torch.int32))
    big[0] = 7  # its own writable memory, not the buffer it arrived in:
    # the buffer (here a view of the sender's tensor; in Ray, the object store's shared
    # memory) and the sender's tensor are unchanged.
    assert bytes(buffers[0]) == arrived and sent[0] == 0


def test_a_shard_and_a_result_arrive_as_the_same_objects() -> None:
    batch = a_batch()
    shard = make_plan(batch, 2).split(batch)[1]
    blob, buffers = pack(shard)
    back = unpack(blob, buffers)
    assert back.micro_bounds == shard.micro_bounds
    assert torch.equal(back.batch.sample_ids, shard.batch.sample_ids)
    assert torch.equal(back.batch.packed["tokens"].values, shard.batch.packed["tokens"].values)
    assert same_bits(back.batch.scalars["score"], shard.batch.scalars["score"])
    with pytest.raises(TypeError):  # still a read-only mapping on arrival
        back.batch.packed["x"] = None  # type: ignore[index]

    builder = ResultBuilder.for_shard(WorkerIdentity(role="actor", rank=1, world_size=2), back)
    with builder.span("forward"):
        builder.add(back.batch.sample_ids, scalars={"value": back.batch.scalars["score"]})
    builder.metric("loss", torch.tensor([0.5, 1.5]), "mean_samples")
    result = builder.build()
    again = unpack_result(pack_result(result))
    assert again.identity == result.identity and again.spans == result.spans
    assert again.metrics == result.metrics
    assert same_bits(again.outputs.scalars["value"], result.outputs.scalars["value"])


def test_what_plain_pickling_cannot_carry_goes_the_ordinary_way() -> None:
    assert pack(((lambda x: x,), {})) is None  # Ray's cloudpickle carries lambdas
    reply = pack_result(lambda x: x)
    assert isinstance(reply, Unpacked)
    assert unpack_result(reply)(3) == 3
    assert pack_result(None) == pack(None)[0]  # no buffers: the bytes alone (Ray's fast path)


class Note:
    """A class to be seen from elsewhere (`__main__`, a by-value module)."""


@pytest.fixture
def main_note(monkeypatch: pytest.MonkeyPatch) -> type:
    """`Note`'s twin defined, as far as pickle can tell, in the running script."""
    twin = type("MainNote", (), {"__module__": "__main__"})
    monkeypatch.setattr(sys.modules["__main__"], "MainNote", twin, raising=False)
    return twin


@pytest.fixture
def a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """A module of the test's own, importable here (and only here); unloaded after."""
    (tmp_path / "wire_probe_mod.py").write_text("class Thing:\n    pass\n\n\n"
                                                "def twice(v):\n    return 2 * v\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import wire_probe_mod

    yield wire_probe_mod
    sys.modules.pop("wire_probe_mod", None)


def test_code_from_main_or_a_by_value_module_goes_the_ordinary_way(
        main_note: type, a_module: ModuleType) -> None:
    """The C pickler would name them (a worker's `__main__` is Ray's; a by-value module is
    not importable there): they go to cloudpickle, which sends them by value."""
    assert pack(main_note()) is None and pack([main_note]) is None
    assert isinstance(pack_result(main_note()), Unpacked)
    assert pack(a_module.Thing()) is not None  # importable everywhere, as far as we know
    ray.cloudpickle.register_pickle_by_value(a_module)
    try:
        assert pack(a_module.Thing()) is None and pack((a_module.twice,)) is None
        assert isinstance(pack_result(a_module.twice), Unpacked)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(a_module)
    assert pack(Note()) is not None  # the rest still goes the fast way


def test_a_submodule_of_a_by_value_package_goes_the_ordinary_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cloudpickle sends a registered package's submodules by value too (a worker cannot
    import any of them); a package whose name merely starts the same is not registered."""
    for name in ("wire_probe_pkg", "wire_probe_pkg_twin"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "sub.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import wire_probe_pkg
    import wire_probe_pkg.sub
    import wire_probe_pkg_twin.sub

    ray.cloudpickle.register_pickle_by_value(wire_probe_pkg)
    try:
        assert pack(wire_probe_pkg.sub.Thing()) is None
        assert pack((wire_probe_pkg.sub.Thing,)) is None
        assert pack(wire_probe_pkg_twin.sub.Thing()) is not None
    finally:
        ray.cloudpickle.unregister_pickle_by_value(wire_probe_pkg)
        for name in ("wire_probe_pkg", "wire_probe_pkg.sub", "wire_probe_pkg_twin",
                     "wire_probe_pkg_twin.sub"):
            sys.modules.pop(name, None)


def test_what_cannot_be_unpickled_is_named(a_module: ModuleType) -> None:
    blob, buffers = pack({"thing": a_module.Thing()})
    sys.modules.pop("wire_probe_mod")  # now this process cannot import it ...
    sys.path.remove(str(Path(a_module.__file__).parent))  # ... like a worker
    with pytest.raises(WireError, match=r"^Echo\.echo did not run: .*`wire_probe_mod\.Thing` "
                       r"cannot be found here \(ModuleNotFoundError"):
        unpack(blob, buffers, failure="Echo.echo did not run")
    with pytest.raises(WireError, match="the result could not be unpickled on the driver"):
        unpack_result(blob)


class Echo(Worker):
    """Answers with what it was sent, to see both the wire path and the ordinary one."""

    def echo(self, value: object, *, scale: int = 1) -> object:
        """`value` (a tensor times `scale`) back, as the method received it."""
        return value * scale if isinstance(value, torch.Tensor) else value

    def made(self) -> torch.Tensor:
        """A tensor, for a call without arguments."""
        return torch.arange(INBAND_BYTES, dtype=torch.int16)

    def fail(self, value: object) -> None:
        """Raise, to see the error cross the wire path unchanged."""
        raise ValueError(f"bad value {value!r}")


@pytest.fixture
def echo_group(ray_cluster):  # noqa: ANN001, ANN201, ARG001 - Ray, with the leak check
    plan = plan_placement([ResourcePool.uniform("echo", 2)],
                          [RoleSpec(role="echo", worker=Echo, mesh=Mesh.of(dp=2), pool="echo")])
    with RayBackend().launch(plan) as cluster:
        yield cluster.group("echo", Echo)


def test_ray_calls_take_the_wire_and_answer_the_same(echo_group) -> None:  # noqa: ANN001
    big = torch.randn(INBAND_BYTES // 2)  # 128 KiB of float32: out of band
    pending = echo_group.submit(Echo.echo, big, scale=2)
    assert all(t.wired for t in pending.tickets)
    for got in pending.result():
        assert torch.equal(got, big * 2)
    shard = make_plan(a_batch(), 2).split(a_batch())[0]
    for got in echo_group.call(Echo.echo, shard):
        assert torch.equal(got.batch.sample_ids, shard.batch.sample_ids)


def test_a_ray_handle_goes_the_ordinary_way_and_is_resolved(echo_group) -> None:  # noqa: ANN001
    ref = echo_group.put(torch.arange(5))
    assert isinstance(ray.get(ref), Stored)  # packed before it was stored
    pending = echo_group.submit(Echo.echo, ref)
    assert all(t.wired for t in pending.tickets)  # the reply comes back packed all the same
    for got in pending.result():
        assert torch.equal(got, torch.arange(5))
    shard = make_plan(a_batch(), 2).split(a_batch())[1]
    for got in echo_group.call(Echo.echo, echo_group.put(shard)):
        assert torch.equal(got.batch.sample_ids, shard.batch.sample_ids)
        assert same_bits(got.batch.scalars["score"], shard.batch.scalars["score"])


def test_a_call_without_arguments_answers_packed(echo_group) -> None:  # noqa: ANN001
    pending = echo_group.submit(Echo.made)
    assert all(t.wired for t in pending.tickets)
    for got in pending.result():
        assert torch.equal(got, torch.arange(INBAND_BYTES, dtype=torch.int16))


def test_an_argument_nothing_can_pickle_is_refused_before_the_call(
        echo_group) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match=r"echo\.echo\(\) was not called: .*lock"):
        echo_group.call(Echo.echo, threading.Lock())


def test_an_error_on_the_wire_path_is_reported_as_before(echo_group) -> None:  # noqa: ANN001
    with pytest.raises(WorkerError) as info:
        echo_group.call(Echo.fail, 42)
    assert info.value.reason == "raised" and info.value.method == "fail"
    assert "ValueError: bad value 42" in info.value.remote_traceback
    assert "bad value 42" in str(info.value)
