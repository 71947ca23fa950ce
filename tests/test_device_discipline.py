"""Chapter 5 — device discipline: every role's compute path with the model on another device.

A shard arrives on the CPU (that is what travels between processes) while a worker's model
may sit on a GPU. No GPU runs this suite, so the model goes to the fake device of
`tests/fake_device.py`, which computes on the CPU but refuses, as CUDA would, any op that
mixes its tensors with CPU ones. The test runs the real workers — reference and actor
log-probs (the reference also as a pool's `ReferenceWorker`), the critic's values, the
actor and critic updates, the weight sync with its checksums — once on the CPU and once
with the model on the fake device, and asserts:

- no op mixed devices (it would have raised `DeviceMixError`);
- every result equals the all-CPU run's, and so do the trained weights and the weights the
  rollout engine holds after the sync: bit for bit with eager attention, within 1e-5 with
  SDPA (the trainer's default on CPU), whose kernel PyTorch picks by device (`ATTENTION`);
- every result leaving a worker holds plain CPU tensors only.

Not here: FSDP2 over several ranks (a GPU test's job), the rollout engine's generation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from avrid.dispatch import Batch, Packed, Shard
from avrid.ppo.data.columns import Totals
from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.roles.reference import ReferenceWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import WorkerIdentity
from tests.fake_device import FAKE, DeviceMixError, FakeDevice, is_plain_cpu, not_plain_cpu
from tests.helpers import ragged_batch

pytestmark = pytest.mark.chapter(5)

VOCAB, PAD, EOS, NORM_LEN = 16, 0, 1, 5
PROMPT_LENS, RESPONSE_LENS = [2, 3, 1, 2], [3, 1, 4, 2]


def config(attention: str) -> PPOConfig:
    """Tiny fp32 models on one in-process rank, with every optional loss term on: the KL in
    the loss (so a reference), an entropy bonus, the off-policy correction (chapter 6)."""
    return with_overrides(PPOConfig(), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "model.hidden_size=32", "model.num_heads=2",
        "algo.kl_coef=0.1", "algo.kl_in=loss", "algo.entropy_coef=0.01",
        "pipeline.correction=tis", "pipeline.is_cap=2.0", f"memory.attention={attention}"])


ATTENTION = {"eager": 0.0, "sdpa": 1e-5}
"""The attention kernels run, and how far (relative) the fake device's numbers may be from
the CPU's. eager is the same explicit ops on both: bit for bit. SDPA is one op whose kernel
PyTorch picks by device: the CPU's fused one on the CPU, the math fallback on the fake device
(as CUDA picks its own): the same function, another summation order."""


def make_batch() -> Batch:
    """Four ragged samples with the columns the updates read but the workers do not make."""
    return ragged_batch(PROMPT_LENS, RESPONSE_LENS, vocab=VOCAB, sample_ids=[10, 11, 12, 13],
                        columns={"returns": 1.0, "advantages": 1.0, "rollout_logp": 0.1},
                        scalars={"loss_mask": torch.tensor([1.0, 1.0, 0.0, 1.0])})

def shard_of(batch: Batch) -> Shard:
    """The whole batch as one rank's shard, cut into two micro-batches."""
    return Shard(index=0, batch=batch, micro_bounds=(0, 2, len(batch)))


def with_columns(batch: Batch, *results: WorkerResult) -> Batch:
    """`batch` plus the packed columns the results computed."""
    new: dict[str, Packed] = {}
    for r in results:
        new.update(r.outputs.packed)
    return Batch(sample_ids=batch.sample_ids, prompt_lens=batch.prompt_lens,
                 response_lens=batch.response_lens, packed={**batch.packed, **new},
                 scalars=batch.scalars)


def placed_on(cfg: PPOConfig, device: torch.device) -> PPOConfig:
    """`cfg` with ``placement.device`` = `device`: what ``placement.device=cuda`` does, to a
    device that CPUs have. The config admits "cpu" and "cuda" only, so the copy is made
    without its checks (a test device, never a run's)."""
    placement, out = copy.copy(cfg.placement), copy.copy(cfg)
    object.__setattr__(placement, "device", device)  # frozen: the only way in
    object.__setattr__(out, "placement", placement)
    return out


Run = dict[str, object]
"""Path name -> its WorkerResult (or the DeviceMixError it raised), plus "inputs" and the
weights after the run."""


def run_every_role(device: torch.device | None, attention: str,
                   inputs: Batch | None = None) -> Run:
    """Every compute path of the policy and critic workers, the models on `device` (None:
    where the config puts them, the CPU). `inputs`: the batch the updates train on (default:
    `make_batch()` with this run's own log-probs and values), so that each path is checked on
    its own. A path that mixes devices leaves its `DeviceMixError` in place of its result."""
    cfg = config(attention)
    cfg = cfg if device is None else placed_on(cfg, device)
    policy = PolicyWorker(WorkerIdentity(role="policy", rank=0, world_size=1), config=cfg,
                          vocab_size=VOCAB, eos_id=EOS, pad_id=PAD,
                          max_response_tokens=NORM_LEN)
    critic = CriticWorker(WorkerIdentity(role="critic", rank=0, world_size=1), config=cfg,
                          vocab_size=VOCAB, pad_id=PAD)
    reference = ReferenceWorker(WorkerIdentity(role="reference", rank=0, world_size=1),
                                config=cfg, vocab_size=VOCAB, eos_id=EOS, pad_id=PAD)
    policy.setup()  # ends with the engine's first, checked weight sync
    critic.setup()
    for model in (policy.model, policy.reference, policy.engine.model, critic.model,
                  reference.model):
        assert next(model.parameters()).device == (device or torch.device("cpu"))
    out: Run = {}

    def call(name: str, method: Callable[..., WorkerResult], *args: Any, **kwargs: Any) -> None:
        try:
            out[name] = method(*args, **kwargs)
        except DeviceMixError as e:  # reported by the test of that path
            out[name] = e

    tokens = shard_of(make_batch().only("tokens"))
    call("old_logp", policy.compute_logprobs, tokens)
    call("ref_logp", policy.compute_logprobs, tokens, reference=True)
    call("pool_ref_logp", reference.compute_logprobs, tokens)  # placement.reference=pool
    call("values", critic.compute_values, tokens)
    batch = inputs if inputs is not None else with_columns(
        make_batch(), out["old_logp"], out["ref_logp"], out["values"])
    totals = Totals.of(batch, NORM_LEN)
    call("actor_update", policy.update, shard_of(batch), totals=totals, step=0)
    call("critic_update", critic.update, shard_of(batch), totals=totals, step=0)
    call("sync", policy.sync_weights)
    out["inputs"] = batch
    out["actor_weights"] = {n: p.detach().cpu() for n, p in policy.model.named_parameters()}
    out["critic_weights"] = {n: p.detach().cpu() for n, p in critic.model.named_parameters()}
    out["engine_weights"] = policy.engine_weights()
    return out


@pytest.fixture(scope="module", params=list(ATTENTION))
def runs(request: pytest.FixtureRequest) -> tuple[Run, Run, float]:
    """(the all-CPU run, the run with every model on the fake device and the same inputs, the
    relative tolerance between them) for one attention kernel."""
    on_cpu = run_every_role(None, request.param)
    with FakeDevice():
        on_fake = run_every_role(FAKE, request.param, on_cpu["inputs"])
    return on_cpu, on_fake, ATTENTION[request.param]


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Bit for bit when `tol` is 0; else max |a - b| <= tol x max |b| (over the tensor: a
    value near 0 inherits its scale's rounding)."""
    if tol == 0.0:
        return torch.equal(a, b)
    return a.shape == b.shape and float((a - b).abs().max()) <= tol * float(b.abs().max())


def result_tensors(result: WorkerResult) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor a result carries."""
    yield "sample_ids", result.sample_ids
    b = result.outputs
    if b is None:
        return
    yield from (("outputs.sample_ids", b.sample_ids), ("outputs.prompt_lens", b.prompt_lens),
                ("outputs.response_lens", b.response_lens))
    for name, col in b.packed.items():
        yield f"packed {name}", col.values
        yield f"packed {name} offsets", col.offsets
    yield from ((f"scalar {n}", t) for n, t in b.scalars.items())


RESULTS = ("old_logp", "ref_logp", "pool_ref_logp", "values", "actor_update", "critic_update",
           "sync")


@pytest.mark.parametrize("name", RESULTS)
def test_every_role_path_computes_on_the_models_device_and_returns_cpu_tensors(
        runs: tuple[Run, Run], name: str) -> None:
    on_cpu, on_fake, tol = runs
    got, want = on_fake[name], on_cpu[name]
    assert not isinstance(got, DeviceMixError), f"{name} mixed devices: {got}"
    assert isinstance(got, WorkerResult) and isinstance(want, WorkerResult)
    # Results leaving a worker hold plain CPU tensors, whatever device computed them.
    elsewhere = not_plain_cpu(result_tensors(got))
    assert not elsewhere, f"{name}: not plain CPU tensors: {elsewhere}"
    # ... and the same numbers as the all-CPU run (bit for bit with eager attention).
    assert (got.outputs is None) == (want.outputs is None)
    if got.outputs is not None:
        assert torch.equal(got.outputs.sample_ids, want.outputs.sample_ids), name
        assert got.outputs.packed.keys() == want.outputs.packed.keys(), name
        for col, packed in got.outputs.packed.items():
            assert torch.equal(packed.offsets, want.outputs.packed[col].offsets), (name, col)
            assert close(packed.values, want.outputs.packed[col].values, tol), (name, col)
    metrics = {m.name: (m.total, m.weight) for m in got.metrics}
    wanted = {m.name: (m.total, m.weight) for m in want.metrics}
    assert metrics.keys() == wanted.keys(), name
    for metric, (total, weight) in metrics.items():
        assert weight == wanted[metric][1], (name, metric)
        # a metric's total is a sum over tokens: absolute for small totals (ppo_kl is
        # old - new log-probs, exactly 0 on one device and rounding on the other)
        assert abs(total - wanted[metric][0]) <= tol * max(1.0, abs(wanted[metric][0])), (
            name, metric, total, wanted[metric][0])
    assert metrics or name.endswith("ref_logp"), f"{name} recorded no metric"  # ref: none


@pytest.mark.parametrize("name", ["actor_weights", "critic_weights", "engine_weights"])
def test_the_updates_and_the_sync_leave_the_weights_of_the_cpu_run(
        runs: tuple[Run, Run], name: str) -> None:
    on_cpu, on_fake, tol = runs
    got, want = on_fake[name], on_cpu[name]
    assert got.keys() == want.keys() and got
    assert all(is_plain_cpu(t) for t in got.values()), name
    if tol == 0.0:
        assert all(torch.equal(t, want[n]) for n, t in got.items()), name
    else:  # over all weights: AdamW's first step is ~lr x sign(g), and a g that is 0 up to
        # rounding (a key bias: softmax ignores a shift) takes either sign in any order
        diff = torch.cat([(t - want[n]).flatten() for n, t in got.items()]).norm()
        scale = torch.cat([t.flatten() for t in want.values()]).norm()
        assert float(diff / scale) < tol, (name, float(diff / scale))


def test_a_reference_pool_computes_the_policys_reference_log_probs(
        runs: tuple[Run, Run, float]) -> None:
    for run in runs[:2]:  # on the CPU and on the fake device alike: bit for bit
        pool, policy = run["pool_ref_logp"].outputs, run["ref_logp"].outputs
        assert torch.equal(pool.packed["ref_logp"].values, policy.packed["ref_logp"].values)


def test_the_fake_device_refuses_a_mix_and_gives_plain_cpu_tensors_back() -> None:
    # The guard the tests above rely on: a fake-device tensor with a CPU one is an error,
    # as it would be on CUDA; a 0-d CPU tensor (a scalar) may mix, as on CUDA.
    with FakeDevice():
        a = torch.arange(4.0).to(FAKE)
        assert a.device == FAKE and not is_plain_cpu(a)
        with pytest.raises(DeviceMixError, match="aten.add"):
            a + torch.ones(4)
        with pytest.raises(DeviceMixError, match="aten.gather"):
            a[None].gather(1, torch.zeros((1, 2), dtype=torch.int64))
        b = (a * torch.tensor(2.0) + torch.ones(4, device=FAKE)).cpu()
    assert is_plain_cpu(b) and b.tolist() == [1.0, 3.0, 5.0, 7.0]


def test_a_result_built_from_tensors_on_another_device_holds_plain_cpu_tensors() -> None:
    identity = WorkerIdentity(role="policy", rank=0, world_size=1)
    batch = make_batch()
    with FakeDevice():
        builder = ResultBuilder(identity, batch)
        logp = torch.arange(8.0).reshape(2, 4).to(FAKE)
        ids, lens = batch.sample_ids.to(FAKE), batch.response_lens.to(FAKE)
        builder.add_padded(ids[:2], lens[:2], padded={"logp": logp},
                           scalars={"score": torch.zeros(2, device=FAKE)})
        builder.add(ids[2:], packed={"logp": [torch.ones(4, device=FAKE),
                                                      torch.ones(2, device=FAKE)]},
                    scalars={"score": torch.ones(2, device=FAKE)})
        builder.metric("m", logp, "mean_tokens")
    result = builder.build()
    assert not_plain_cpu(result_tensors(result)) == []
    assert result.outputs.packed["logp"].values.tolist() == [0.0, 1.0, 2.0, 4.0, 1, 1, 1, 1, 1, 1]
    assert result.outputs.scalars["score"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert [(m.total, m.weight) for m in result.metrics] == [(28.0, 8.0)]


def test_moving_a_batch_is_free_where_it_already_is_and_exact_elsewhere() -> None:
    # The role methods call `Batch.to(model's device)` for every micro-batch: on the CPU it
    # must be the batch itself (no copy), elsewhere every tensor moves and comes back intact.
    batch = make_batch()
    assert batch.to("cpu") is batch and batch.to(torch.device("cpu")) is batch
    with FakeDevice():
        moved = batch.to(FAKE)
        assert moved.to(FAKE) is moved
        assert [t.device for t in (moved.sample_ids, moved.packed["tokens"].offsets,
                                   moved.scalars["loss_mask"])] == [FAKE] * 3
        back = moved.to("cpu")
    assert back.equals(batch) and is_plain_cpu(back.packed["returns"].values)


def test_a_result_made_by_hand_with_device_tensors_is_refused() -> None:
    # `ResultBuilder` keeps CPU copies; a result assembled any other way must not carry a
    # device tensor to the driver either (it would unpickle onto the driver's own GPU).
    identity = WorkerIdentity(role="policy", rank=0, world_size=1)
    batch = make_batch()
    with FakeDevice():
        on_device = batch.to(FAKE)
        with pytest.raises(ValueError, match="CPU tensors only.*sample_ids on meta"):
            WorkerResult(version=1, identity=identity, sample_ids=on_device.sample_ids,
                         outputs=None)
        with pytest.raises(ValueError, match=r"response_lens on meta.*outputs\['tokens'\]"):
            WorkerResult(version=1, identity=identity, sample_ids=batch.sample_ids,
                         outputs=on_device)
