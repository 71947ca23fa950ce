"""Chapter 6: the weight push across pools, on its own terms (`transfer.py`, `push_group.py`).

- one communicator per member of the push group (trainer rank 0 + the rollout ranks), built
  once at join time, however many pushes follow (`PushGroup.built`): a design with a group
  per (trainer, rollout) pair, or one rebuilt per push, counts more;
- a bucketed broadcast: every push is one broadcast per bucket, each at most the bucket size,
  together exactly the model (what `sync/bytes_per_rank` reports), and a trainer rank outside
  the push group broadcasts nothing;
- a rollout receiver that stops mid-push (after its first bucket) stops the run with an
  error naming it, well within the push timeout (`train.call_timeout_s`, set small here);
- `PushGroup.wait` reports a broadcast nobody receives within its timeout, never hangs.

On gloo: in-process threads (fast) and Ray processes (slow: two trainer and two rollout ranks,
and a receiver whose process really dies); the same run over NCCL on two GPUs is marked
gpu(count=2) and skips without them. Not here: K = 0 against the sync run, staleness, the
fingerprint check (tests/test_pipeline.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from avrid.pipeline import PipelinedTrainer, transfer
from avrid.pipeline.push_group import PushGroup, PushTimeout
from avrid.pipeline.transfer import push_buckets
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.workers.outcome import free_port
from tests.helpers import seconds_to_failure
from tests.pipeline_workers import (
    CountingLearner,
    CountingRollout,
    ExitingReceiver,
    RaisingReceiver,
)

pytestmark = pytest.mark.chapter(6)

BUCKET_BYTES = 64 << 10
"""The tiny actor (337,152 bytes in fp32) in 6 buckets."""
TIMEOUT_S = 20
"""The push timeout of these runs (`train.call_timeout_s`)."""
GPU = ("placement.device=cuda", "rollout.engine=torch", "placement.actor_dp=1",
       "placement.critic_dp=1", "pipeline.rollout_dp=1")
"""One trainer GPU and one rollout GPU: the push crosses NCCL."""


@pytest.fixture
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Push buckets of `BUCKET_BYTES`: read by `push_plan` on the driver, the plan carries
    them to every worker (Ray processes included)."""
    monkeypatch.setattr(transfer, "BUCKET_BYTES", BUCKET_BYTES)


def config(*extra: str, backend: str = "inprocess", steps: int = 3) -> PPOConfig:
    """tiny-ppo one-step-off cut to seconds: in-process (one rank per role) or on Ray (two
    trainer and two rollout ranks unless `extra` says otherwise)."""
    sets = ["train.progress=false", f"train.steps={steps}", "train.prompts_per_step=8",
            "algo.responses_per_prompt=4", "train.mini_batch_size=16", "train.val_prompts=16",
            "pipeline.mode=one_step_off", f"train.call_timeout_s={TIMEOUT_S}"]
    if backend == "inprocess":
        sets += ["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
                 "pipeline.rollout_dp=1"]
    else:
        sets += ["placement.cpus_per_worker=0.5"]
    return with_overrides(preset("tiny-ppo"), [*sets, *extra])


class Counting(PipelinedTrainer):
    policy_worker = CountingLearner
    rollout_worker = CountingRollout


class WithRaisingReceiver(Counting):
    rollout_worker = RaisingReceiver


class WithExitingReceiver(Counting):
    rollout_worker = ExitingReceiver


def counted_run(cfg: PPOConfig) -> tuple[Counting, list, list, list[dict], int]:
    """Start, every step, validate (which pushes the last version); then each trainer and
    rollout rank's `push_counts`, the step metrics and the actor's bytes in the engine's
    dtype."""
    with Counting(cfg) as tr:
        tr.start()
        rows = [tr.train_step(step)[0] for step in range(cfg.train.steps)]
        tr.validate()
        policy = tr.policy.call(CountingLearner.push_counts)
        rollout = tr.rollout.call(CountingRollout.push_counts)
        itemsize = getattr(torch, cfg.model.dtype).itemsize
        model_bytes = sum(t.numel() * itemsize for t in tr.state().weights["actor"].values())
    return tr, policy, rollout, rows, model_bytes


def check_counts(cfg: PPOConfig, *, built_before: int, in_process: bool) -> None:
    tr, policy, rollout, rows, model_bytes = counted_run(cfg)
    rollouts = tr.rollout.world_size
    buckets = push_buckets(tr.push_plan.target, tr.push_plan.bucket_bytes)
    sizes = [b.nbytes for b in buckets]
    assert len(buckets) >= 3 and max(sizes) <= BUCKET_BYTES
    # Together the buckets are the model, which is what the metrics say each engine received.
    assert sum(sizes) == model_bytes == tr.push_plan.bytes_to(0)
    # (a step in which no push was checked reports 0)
    assert {r["sync/bytes_per_rank"] for r in rows} - {0.0} == {float(model_bytes)}
    # One broadcast per bucket per push, on trainer rank 0 and on every rollout rank; the
    # other trainer ranks are not in the push group and broadcast nothing.
    pushes = len(policy[0][1]) // len(buckets)
    assert pushes >= 3  # start-up's, then the updated versions (the last one by validate)
    assert policy[0][1] == sizes * pushes
    assert all(counts == [] for _, counts in policy[1:])
    assert all(counts == sizes * pushes for _, counts in rollout)
    # One communicator per member, built at join time, whatever the number of pushes.
    if in_process:  # one process: the members' groups add up
        assert {built for built, _ in [*policy, *rollout]} == {built_before + 1 + rollouts}
    else:  # a process per rank: trainer rank 0 and each rollout rank built one
        assert [built for built, _ in policy] == [1] + [0] * (len(policy) - 1)
        assert [built for built, _ in rollout] == [1] * rollouts


# ---- gloo, in-process ------------------------------------------------------------------------

def test_one_group_per_member_and_one_broadcast_per_bucket_in_process(
        small_buckets: None) -> None:
    check_counts(config(), built_before=PushGroup.built, in_process=True)


def test_a_receiver_that_fails_mid_push_is_named_within_the_timeout(
        small_buckets: None) -> None:
    seconds = seconds_to_failure(
        config(), WithRaisingReceiver,
        r"(?s)rollout\[0\]\.receive_weights\(\) raised.*injected receiver failure")
    assert seconds < TIMEOUT_S


def test_wait_reports_a_broadcast_nobody_receives_within_its_timeout() -> None:
    # Two members in threads: both join (the group's one all-reduce), one broadcast goes
    # through, then member 0 broadcasts again and member 1 never takes part.
    port, timeout_s, seen = free_port(), 2.0, {}
    done = threading.Event()

    def member(rank: int) -> None:
        try:
            group = PushGroup("127.0.0.1", port, rank=rank, world_size=2, device="cpu",
                              timeout_s=timeout_s)
            flat = torch.arange(8.0) if rank == 0 else torch.zeros(8)
            group.wait([group.broadcast(flat)], deadline=time.monotonic() + timeout_s,
                       what=f"member {rank}")
            seen[rank] = flat.sum().item()
            if rank == 0:
                start = time.monotonic()
                work = group.broadcast(torch.ones(1 << 20))  # 4 MiB nobody receives
                try:
                    group.wait([work], deadline=start + timeout_s, what="the lost broadcast")
                except (PushTimeout, RuntimeError) as exc:
                    seen["error"], seen["after"] = str(exc), time.monotonic() - start
            else:
                done.wait(30)  # alive, in the group, but never receiving
        finally:
            if rank == 0:
                done.set()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert seen[0] == seen[1] == 28.0  # the first broadcast arrived
    assert seen["error"].startswith("the lost broadcast: ")
    assert seen["after"] < timeout_s + 2.0  # reported, not hung


# ---- gloo, Ray: two trainer and two rollout ranks --------------------------------------------

@pytest.mark.slow
def test_one_group_per_member_and_one_broadcast_per_bucket_on_ray(
        small_buckets: None, ray_cluster: None) -> None:
    check_counts(config(backend="ray"), built_before=0, in_process=False)


@pytest.mark.slow
def test_a_receiver_that_dies_mid_push_is_named_within_the_timeout(
        small_buckets: None, ray_cluster: None) -> None:
    seconds = seconds_to_failure(config(backend="ray"), WithExitingReceiver,
                                 r"rollout\[1\]\.receive_weights\(\) died")
    assert seconds < TIMEOUT_S


# ---- NCCL: a trainer GPU and a rollout GPU ---------------------------------------------------

@pytest.mark.gpu(count=2, duration_s=150, memory_gb=4)
@pytest.mark.timeout(600)
def test_one_group_per_member_and_one_broadcast_per_bucket_over_nccl(
        small_buckets: None, ray_cluster: None) -> None:
    check_counts(config(*GPU, backend="ray"), built_before=0, in_process=False)


@pytest.mark.gpu(count=2, duration_s=150, memory_gb=4)
@pytest.mark.timeout(600)
def test_a_receiver_that_dies_mid_push_over_nccl_is_named_within_the_timeout(
        small_buckets: None, ray_cluster: None) -> None:
    seconds = seconds_to_failure(config(*GPU, backend="ray"), WithExitingReceiver,
                                 r"rollout\[0\]\.receive_weights\(\) died")
    assert seconds < TIMEOUT_S
