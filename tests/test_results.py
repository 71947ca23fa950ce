"""Canonical results: the same format from every local strategy, a merge that restores the
original order and checks every id, exact metric reduction, and collect-rank behaviour."""

from __future__ import annotations

import random
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from avrid.dispatch import Batch, DispatchConfig, DispatchPlan, Packed, make_plan
from avrid.results import (
    HANDLING_SPANS,
    RESULT_VERSION,
    Metric,
    Phases,
    ResultBuilder,
    WorkerResult,
    compute_seconds,
    merge,
    merge_metrics,
)
from avrid.workers import Mesh, WorkerIdentity
from tests.helpers import fake_log_probs
from tests.test_batch import make_batch

pytestmark = pytest.mark.chapter(3)

lengths = st.lists(st.tuples(st.integers(1, 12), st.integers(0, 20)), min_size=1, max_size=40)


def identity(dp: int, tp: int = 0, tp_size: int = 1, dp_size: int = 1) -> WorkerIdentity:
    mesh = Mesh.of(dp=dp_size, tp=tp_size)
    return WorkerIdentity(role="actor", rank=mesh.rank_of(dp=dp, tp=tp),
                          world_size=mesh.size, coords={"dp": dp, "tp": tp})


def run_locally(plan: DispatchPlan, batch: Batch, strategy: str = "micro",
                tp_size: int = 1) -> list[WorkerResult]:
    """What the workers of a dp x tp group would return, without starting any."""
    shards = plan.split(batch)
    return [fake_log_probs(identity(s.index, tp, tp_size, plan.num_shards), s, strategy,
                           ResultBuilder)
            for s in shards for tp in range(tp_size)]


def test_local_strategies_give_identical_canonical_results() -> None:
    batch = make_batch([(3, 17), (2, 1), (5, 40), (1, 9), (4, 22), (2, 0)])
    plan = make_plan(batch, 1, DispatchConfig(micro_batch_tokens=30))
    shard = plan.split(batch)[0]
    assert len(shard.micro_batches()) > 1
    results = {s: fake_log_probs(identity(0), shard, s, ResultBuilder)
               for s in ("micro", "reversed", "whole", "padded")}
    ref = results["micro"]
    for name, r in results.items():
        assert r.outputs is not None and r.outputs.equals(ref.outputs), name
        assert torch.equal(r.sample_ids, shard.batch.sample_ids), name
        assert {m.name: (m.total, m.weight) for m in r.metrics} == {
            m.name: (m.total, m.weight) for m in ref.metrics}, name
        assert r.version == RESULT_VERSION and r.spans


@given(lengths, st.integers(1, 6), st.integers(1, 3), st.randoms())
def test_merge_restores_the_original_order(ls: list, k: int, tp: int, rnd: random.Random) -> None:
    batch = make_batch(ls, first_id=1000)
    plan = make_plan(batch, k, DispatchConfig(micro_batch_tokens=25))
    results = run_locally(plan, batch, tp_size=tp)
    rnd.shuffle(results)  # results arrive in any order
    merged = merge(plan, results)
    assert merged.batch.sample_ids.tolist() == batch.sample_ids.tolist()
    tokens = batch.packed["tokens"]
    assert torch.equal(merged.batch.packed["logprobs"].values,
                       -(tokens.values % 7).to(torch.float32))
    assert torch.equal(merged.batch.packed["logprobs"].offsets, tokens.offsets)
    # data metrics from collect ranks only; per-rank metrics from every worker
    assert merged.metrics["num_tokens"].value == tokens.values.numel()
    assert merged.metrics["workers"].value == k * tp


@given(st.lists(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=50), min_size=1,
                max_size=8))
def test_token_weighted_mean_over_shards_is_the_whole_batch_mean(shards: list) -> None:
    parts = [Metric(name="loss", reduction="mean_tokens",
                    total=float(torch.tensor(v, dtype=torch.float64).sum()), weight=len(v))
             for v in shards]
    merged = merge_metrics(parts)["loss"].value
    whole = torch.tensor([x for v in shards for x in v], dtype=torch.float64).mean().item()
    assert merged == pytest.approx(whole, rel=1e-12, abs=1e-9)


def test_mean_of_means_would_be_wrong_and_is_not_what_merge_does() -> None:
    batch = make_batch([(1, 100), (1, 1), (1, 1), (1, 1)])  # one long, three short
    plan = make_plan(batch, 2, DispatchConfig(method="contiguous"))
    merged = merge(plan, run_locally(plan, batch))
    lp = -(batch.packed["tokens"].values % 7).to(torch.float64)
    assert merged.metrics["logprob_mean"].value == pytest.approx(lp.mean().item(), rel=1e-12)
    per_shard = [r.metrics[0].value for r in merged.results]
    assert sum(per_shard) / 2 != pytest.approx(lp.mean().item(), rel=1e-3)
    assert merged.metrics["longest"].value == 101.0


def test_only_collect_ranks_return_data() -> None:
    batch = make_batch([(2, 3)] * 6)
    plan = make_plan(batch, 2)
    results = run_locally(plan, batch, tp_size=2)
    by_rank = {r.identity.rank: r for r in results}
    assert [by_rank[r].is_collect for r in range(4)] == [True, False, True, False]
    assert by_rank[1].outputs is None and by_rank[1].spans and by_rank[1].metrics
    assert merge(plan, results).batch.sample_ids.tolist() == batch.sample_ids.tolist()


def _tamper(result: WorkerResult, outputs: Batch | None = None, **kw: object) -> WorkerResult:
    fields = {"version": result.version, "identity": result.identity,
              "sample_ids": result.sample_ids, "outputs": outputs or result.outputs,
              "metrics": result.metrics, "spans": result.spans}
    fields.update(kw)
    return WorkerResult(**fields)  # type: ignore[arg-type]


def test_malformed_results_name_the_ids_and_the_worker() -> None:
    batch = make_batch([(2, 2)] * 6, first_id=10)
    plan = make_plan(batch, 2, DispatchConfig(method="contiguous"))  # 10,11,12 | 13,14,15
    good = run_locally(plan, batch)
    r0, r1 = good
    cases = [
        ([_tamper(r0, r0.outputs.take([0, 1])), r1],  # type: ignore[union-attr]
         r"actor\[0\] \(shard 0\) returned a bad result: missing sample ids \[12\]"),
        ([_tamper(r0, Batch.concat([r0.outputs, r1.outputs.take([0])])), r1],  # type: ignore[list-item]
         r"actor\[0\] \(shard 0\) returned a bad result: duplicated sample ids \(sent to "
         r"another shard\) \[13\]"),
        ([r0, _tamper(r1, _rename(r1.outputs, {13: 99}))],  # type: ignore[arg-type]
         r"actor\[1\] \(shard 1\) returned a bad result: missing sample ids \[13\]; unknown "
         r"sample ids \[99\]"),
        ([r0, r0], r"shard 0 has two collect results, from actor\[0\] and actor\[0\]"),
        ([r0], r"no collect result for shards \[1\]"),
        ([_tamper(r0, version=RESULT_VERSION + 1), r1], r"actor\[0\] returned result format v2"),
        ([r0, _tamper(r1, _cast(r1.outputs))],  # type: ignore[arg-type]
         r"actor\[1\] returned columns that disagree with actor\[0\]'s"),
    ]
    for results, match in cases:
        with pytest.raises(ValueError, match=match):
            merge(plan, results)
    with pytest.raises(ValueError, match=r"sample ids must be unique; repeated: \[11\]"):
        Batch.concat([r0.outputs, r0.outputs.take([1])])  # type: ignore[list-item]


def test_per_token_rows_must_be_response_or_sequence_long() -> None:
    batch = make_batch([(2, 2)] * 6, first_id=10)
    plan = make_plan(batch, 2, DispatchConfig(method="contiguous"))  # 10,11,12 | 13,14,15
    r0, r1 = run_locally(plan, batch)  # "logprobs": one value per sequence token (4)
    lp = r1.outputs.packed["logprobs"]  # type: ignore[union-attr]
    rows = [lp.row(i) for i in range(len(lp))]
    longer = _with_packed(r1.outputs, "logprobs",  # type: ignore[arg-type]
                          [rows[0], torch.cat([rows[1], rows[1][:1]]), rows[2]])
    with pytest.raises(ValueError, match=r"actor\[1\] returned column 'logprobs' with 5 values "
                                         r"for sample 14, whose response has 2 tokens "
                                         r"\(prompt \+ response: 4\)"):
        merge(plan, [r0, _tamper(r1, longer)])
    # One value per response token is the other valid kind; a mix of both kinds is not.
    response_long = [r[2:] for r in rows]
    assert merge(plan, [_tamper(r0, _with_packed(r0.outputs, "logprobs",  # type: ignore[arg-type]
                                                 [lp.row(0)[2:]] * 3)),
                        _tamper(r1, _with_packed(r1.outputs, "logprobs",  # type: ignore[arg-type]
                                                 response_long))]).batch
    mixed = _with_packed(r1.outputs, "logprobs", [rows[0], *response_long[1:]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"column 'logprobs' with 4 values for sample 13"):
        merge(plan, [r0, _tamper(r1, mixed)])
    # A generation call (prompts sent, no response yet) returns new tokens of any length.
    prompts = Batch(sample_ids=batch.sample_ids, prompt_lens=batch.prompt_lens,
                    response_lens=torch.zeros(6, dtype=torch.int64))
    plan = make_plan(prompts, 1)
    (out,) = [ResultBuilder.for_shard(identity(0), s) for s in plan.split(prompts)]
    out.add(prompts.sample_ids, packed={"response": [torch.ones(k) for k in range(6)]})
    assert merge(plan, [out.build()]).batch.packed["response"].lengths.tolist() == [0, 1, 2,
                                                                                   3, 4, 5]


def _with_packed(b: Batch, name: str, rows: list[torch.Tensor]) -> Batch:
    return Batch(sample_ids=b.sample_ids, prompt_lens=b.prompt_lens,
                 response_lens=b.response_lens, packed={**b.packed, name: Packed.from_rows(rows)},
                 scalars=b.scalars)


def _rename(b: Batch, mapping: dict[int, int]) -> Batch:
    ids = torch.tensor([mapping.get(int(i), int(i)) for i in b.sample_ids])
    return Batch(sample_ids=ids, prompt_lens=b.prompt_lens, response_lens=b.response_lens,
                 packed=b.packed, scalars=b.scalars)


def _cast(b: Batch) -> Batch:
    return Batch(sample_ids=b.sample_ids, prompt_lens=b.prompt_lens,
                 response_lens=b.response_lens, packed=b.packed,
                 scalars={k: v.to(torch.float64) for k, v in b.scalars.items()})


def test_the_builder_refuses_incomplete_or_repeated_outputs() -> None:
    batch = make_batch([(1, 1)] * 3)
    shard = make_plan(batch, 1).split(batch)[0]
    builder = ResultBuilder.for_shard(identity(0), shard)
    builder.add([0, 1], scalars={"v": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"actor\[0\]: .* never added: \[2\]"):
        builder.build()
    builder.add([1, 2], scalars={"v": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"added twice: \[1\]"):
        builder.build()
    with pytest.raises(KeyError, match=r"not in this batch: \[7\]"):
        builder.add([7], scalars={"v": torch.zeros(1)})


def test_metric_errors() -> None:
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        Metric(name="x", reduction="median", total=1.0, weight=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot merge metric 'x'"):
        Metric(name="x", reduction="sum", total=1, weight=1).merge(
            Metric(name="x", reduction="max", total=1, weight=1))
    with pytest.raises(ValueError, match="must be finite"):
        Metric(name="x", reduction="sum", total=float("nan"), weight=1)


def test_misused_entry_points_say_what_was_wrong() -> None:
    from avrid.results import run_shards

    batch = make_batch([(1, 1)] * 2)
    shard = make_plan(batch, 1).split(batch)[0]
    with pytest.raises(ValueError, match="needs at least one padded column"):
        ResultBuilder.for_shard(identity(0), shard).add_padded([0, 1], torch.tensor([2, 2]),
                                                               padded={})
    with pytest.raises(TypeError, match="the 4th argument is the DispatchConfig"):
        run_shards(None, fake_log_probs, batch, "padded")  # type: ignore[arg-type]


def test_a_result_carries_the_call_handling_around_its_compute_spans() -> None:
    """`build` adds `unpack` (creation to first span) and `pack` (last span to built); they
    are orchestration, so a step's compute (`Phases.times`) leaves them out."""
    batch = make_batch([(2, 3), (1, 4)])
    shard = make_plan(batch, 1).split(batch)[0]
    builder = ResultBuilder.for_shard(identity(0), shard)
    time.sleep(0.02)  # unpacking the shard
    with builder.span("forward"):
        time.sleep(0.03)
    builder.add(batch.sample_ids)
    time.sleep(0.02)  # packing
    result = builder.build()
    names = [s.name for s in result.spans]
    assert names == ["forward", "unpack", "pack"]
    forward, unpack, pack = result.spans
    assert unpack.end == forward.start and pack.start == forward.end
    assert unpack.duration >= 0.02 and pack.duration >= 0.02
    assert compute_seconds(result.spans) == forward.duration
    assert HANDLING_SPANS == {"unpack", "pack"}
    phases = Phases()
    phases.record([result])
    assert phases.times()["time/compute"] == forward.duration
    # A call that times nothing: all of it is unpack, and none of it compute.
    empty = ResultBuilder.for_call(identity(0)).build()
    assert [s.name for s in empty.spans] == ["unpack", "pack"]
    assert compute_seconds(empty.spans) == 0.0
