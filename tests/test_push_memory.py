"""Chapter 6: what a weight push holds in memory, on each side (`transfer.py`).

At 7B a rollout GPU gives 0.85 of itself to vLLM, so a push that received a whole copy of the
model (14.2 GiB in bf16) beside the engine before loading it ran out of memory at the first
push; and trainer rank 0, which kept every posted bucket until its next push, held the same
copy beside training. What each side may hold is a few buckets, whatever the model's size:

- a rollout rank streams the push into its engine: the tensors received and not yet loaded,
  and the bucket being received, stay within 3 buckets (a bucket's tensors wait in its buffer
  while the next one arrives, plus a tensor that spans two buckets);
- trainer rank 0 keeps at most 2 broadcasts posted and unfinished.

Measured, not inferred: every tensor the push code allocates (`avrid.pipeline.transfer`,
through `torch.empty`) is followed until it is freed, each side on its own, through a whole
in-process run (gloo) in which the tiny actor (337,152 bytes in fp32) is pushed in 6 buckets
of 64 KiB; the run's fingerprint check still proves each engine got exactly the model.

Rank 0's bound must not rest on the backend's timing: gloo's worker thread (NCCL's watchdog)
lets go of a finished broadcast's tensors a little after `wait` returns, so a fresh buffer per
bucket was still alive, now and then, when the next one was made (CI once saw 140,544 bytes:
the last bucket made while the two before it were still held). The second test plays a
backend that never lets go: rank 0 packs into the same two buffers in turn.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from avrid.pipeline import PipelinedTrainer, transfer
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.reshard import ModelLayout, ParamLayout
from tests.pipeline_workers import CountingLearner, CountingRollout

pytestmark = pytest.mark.chapter(6)

BUCKET_BYTES = 64 << 10
"""The tiny actor in 6 buckets."""


class LiveBytes:
    """Bytes of the tensors allocated so far and not yet freed, and their peak."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._lock = threading.Lock()

    def add(self, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        with self._lock:
            self.live += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, size)  # runs when the tensor (and its views) die

    def _free(self, size: int) -> None:
        with self._lock:
            self.live -= size


@contextmanager
def push_allocations() -> Iterator[tuple[LiveBytes, LiveBytes]]:
    """(trainer rank 0's, the rollout ranks') live bytes allocated by the push code: calls
    to `torch.empty` from `avrid.pipeline.transfer`, by `post_buckets` (packing the
    broadcasts) or by anything else there (receiving)."""
    sender, receiver = LiveBytes(), LiveBytes()
    empty: Callable[..., torch.Tensor] = torch.empty

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)
        caller = sys._getframe(1)
        if caller.f_globals.get("__name__") == transfer.__name__:
            (sender if caller.f_code.co_name == "post_buckets" else receiver).add(t)
        return t

    torch.empty = counted  # the transfer module looks `torch.empty` up at each call
    try:
        yield sender, receiver
    finally:
        torch.empty = empty


class Counting(PipelinedTrainer):
    policy_worker = CountingLearner
    rollout_worker = CountingRollout


def test_a_push_holds_a_few_buckets_on_either_side(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "BUCKET_BYTES", BUCKET_BYTES)
    cfg = with_overrides(preset("tiny-ppo"), [
        "train.progress=false", "train.steps=2", "train.prompts_per_step=8",
        "algo.responses_per_prompt=4", "train.mini_batch_size=16", "train.val_prompts=16",
        "pipeline.mode=one_step_off", "train.call_timeout_s=20",
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "pipeline.rollout_dp=1"])
    with push_allocations() as (sender, receiver), Counting(cfg) as tr:
        tr.start()
        rows = [tr.train_step(step)[0] for step in range(cfg.train.steps)]
        tr.validate()  # pushes the last version, fingerprint-checked
        buckets = transfer.push_buckets(tr.push_plan.target, tr.push_plan.bucket_bytes)
        model_bytes = sum(b.nbytes for b in buckets)
    assert len(buckets) == 6 and model_bytes == 337_152
    assert {r["sync/bytes_per_rank"] for r in rows} - {0.0} == {float(model_bytes)}
    assert sender.peak <= 2 * BUCKET_BYTES, f"rank 0 held {sender.peak} bytes of buckets"
    assert receiver.peak <= 3 * BUCKET_BYTES, (
        f"a rollout rank held {receiver.peak} bytes received and not yet loaded")


class HoardingGroup:
    """A push group whose backend keeps every broadcast it was given, finished or not (as
    gloo's thread or NCCL's watchdog does for a while), and whose receivers read a bucket's
    buffer only when the broadcast is waited for: a buffer packed again before then would
    deliver the wrong bytes."""

    def __init__(self) -> None:
        self.works: list[tuple[object, torch.Tensor]] = []  # never let go
        self.delivered: dict[int, torch.Tensor] = {}  # id(work) -> the bytes received

    def broadcast(self, flat: torch.Tensor, *, root: int = 0) -> object:
        work = object()
        self.works.append((work, flat))
        return work

    def wait(self, works: list[object], *, deadline: float, what: str) -> None:
        held = {id(w): flat for w, flat in self.works}
        for work in works:
            self.delivered[id(work)] = held[id(work)].clone()


def test_rank_0_reuses_two_buffers_however_late_the_backend_lets_go() -> None:
    shapes = {"embed": (40, 24), "norm": (24,), "proj": (24, 48), "head": (40, 24)}
    target = ModelLayout(world_size=1, params=tuple(
        (n, ParamLayout.replicated(s, "bfloat16", 1)) for n, s in shapes.items()))
    buckets = transfer.push_buckets(target, 1000)  # 3,096 elements, 500 a bucket: 7 buckets
    weights = {n: torch.randn(s).to(torch.bfloat16) for n, s in shapes.items()}
    group = HoardingGroup()
    with push_allocations() as (sender, _):
        posted, failed = transfer.post_buckets(
            buckets, weights.__getitem__, group, "cpu", deadline=float("inf"), who="rank 0")
        group.wait([work for work, _ in posted], deadline=float("inf"), what="the last ones")
        assert failed is None and len(group.works) == len(buckets) == 7
        assert sender.peak <= 2 * max(b.nbytes for b in buckets), (
            f"rank 0 held {sender.peak} bytes: a buffer per bucket, kept by the backend")
    received = torch.cat([group.delivered[id(work)] for work, _ in group.works])
    assert torch.equal(received, torch.cat([w.reshape(-1) for w in weights.values()]))
