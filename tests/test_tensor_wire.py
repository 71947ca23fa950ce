"""Chapter 1: torch tensors cross Ray processes in avrid's calls as numpy buffers
(`workers/tensor_wire.py`), bit for bit and writable on arrival; a view sends only its own
elements, both ways, which shows the wire was used (torch's own pickling sends the whole
storage); nothing is registered with Ray (`test_wire_guest.py` checks the user's side). Why
it is faster than torch's pickling is `tensor_wire.py`'s docstring; no test times it."""

from __future__ import annotations

import pickle

import pytest
import torch

from avrid.workers import Worker
from avrid.workers.tensor_wire import INBAND_BYTES, _from_wire, _to_wire

pytestmark = pytest.mark.chapter(1)


def samples() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "float32": torch.randn(3, 4, generator=gen),
        "bfloat16": torch.randn(5, generator=gen).bfloat16(),  # no numpy dtype
        "float8": torch.randn(4, generator=gen).to(torch.float8_e4m3fn),
        "a strided view": torch.arange(100)[10:20:2],
        "transposed": torch.randn(3, 5, generator=gen).t(),
        "bool": torch.tensor([True, False, True]),
        "int8": torch.arange(-3, 3, dtype=torch.int8),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "requires grad": torch.ones(2, requires_grad=True),
        "negative zero and nan": torch.tensor([-0.0, float("nan"), float("inf")]),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().contiguous().view(width), b.detach().contiguous().view(width))


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("name", list(samples()))
def test_round_trip_is_bit_identical_and_writable(name: str, size: str) -> None:
    tensor = samples()[name]
    if size == "large":  # past INBAND_BYTES: the numpy buffer, out of band
        reps = INBAND_BYTES // max(tensor.nbytes, 1) + 1
        tensor = tensor.detach().repeat(reps, *([1] * (tensor.dim() - 1))) if tensor.dim() \
            else tensor.detach().repeat(INBAND_BYTES)
        tensor.requires_grad_(samples()[name].requires_grad)
    wire = pickle.loads(pickle.dumps(_to_wire(tensor), protocol=5))
    back = _from_wire(wire)
    assert wire[0] == ("bytes" if tensor.nbytes <= INBAND_BYTES else "np")
    assert same_bits(tensor, back)
    assert back.requires_grad == tensor.requires_grad
    if back.numel():
        back.detach().view(-1)[0] = 0  # writable memory of its own (raises on a read-only buffer)


def test_a_view_sends_only_its_own_elements() -> None:
    base = torch.zeros(1_000_000)
    assert len(_to_wire(base[:10])[1]) == 10 * 4  # torch's would send the whole 4 MB storage
    assert _to_wire(base[:100_000])[1].nbytes == 100_000 * 4


def test_what_numpy_cannot_carry_keeps_torch_s_own_reduction() -> None:
    meta = torch.empty(2, 3, device="meta")
    wire = _to_wire(meta)
    assert wire[0] == "torch"
    back = _from_wire(wire)
    assert back.device.type == "meta" and back.shape == (2, 3)


def test_tensors_cross_ray_actors_bit_identical(ray_cluster: None) -> None:
    """Driver -> actor -> driver inside avrid's calls: every sample comes back bit for bit;
    an `nn.Parameter` keeps its type; and neither side registered a serializer with Ray (the
    wire is `call_wire`'s own pickler's, so the user's Ray code is left alone)."""
    import ray

    from avrid.workers import Mesh, RayBackend, ResourcePool, RoleSpec, plan_placement
    from tests.helpers import TensorEchoWorker

    sent = {**samples(), "parameter": torch.nn.Parameter(torch.ones(2))}
    placement = plan_placement([ResourcePool.uniform("cpu", 1, cpus=0.5)],
                               [RoleSpec(role="echo", worker=TensorEchoWorker,
                                         mesh=Mesh.of(dp=1), pool="cpu", cpus=0.5)])
    with RayBackend().launch(placement) as cluster:
        [(back, registered)] = cluster.group("echo", TensorEchoWorker).call(
            TensorEchoWorker.echo, sent)
        assert torch.Tensor not in ray.cloudpickle.CloudPickler.dispatch  # the driver's
    assert not registered  # the worker's
    for name, tensor in sent.items():
        assert same_bits(tensor, back[name]), name
    assert isinstance(back["parameter"], torch.nn.Parameter)


class ViewProbe(Worker):
    """Says how much storage a tensor it was sent arrived with, and answers with a view of a
    large tensor of its own (what arrives on the driver shows the way back)."""

    def probe(self, sent: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The storage bytes `sent` arrived with, and 10 elements of a 4 MB tensor."""
        return sent.untyped_storage().nbytes(), torch.arange(1_000_000.0)[5:15]


def test_a_view_crosses_ray_as_its_own_elements_both_ways(ray_cluster: None) -> None:
    """The wire, not torch's pickling, carried the call: torch's reduction would send the
    whole 4 MB storage under a 10-element view, and the view would arrive in it."""
    from avrid.workers import Mesh, RayBackend, ResourcePool, RoleSpec, plan_placement

    placement = plan_placement([ResourcePool.uniform("cpu", 1, cpus=0.5)],
                               [RoleSpec(role="probe", worker=ViewProbe,
                                         mesh=Mesh.of(dp=1), pool="cpu", cpus=0.5)])
    with RayBackend().launch(placement) as cluster:
        [(arrived, back)] = cluster.group("probe", ViewProbe).call(
            ViewProbe.probe, torch.arange(1_000_000.0)[10:20])
    assert arrived == 10 * 4  # driver -> worker
    assert torch.equal(back, torch.arange(5.0, 15.0))
    assert back.untyped_storage().nbytes() == 10 * 4  # worker -> driver
