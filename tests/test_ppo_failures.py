"""Failures that tell the truth: a dead rank, a rank that fails while its peer waits in a
collective, a hung reward function, each reported as one error naming the real role, rank and
method within seconds; empty shards and micro-batches that still take part in FSDP's
collectives; a non-finite optimizer step that is skipped and counted.

Ray runs use the leak-checked `ray_cluster` fixture and the tiny model (dp = 2, seconds each).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from avrid.dispatch import Batch, Shard
from avrid.ppo.data.columns import Totals
from avrid.ppo.driver.run import train
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.forward import train_shard
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.task import Prompt
from avrid.results import ResultBuilder, run_shards
from avrid.workers import WorkerError, WorkerIdentity
from tests.helpers import child_env
from tests.test_ppo_trainer import EchoFirstTask

pytestmark = pytest.mark.chapter(5)

ROOT = Path(__file__).resolve().parents[1]


def ray_tiny(out: Path, *extra: str) -> PPOConfig:
    """PPO on Ray with dp = 2 for policy and critic, a handful of short sequences per step."""
    return with_overrides(preset("tiny-ppo"), [
        "placement.backend=ray", "placement.actor_dp=2", "placement.critic_dp=2",
        "train.steps=2", "train.prompts_per_step=4", "algo.responses_per_prompt=2",
        "train.mini_batch_size=8", "train.val_prompts=4", "train.val_every=100",
        "train.progress=false", f"train.out_dir={out}", *extra])


# ---- a failing rank: one error, the real method, within seconds --------------------------------

@pytest.mark.slow
def test_a_killed_rank_is_reported_naming_its_method_and_cleanup_does_not_hide_it(
        tmp_path: Path, ray_cluster: None) -> None:
    with pytest.raises(WorkerError) as err:  # noqa: PT012 - the kill happens inside the run
        with Trainer(ray_tiny(tmp_path)) as trainer:
            trainer.start()
            trainer.train_step(0)
            ray.kill(trainer.critic._channel.actors[1], no_restart=True)
            killed = time.monotonic()
            try:
                trainer.train_step(1)
            finally:  # the clock stops when the error is raised: not the cleanup after it
                raised = time.monotonic()
    assert err.value.role == "critic" and err.value.rank == 1
    assert err.value.reason == "died" and err.value.method == "compute_values"
    assert "close" not in str(err.value).splitlines()[0]
    # Bounded: the rest of step 1 up to the critic's call (a second of work on the tiny
    # model), then the death noticed within a poll slice; not Ray's start-up, not the close.
    print(f"killed rank reported {raised - killed:.2f} s after the kill")
    assert raised - killed < 10.0, f"the death took {raised - killed:.1f} s to surface"


def _break_optimizer(worker: CriticWorker) -> None:
    worker.optimizer = None  # update() fails before its first collective; rank 0 waits in it


@pytest.mark.slow
def test_a_rank_failing_while_its_peer_waits_in_a_collective_is_reported_at_once(
        tmp_path: Path, ray_cluster: None) -> None:
    with pytest.raises(WorkerError) as err:  # noqa: PT012
        with Trainer(ray_tiny(tmp_path)) as trainer:
            trainer.start()
            _, batch = trainer.train_step(0)
            ray.get(trainer.critic._channel.actors[1].__ray_call__.remote(_break_optimizer))
            started = time.monotonic()
            # Rank 1 raises at once; rank 0 is left in its first all-gather, waiting for it.
            try:
                run_shards(trainer.critic, CriticWorker.update, batch, trainer.dispatch,
                           totals=Totals.of(batch, trainer.max_response), step=0)
            finally:  # the clock stops when the error is raised: not the cleanup after it
                raised = time.monotonic()
    assert (err.value.role, err.value.rank, err.value.method) == ("critic", 1, "update")
    assert "NoneType" in err.value.headline  # the remote exception's own message
    # Bounded: rank 1's failure is read within a poll slice, though rank 0 never returns.
    print(f"failing rank reported {raised - started:.2f} s after the call")
    assert raised - started < 10.0, f"took {raised - started:.1f} s"


# ---- a call that never returns ----------------------------------------------------------------

class HungTask(EchoFirstTask):
    """The echo task of test_ppo_trainer.py, but its reward function never returns (the
    first call to it, at the step-0 validation, hangs)."""

    def reward(self, prompt: Prompt, response: str) -> float:
        if mark := os.environ.get("AVRID_TEST_HUNG_MARK"):
            Path(mark).touch()  # tells a test that the hang has begun
        time.sleep(3600)
        return 0.0


def make_hung_task() -> HungTask:
    return HungTask()


@pytest.mark.slow
def test_a_hung_reward_function_stops_the_run_with_a_timeout(tmp_path: Path) -> None:
    config = with_overrides(preset("tiny-ppo"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "task.name=tests.test_ppo_failures:make_hung_task", "task.options=",
        "train.call_timeout_s=2", "train.progress=false", f"train.out_dir={tmp_path}"])
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"reward\[0\]\.score\(\) timeout: ranks \[0\] still "
                                          r"running after 2\.0 s"):
        train(config)
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_the_command_reports_a_hung_reward_in_one_line(tmp_path: Path) -> None:
    env = child_env()
    args = ["ppo", "--task", "tests.test_ppo_failures:make_hung_task", "--out", str(tmp_path),
            "--set", "train.call_timeout_s=3", "--set", "train.progress=false"]
    done = subprocess.run([sys.executable, "-m", "avrid.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 2, done.stderr
    ours = [ln for ln in done.stderr.splitlines() if ln.startswith("avrid ppo:")]
    assert len(ours) == 1 and "reward[0].score() timeout" in ours[0], done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # (--debug: test_cli_errors.py)


@pytest.mark.slow
def test_one_ctrl_c_stops_an_in_process_run_stuck_in_a_worker(tmp_path: Path) -> None:
    mark = tmp_path / "hung"
    env = child_env(AVRID_TEST_HUNG_MARK=str(mark))
    proc = subprocess.Popen(
        [sys.executable, "-m", "avrid.cli", "ppo", "--backend", "inprocess", "--task",
         "tests.test_ppo_failures:make_hung_task", "--out", str(tmp_path / "run"),
         "--set", "train.progress=false"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run never hung"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)  # one Ctrl-C, and it is gone
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted; no checkpoint was written yet" in err and "Traceback" not in err, err


# ---- any batch over any DP size ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    # Mini-batches of one sequence over two ranks: one rank's shard is empty every time.
    ("train.mini_batch_size=1",),
    # Three sequences over two ranks, one per micro-batch: the rank with one sequence runs an
    # empty second micro-batch so that both run two forward/backward passes.
    ("train.prompts_per_step=3", "train.mini_batch_size=3", "train.micro_batch_tokens=9",
     "rollout.max_prompt_tokens=5"),
])
def test_empty_shards_and_micro_batches_train_over_two_ranks(
        tmp_path: Path, ray_cluster: None, extra: tuple[str, ...]) -> None:
    summary = train(ray_tiny(tmp_path, "train.steps=1", *extra))
    last = summary.rows[-1]
    assert last["step"] == 1
    for key in ("actor/loss", "critic/loss", "actor/grad_norm", "critic/grad_norm"):
        assert key in last
    assert last["actor/skipped_steps"] == 0


# ---- a non-finite step is skipped and counted --------------------------------------------------

def test_a_non_finite_loss_skips_the_optimizer_step_and_counts_it() -> None:
    model = build_tiny_policy(TinyModelSpec(vocab_size=8), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    batch = Batch.from_rows(sample_ids=[0, 1], prompt_lens=[2, 2], response_lens=[2, 1],
                            packed={"tokens": [torch.tensor([1, 2, 3, 4]),
                                               torch.tensor([1, 2, 5])]})
    shard = Shard(index=0, batch=batch, micro_bounds=(0, 2))
    builder = ResultBuilder.for_shard(WorkerIdentity(role="actor", rank=0, world_size=1), shard)

    def nan_loss(x, mb, w, b):  # noqa: ANN001, ANN202
        from avrid.ppo.roles.forward import response_logprobs

        logp, _ = response_logprobs(model, x, 1.0)
        return (logp * w).sum() * float("nan")

    train_shard(model, optimizer, shard, builder, nan_loss, pad_id=0, agg="token-mean",
                totals=Totals.of(batch, 4), world_size=1, grad_clip=1.0, prefix="actor")
    metrics = {m.name: m.value for m in builder.build().metrics}
    assert metrics["actor/skipped_steps"] == 1.0
    assert "actor/loss" not in metrics  # a non-finite value is never recorded
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed in a skipped step"
