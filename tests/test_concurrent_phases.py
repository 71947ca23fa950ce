"""`train.concurrent_phases=true` (`avrid/ppo/driver/concurrent.py`): each phase issued as soon
as the phases it reads from have finished gives the serial run bit for bit — every algorithmic
metric, every column of every step's batch (the samples), the final weights — for PPO (the
critic on its own pool, a KL term, a warm-up step), GRPO with dynamic sampling, LoRA (the
reference on the same ranks), a reward model beside the rule reward, one-step-off (PPO and
GRPO), in process and on Ray (PPO sync, GRPO one-step-off; chapter 7's episodes:
`tests/test_agents_pipeline.py`); the phases that may run together do; and a phase that
fails, times out or is interrupted while others are in flight ends the step as the serial
run does, leaking nothing.

In-process runs take seconds (one rank per role); the Ray test uses `ray_cluster`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from avrid.dispatch import Batch
from avrid.pipeline import make_trainer
from avrid.ppo.driver.step_graph import step_graph
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.task import Prompt
from avrid.results import Span
from avrid.workers import WorkerError
from tests.helpers import child_env
from tests.test_ppo_trainer import EchoFirstTask, algorithmic

pytestmark = pytest.mark.chapter(5)

ROOT = Path(__file__).resolve().parents[1]

CONCURRENT = "train.concurrent_phases=true"


def config(name: str, *sets: str, inprocess: bool = True) -> PPOConfig:
    """`name` cut to seconds: 2 steps of 4 prompts x 4 responses, the critic on its own pool."""
    where = (["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1"]
             if inprocess else ["placement.cpus_per_worker=0.5", "train.call_timeout_s=60"])
    return with_overrides(preset(name), [
        *where, "placement.colocate_critic=false", "train.steps=2", "train.prompts_per_step=4",
        "algo.responses_per_prompt=4", "train.mini_batch_size=8", "train.val_prompts=4",
        "train.progress=false", *sets])


def run(cfg: PPOConfig) -> tuple[list[dict], list[Batch], dict]:
    """`train.steps` steps of `cfg` (by its mode's trainer): the algorithmic metrics, each
    step's scored batch and the final weights."""
    rows, batches = [], []
    with make_trainer(cfg) as trainer:
        trainer.start()
        for step in range(cfg.train.steps):
            metrics, batch = trainer.train_step(step)
            metrics.pop("pipeline/overlap", None)  # a share of the step's time, not the algorithm
            rows.append(metrics)
            batches.append(batch)
        weights = trainer.state().weights
    return algorithmic(rows), batches, weights


def assert_same_batches(a: list[Batch], b: list[Batch]) -> None:
    for x, y in zip(a, b, strict=True):
        for name in ("sample_ids", "prompt_lens", "response_lens"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert list(x.packed) == list(y.packed) and list(x.scalars) == list(y.scalars)
        for name, col in x.packed.items():
            assert torch.equal(col.values, y.packed[name].values), name
            assert torch.equal(col.lengths, y.packed[name].lengths), name
        for name, col in x.scalars.items():
            assert torch.equal(col, y.scalars[name]), name


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for model in a:
        assert a[model].keys() == b[model].keys()
        for name in a[model]:
            assert torch.equal(a[model][name], b[model][name]), f"{model}.{name}"


def assert_concurrent_is_serial(cfg: PPOConfig, tmp_path: Path) -> None:
    serial = run(with_overrides(cfg, [f"train.out_dir={tmp_path / 'serial'}"]))
    concurrent = run(with_overrides(cfg, [CONCURRENT, f"train.out_dir={tmp_path / 'conc'}"]))
    assert concurrent[0] == serial[0]
    assert_same_batches(concurrent[1], serial[1])
    assert_same_weights(concurrent[2], serial[2])


# ---- bit for bit the serial run ----------------------------------------------------------------

CASES = {
    # reward | old_logp | values, then ref_logp, advantages, critic_update | actor_update;
    # step 0 is a critic warm-up step (no actor update).
    "ppo, kl in the reward, warm-up": ("tiny-ppo", "algo.kl_coef=0.05", "algo.kl_in=reward",
                                       "train.critic_warmup_steps=1"),
    # advantages beside the log-probs; resample generates and scores more rounds.
    "grpo, dynamic sampling, kl in the loss": ("tiny-grpo", "algo.dynamic_sampling=true",
                                               "algo.kl_coef=0.05"),
    "ppo, one-step-off": ("tiny-ppo", "pipeline.mode=one_step_off", "pipeline.rollout_dp=1"),
    "grpo, one-step-off": ("tiny-grpo", "pipeline.mode=one_step_off", "pipeline.rollout_dp=1"),
    # the reference is the actor with its adapters off: the same ranks, in the policy's order
    "ppo, lora, kl in the loss": ("tiny-ppo-lora", "algo.kl_coef=0.05"),
}


@pytest.mark.parametrize("case", CASES)
def test_concurrent_phases_give_the_serial_run_bit_for_bit(case: str, tmp_path: Path) -> None:
    name, *sets = CASES[case]
    assert_concurrent_is_serial(config(name, *sets), tmp_path)


def test_a_reward_model_beside_the_rule_reward_gives_the_serial_scores(tmp_path: Path) -> None:
    from tests.test_ppo_reward_model import save_reward_model

    rm = save_reward_model(tmp_path / "rm")
    assert_concurrent_is_serial(config("tiny-grpo", f"reward_model.path={rm}",
                                       "reward_model.rule_weight=0.5", "train.steps=1"),
                                tmp_path)


RAY_CASES = {
    "ppo, sync": ("tiny-ppo", "algo.kl_coef=0.05", "train.steps=1"),
    # a rollout pool of its own; step 1 trains on a batch one version stale
    "grpo, one-step-off": ("tiny-grpo", "pipeline.mode=one_step_off", "pipeline.rollout_dp=1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", RAY_CASES)
def test_concurrent_phases_give_the_serial_run_on_ray(case: str, tmp_path: Path,
                                                      ray_cluster: None) -> None:
    name, *sets = RAY_CASES[case]
    assert_concurrent_is_serial(config(name, *sets, inprocess=False), tmp_path)


# ---- the phases do run at once ----------------------------------------------------------------

def test_independent_phases_are_in_flight_together(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Each call of a pair waits at a barrier until the other of its pair has been issued too:
    # serially the first would wait alone until the barrier breaks; here both pass at once.
    import avrid.ppo.driver.concurrent as concurrent
    import avrid.ppo.driver.scoring as scoring

    first, updates = threading.Barrier(3, timeout=30), threading.Barrier(2, timeout=30)
    met: list[str] = []

    def run_shards(group, method, batch, *args, **kwargs):  # noqa: ANN001, ANN202
        if method in (CriticWorker.compute_values, PolicyWorker.compute_logprobs) and (
                not kwargs.get("reference")):
            first.wait()  # with rule_scores: reward | old_logp | values
            met.append(method.__name__)
        return real_run_shards(group, method, batch, *args, **kwargs)

    def rule_scores(reward, batch):  # noqa: ANN001, ANN202
        first.wait()
        met.append("reward")
        return real_rule_scores(reward, batch)

    def train_on(self, group, method, *args):  # noqa: ANN001, ANN202
        updates.wait()  # critic_update | actor_update
        met.append(method.__qualname__)
        return real_train_on(self, group, method, *args)

    real_run_shards, real_rule_scores = concurrent.run_shards, scoring.rule_scores
    real_train_on = Trainer.train_on
    monkeypatch.setattr(concurrent, "run_shards", run_shards)
    monkeypatch.setattr(scoring, "rule_scores", rule_scores)  # the trainer's `score` calls it
    monkeypatch.setattr(Trainer, "train_on", train_on)
    cfg = config("tiny-ppo", CONCURRENT, f"train.out_dir={tmp_path}")
    with Trainer(cfg) as trainer:
        trainer.start()
        metrics, _ = trainer.train_step(0)
    assert sorted(met[:3]) == ["compute_logprobs", "compute_values", "reward"]
    assert sorted(met[3:]) == ["CriticWorker.update", "PolicyWorker.update"]
    # The timeline stays drawable: the driver's side of each group's phases on a lane of its
    # own, every lane's spans nested or apart (what a trace viewer needs), the phases' times
    # those of the serial step.
    lanes = {lane.label: lane for lane in trainer.timeline.lanes}
    assert {"driver", "driver:policy", "driver:critic", "driver:reward"} <= set(lanes)
    for lane in lanes.values():
        assert nested_or_apart(lane.spans), lane.label
    assert {"old_logp", "values", "reward"} <= {s.name for s in lanes["driver"].spans} | {
        s.name for label in lanes if label.startswith("driver:") for s in lanes[label].spans}
    assert [k for k in metrics if k.startswith("time/")] == [
        *(f"time/{p.name}" for p in step_graph(cfg).phases if p.timed),
        "time/step", "time/compute", "time/overhead"]


def nested_or_apart(spans: tuple[Span, ...]) -> bool:
    """Whether every two of `spans` are nested or disjoint (no partial overlap)."""
    open_ends: list[float] = []
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        while open_ends and open_ends[-1] <= s.start:
            open_ends.pop()
        if open_ends and s.end > open_ends[-1]:
            return False
        open_ends.append(s.end)
    return True


# ---- a phase failing while others are in flight -----------------------------------------------

class FailingRewardTask(EchoFirstTask):
    """The echo task, but its reward function raises: the reward phase fails while the
    policy's log-probs and the critic's values are in flight."""

    def reward(self, prompt: Prompt, response: str) -> float:
        raise ValueError("this reward function fails on purpose")


def make_failing_reward_task() -> FailingRewardTask:
    return FailingRewardTask()


class HungTrainingRewardTask(EchoFirstTask):
    """The echo task with validation prompts of their own, whose reward function never
    returns for a training prompt: a run validates, then hangs in its first reward phase,
    while the policy's log-probs and the critic's values run beside it."""

    def val_prompts(self) -> list[Prompt]:
        return [Prompt(index=i, text=p.text, answer=p.answer, metadata={"val": True})
                for i, p in enumerate(self.train_prompts()[:3])]

    def reward(self, prompt: Prompt, response: str) -> float:
        if prompt.metadata.get("val"):
            return super().reward(prompt, response)
        if mark := os.environ.get("AVRID_TEST_HUNG_MARK"):
            Path(mark).touch()  # tells the test that the hang has begun
        time.sleep(3600)
        return 0.0


def make_hung_training_reward_task() -> HungTrainingRewardTask:
    return HungTrainingRewardTask()


def failure(cfg: PPOConfig) -> WorkerError:
    """The error step 0 of `cfg` ends with."""
    with pytest.raises(WorkerError) as err:  # noqa: PT012 - the error comes from the step
        with Trainer(cfg) as trainer:
            trainer.start()
            trainer.train_step(0)
    return err.value


@pytest.mark.parametrize("task, sets, headline", [
    ("tests.test_concurrent_phases:make_failing_reward_task", (),
     r"reward\[0\]\.score\(\) raised"),
    pytest.param("tests.test_ppo_failures:make_hung_task", ("train.call_timeout_s=2",),
                 r"reward\[0\]\.score\(\) timeout: ranks \[0\] still running after 2\.0 s",
                 marks=pytest.mark.slow),  # 2 s of timeout and 5 s of close grace, twice
], ids=["raises", "times out"])
def test_a_failing_phase_ends_the_step_with_the_serial_runs_error(
        task: str, sets: tuple[str, ...], headline: str, tmp_path: Path) -> None:
    cfg = config("tiny-ppo", f"task.name={task}", "task.options=", *sets,
                 f"train.out_dir={tmp_path}")
    serial = failure(cfg)
    concurrent = failure(with_overrides(cfg, [CONCURRENT]))
    assert concurrent.headline == serial.headline  # the command's one-line report
    assert str(concurrent).splitlines()[0] == str(serial).splitlines()[0]
    assert (concurrent.role, concurrent.rank, concurrent.method) == ("reward", 0, "score")
    assert re.match(headline, str(concurrent)), str(concurrent)


@pytest.mark.slow
def test_one_ctrl_c_stops_a_run_hung_in_a_phase_beside_others(tmp_path: Path) -> None:
    mark = tmp_path / "hung"
    proc = subprocess.Popen(
        [sys.executable, "-m", "avrid.cli", "ppo", "--backend", "inprocess", "--task",
         "tests.test_concurrent_phases:make_hung_training_reward_task", "--out",
         str(tmp_path / "run"), "--set", "train.progress=false", "--set", CONCURRENT],
        cwd=ROOT, env=child_env(AVRID_TEST_HUNG_MARK=str(mark)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
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


@pytest.mark.slow
def test_a_failing_phase_on_ray_leaks_no_worker(tmp_path: Path, ray_cluster: None) -> None:
    err = failure(config("tiny-ppo", "task.name=tests.test_concurrent_phases:"
                         "make_failing_reward_task", "task.options=", CONCURRENT,
                         f"train.out_dir={tmp_path}", inprocess=False))
    assert (err.role, err.method, err.reason) == ("reward", "score", "raised")
    # `ray_cluster` fails the test if an actor or a placement group is left alive.
