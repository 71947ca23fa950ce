"""Chapter 6: the weight push across pools, on its own terms (`transfer.py`, `push_group.py`).

- one communicator per member of the push group (trainer rank 0 + the rollout ranks), built
  once at join time, however many pushes follow (`PushGroup.built`): a design with a group
  per (trainer, rollout) pair, or one rebuilt per push, counts more;
- a bucketed broadcast: every push is one broadcast per bucket, each at most the bucket size,
  together exactly the model (what `sync/bytes_per_rank` reports), and a trainer rank outside
  the push group broadcasts nothing;
- a rollout receiver that stops mid-push (after its first bucket) stops the run with an
  error naming it, well within the push timeout (`train.call_timeout_s`, set small here);
- `PushGroup.wait` reports a broadcast nobody receives within its timeout, never hangs;
- the timeouts are ordered: the backend's own (NCCL's watchdog, which ends the process)
  outlasts every deadline avrid polls with by `BACKEND_MARGIN_S`, and trainer rank 0 counts
  its deadline from the start of the push, not from after posting every bucket;
- a receiver that dies mid-push and takes trainer rank 0 with it (NCCL's watchdog, played
  here by a learner that ends its process) is reported as the receiver, not as rank 0.

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

from avrid.pipeline import PipelinedTrainer, learner, transfer
from avrid.pipeline.push_group import BACKEND_MARGIN_S, PushGroup, PushTimeout
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
    ExitingReceiverSlowPeers,
    RaisingReceiver,
    WatchdogLearner,
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


class WithWatchdog(Counting):
    policy_worker = WatchdogLearner
    rollout_worker = ExitingReceiverSlowPeers


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


def test_the_backend_timeout_outlasts_every_deadline_the_members_poll_with() -> None:
    # Both members of a two-rank group (threads): the backend's own timeout (gloo's here,
    # NCCL's watchdog on GPU) ends an operation only a margin after avrid's deadline for it.
    port, timeout_s, seen = free_port(), 2.0, {}

    def member(rank: int) -> None:
        group = PushGroup("127.0.0.1", port, rank=rank, world_size=2, device="cpu",
                          timeout_s=timeout_s)
        seen[rank] = group._backend.options._timeout.total_seconds(), group.timeout_s

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(seen) == 2
    for backend, polled in seen.values():
        assert backend >= polled + BACKEND_MARGIN_S, (
            f"the backend ends an operation after {backend:g} s, avrid's deadline for it "
            f"is {polled:g} s: the backend must come {BACKEND_MARGIN_S:g} s later")


SLOW_POST_S = 1.0
"""How long trainer rank 0's gathering and posting takes in the next test (a 7B model's)."""


def test_trainer_rank_0_counts_its_deadline_from_the_start_of_the_push(
        small_buckets: None, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[float] = []
    post = learner.post_buckets

    def slow_post(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - post_buckets' own
        started.append(time.monotonic())  # before the first bucket is gathered or posted
        posted = post(*args, **kwargs)
        time.sleep(SLOW_POST_S)
        return posted

    monkeypatch.setattr(learner, "post_buckets", slow_post)
    with Counting(config(steps=1)) as tr:  # in-process: one clock for every rank
        tr.start()  # its push is checked before it returns
        deadline = tr.policy.call_ranks([0], CountingLearner.push_deadline)[0]
    # Every broadcast was posted after `started`: NCCL's watchdog ends none of them before
    # started + the backend's timeout, which avrid's deadline must precede by the margin.
    assert deadline - started[-1] <= TIMEOUT_S, (
        f"trainer rank 0 polls until {deadline - started[-1]:.2f} s after the push began, "
        f"past the push timeout of {TIMEOUT_S} s")


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


@pytest.mark.slow
def test_a_receiver_death_that_ends_trainer_rank_0_is_reported_as_the_receivers(
        small_buckets: None, ray_cluster: None) -> None:
    # Rollout rank 1 dies mid-push; trainer rank 0's process then ends at its next call (as
    # NCCL's watchdog ends it): the run stops naming rollout rank 1, not trainer rank 0.
    seconds = seconds_to_failure(config(backend="ray"), WithWatchdog,
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
