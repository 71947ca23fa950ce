"""Chapter 1: a call's arguments and its result cross Ray as one pickled byte string each way
(`workers/call_wire.py`): the same objects arrive, tensors bit for bit and writable, large
tensors out of band, Ray handles and unpicklable values the ordinary way."""

from __future__ import annotations

import pytest
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
from avrid.workers.call_wire import Unpacked, pack, pack_result, unpack, unpack_result
from avrid.workers.tensor_wire import INBAND_BYTES
from tests.test_tensor_wire import same_bits, samples


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
    blob, buffers = pack(((values,), {"big": torch.arange(INBAND_BYTES, dtype=torch.int32)}))
    assert len(buffers) == 1  # only the tensor over INBAND_BYTES went out of band
    (back,), kwargs = unpack(blob, buffers)
    for name, tensor in values.items():
        assert same_bits(tensor, back[name]), name
        assert back[name].requires_grad == tensor.requires_grad
    big = kwargs["big"]
    assert torch.equal(big, torch.arange(INBAND_BYTES, dtype=torch.int32))
    big[0] = 7  # its own writable memory, not the buffer it arrived in


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


class Echo(Worker):
    """Answers with what it was sent, to see both the wire path and the ordinary one."""

    def echo(self, value: object, *, scale: int = 1) -> object:
        """`value` (a tensor times `scale`) back, as the method received it."""
        return value * scale if isinstance(value, torch.Tensor) else value

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
    pending = echo_group.submit(Echo.echo, ref)
    assert not any(t.wired for t in pending.tickets)  # Ray resolves it before the method runs
    for got in pending.result():
        assert torch.equal(got, torch.arange(5))


def test_an_error_on_the_wire_path_is_reported_as_before(echo_group) -> None:  # noqa: ANN001
    with pytest.raises(WorkerError) as info:
        echo_group.call(Echo.fail, 42)
    assert info.value.reason == "raised" and info.value.method == "fail"
    assert "ValueError: bad value 42" in info.value.remote_traceback
    assert "bad value 42" in str(info.value)
