"""Chapter 6: the pipeline's guarantees on CPU. K = 0 is the synchronous run bit for bit;
one-step-off is exactly one version stale after its first batch; async, with a learner slow
enough, runs exactly K versions ahead and fills its queue, using every prompt once, and a
batch staler than K is refused even when the gate lets it through; a failing, dying or stale
rollout worker stops the run naming it, with nothing leaked, well before any call times out;
every mode runs from `avrid ppo`, generating while it trains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from avrid.pipeline import PipelinedTrainer, make_trainer
from avrid.pipeline.overlap import overlap_fraction, union
from avrid.pipeline.staleness import Rollout, RolloutQueue, StalenessError, StalenessGate
from avrid.pipeline.transfer import push_plan
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.reshard import StaleWeightsError
from avrid.workers import WorkerError
from tests.helpers import child_env, seconds_to_failure
from tests.pipeline_workers import (
    CorruptingRollout,
    DyingRollout,
    RaisingLearner,
    RaisingRollout,
)

pytestmark = pytest.mark.chapter(6)

ROOT = Path(__file__).resolve().parents[1]
MACHINE = ("time/", "perf/", "sync/", "pipeline/")
"""Keys that differ between the hybrid and the disaggregated loop by design: timings, the
sync's bytes (each rollout rank receives the whole model) and the pipeline's own metrics."""


def config(*extra: str, inprocess: bool = True, steps: int = 4) -> PPOConfig:
    """tiny-ppo cut to seconds: in-process (one rank per role) unless `inprocess=False`."""
    sets = ["train.progress=false", f"train.steps={steps}", "train.prompts_per_step=8",
            "algo.responses_per_prompt=4", "train.mini_batch_size=16", "train.val_prompts=16"]
    if inprocess:
        sets += ["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1"]
    else:
        sets += ["placement.cpus_per_worker=0.5", "train.call_timeout_s=60"]
    return with_overrides(preset("tiny-ppo"), [*sets, *extra])


def run_steps(cfg: PPOConfig, trainer_cls: type | None = None) -> tuple[list[dict], dict,
                                                                      Trainer]:
    """Validation, `train.steps` steps, validation (by `trainer_cls`, default: the mode's
    own); the metric rows, the final weights and the trainer."""
    rows = []
    make = trainer_cls or make_trainer
    with make(cfg) as tr:
        tr.start()
        rows.append(tr.validate())
        for step in range(cfg.train.steps):
            metrics, batch = tr.train_step(step)
            metrics["_sample_ids"] = batch.sample_ids.tolist()
            rows.append(metrics)
        rows.append(tr.validate())
        weights = tr.state().weights
    return rows, weights, tr


def initial_weights(cfg: PPOConfig) -> dict:
    """The weights a run of `cfg` starts from (the trainer started, no step taken)."""
    with Trainer(cfg) as tr:
        tr.start()
        return tr.state().weights


def algorithmic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MACHINE)} for r in rows]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[m][n], b[m][n]) for m in a for n in a[m])


# ---- K = 0 is the synchronous algorithm ------------------------------------------------------

@pytest.mark.parametrize("extra", [("train.critic_warmup_steps=1",), ("algo.name=grpo",)],
                         ids=["ppo-warmup", "grpo"])
def test_k0_is_the_sync_run_bit_for_bit_in_process(extra: tuple[str, ...]) -> None:
    sync_rows, sync_w, _ = run_steps(config(*extra))
    k0_rows, k0_w, tr = run_steps(config(*extra, "pipeline.mode=async",
                                         "pipeline.max_staleness=0", "pipeline.rollout_dp=1"))
    assert isinstance(tr, PipelinedTrainer)
    assert algorithmic(k0_rows) == algorithmic(sync_rows)
    assert same_weights(k0_w, sync_w)
    assert [r["pipeline/staleness_max"] for r in k0_rows[1:-1]] == [0.0] * 4


@pytest.mark.slow
# Quiet, 40 s (+10 s of cluster start-up); beside two busy loops on a slow day it ran past
# the 180 s default (2026-11-28): the limit catches hangs, not a loaded machine.
@pytest.mark.timeout(400)
def test_k0_is_the_sync_run_bit_for_bit_on_ray_over_two_pools(ray_cluster: None) -> None:
    # Three steps (two that move the actor), not four: the in-process test above runs four,
    # and this one's worker processes took 144 s beside two busy loops (stop 48).
    sync_rows, sync_w, _ = run_steps(config("train.critic_warmup_steps=1", inprocess=False,
                                            steps=3))
    k0_rows, k0_w, tr = run_steps(config("train.critic_warmup_steps=1", "pipeline.mode=async",
                                         "pipeline.max_staleness=0", inprocess=False, steps=3))
    assert tr.rollout.world_size == 2 and tr.policy.world_size == 2
    assert algorithmic(k0_rows) == algorithmic(sync_rows)
    assert same_weights(k0_w, sync_w)
    # Each push moves the lower bound: every rollout rank receives the whole model.
    plan = tr.push_plan
    assert plan.bytes_moved == plan.lower_bound == 2 * sum(
        t.numel() * t.element_size() for t in k0_w["actor"].values())


# ---- one-step-off and async ------------------------------------------------------------------

def test_one_step_off_with_weights_that_never_move_is_the_sync_run() -> None:
    # With a learning rate of 1e-50 no fp32 weight moves: AdamW's step is about lr per
    # update, and 1e-50 is below the smallest fp32 number (1.4e-45), so it rounds to 0. (At
    # 1e-30 the zero-initialised biases did move, by up to 7.6e-30 over these 4 steps: next
    # to 0, fp32 holds such a step.) So version s - 1 holds exactly the weights of version s
    # (checked): staleness then changes nothing, and any difference would be the pipeline's
    # own (a prompt paired with another step's responses, a wrong seed, a sample lost or
    # repeated).
    frozen = ("train.actor_lr=1e-50", "train.critic_lr=1e-50", "pipeline.correction=none")
    sync_rows, sync_w, _ = run_steps(config(*frozen))
    assert same_weights(sync_w, initial_weights(config(*frozen)))
    off_rows, off_w, _ = run_steps(config(*frozen, "pipeline.mode=one_step_off",
                                          "pipeline.rollout_dp=1"))
    assert algorithmic(off_rows) == algorithmic(sync_rows)
    assert same_weights(off_w, sync_w)
    assert [r["pipeline/staleness_max"] for r in off_rows[1:-1]] == [0.0, 1.0, 1.0, 1.0]


def test_one_step_off_is_stale_by_exactly_one_after_the_first_batch() -> None:
    rows, _, tr = run_steps(config("pipeline.mode=one_step_off", "pipeline.rollout_dp=1",
                                   steps=5))
    steps = rows[1:-1]
    assert [r["pipeline/staleness_max"] for r in steps] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r["pipeline/staleness_mean"] for r in steps] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r["pipeline/version"] for r in steps] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(tr.queue) == 0 and tr.next_gen == 5  # each step's batch made once, none more


class SlowLearner(PipelinedTrainer):
    """The slowest learner there can be: before it learns, every generation the pipeline
    admits has finished and is queued (it waits for each, then asks for the next, until the
    gate or the full queue refuses one). Generation then runs as far ahead as K allows, at
    every step, whatever the machine's speed: the versions are exact, not timing-dependent."""

    def learn(self, step, batch, phases):  # noqa: ANN001, ANN201
        while True:
            while self._inflight is not None:
                self._collect()
            self._pump()
            if self._inflight is None:  # refused: as far ahead as allowed
                break
        return super().learn(step, batch, phases)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_async_with_a_slow_learner_runs_k_ahead_and_uses_every_prompt_once(k: int) -> None:
    cfg = config("pipeline.mode=async", f"pipeline.max_staleness={k}", "pipeline.rollout_dp=1",
                 steps=6)
    rows, _, tr = run_steps(cfg, SlowLearner)
    steps = rows[1:-1]
    # Step s trains at version s on a batch made with version max(0, s - K): generation ran
    # exactly K versions ahead once it could, and the queue filled up to its K batches.
    expected = [float(min(step, k)) for step in range(6)]
    assert [r["pipeline/staleness_max"] for r in steps] == expected
    assert [r["pipeline/staleness_mean"] for r in steps] == expected
    assert tr.queue.high_water == k and len(tr.queue) == 0
    # Every step trained on exactly its own prompts, each sample once.
    with Trainer(config(steps=6)) as sync:
        for step, row in enumerate(steps):
            assert row["_sample_ids"] == sorted(sync.step_prompts(step).sample_ids.tolist())


class OpenGate(StalenessGate):
    """A broken gate: it admits any batch the queue has room for, however stale."""

    def admits(self, *, step: int, rollout_version: int, queued: int) -> bool:
        return queued < self.capacity


class WithOpenGate(SlowLearner):
    """K = 1 with the open gate and a queue of 3: steps 1-3 are all made with version 0."""

    def __init__(self, config: PPOConfig) -> None:
        super().__init__(config)
        self.gate = OpenGate(max_staleness=1, capacity=3)
        self.queue = RolloutQueue(3)


def test_a_batch_staler_than_k_is_refused_even_if_the_gate_admits_it() -> None:
    cfg = config("pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.rollout_dp=1")
    with pytest.raises(StalenessError, match="step 2's batch is 2 versions old; the bound is 1"):
        run_steps(cfg, WithOpenGate)


# ---- the pieces -----------------------------------------------------------------------------

def test_the_gate_admits_by_version_and_room() -> None:
    gate = StalenessGate(max_staleness=2, capacity=2, warmup_steps=1)
    assert [gate.version_at(s) for s in range(4)] == [0, 0, 1, 2]
    assert gate.admits(step=3, rollout_version=0, queued=1)       # 2 - 0 <= 2
    assert not gate.admits(step=4, rollout_version=0, queued=1)   # 3 - 0 > 2
    assert not gate.admits(step=3, rollout_version=0, queued=2)   # no room
    with pytest.raises(ValueError, match="capacity >= 1"):
        StalenessGate(max_staleness=0, capacity=0)


def test_the_queue_refuses_rather_than_drops() -> None:
    q = RolloutQueue(2)
    q.put(Rollout(step=1, version=0, batch=None, generation=None))
    with pytest.raises(StalenessError, match="generated twice"):
        q.put(Rollout(step=1, version=0, batch=None, generation=None))
    q.put(Rollout(step=2, version=0, batch=None, generation=None))
    with pytest.raises(StalenessError, match="full"):
        q.put(Rollout(step=3, version=1, batch=None, generation=None))
    with pytest.raises(StalenessError, match="taken before step 1"):
        q.take(2)
    assert q.take(1).step == 1 and len(q) == 1 and q.high_water == 2
    with pytest.raises(StalenessError, match="not in the queue"):
        q.take(5)


def test_overlap_is_the_shared_time_over_the_window() -> None:
    assert union([(0, 1), (0.5, 2), (3, 4)]) == [(0, 2), (3, 4)]
    # generation 0-4, training 2-6 in a 0-8 window: both ran 2-4, a quarter.
    assert overlap_fraction([(0, 4)], [(2, 3), (2.5, 6)], (0, 8)) == 0.25
    assert overlap_fraction([(0, 1)], [(1, 2)], (0, 2)) == 0.0
    assert overlap_fraction([(0, 1)], [(0, 1)], (5, 5)) == 0.0


def test_the_push_plan_moves_the_lower_bound_from_fsdp_shards() -> None:
    shapes = {"a": ((5, 3), "float32"), "b": ((7,), "float32")}
    plan = push_plan(shapes, trainers=3, rollouts=2, engine_dtype="bfloat16")
    assert plan.bytes_moved == plan.lower_bound == 2 * (15 + 7) * 2
    assert plan.bytes_to(0) == plan.bytes_to(1) == (15 + 7) * 2  # each engine: the model
    assert plan.bytes_local == 0  # disaggregated: nothing is already in place
    assert {t.src_rank for t in plan.transfers} == {0, 1, 2}


@pytest.mark.parametrize(("sets", "field"), [
    (["pipeline.mode=one_step_off", "pipeline.max_staleness=2"], "pipeline.max_staleness"),
    (["pipeline.max_staleness=1"], "pipeline.max_staleness"),
    (["pipeline.mode=async", "pipeline.max_staleness=-1"], "pipeline.max_staleness"),
    (["pipeline.rollout_dp=2"], "pipeline.rollout_dp"),
    (["pipeline.mode=async", "pipeline.rollout_dp=0"], "pipeline.rollout_dp"),
    (["pipeline.mode=bogus"], "pipeline.mode"),
    (["pipeline.correction=is"], "pipeline.correction"),
    (["pipeline.is_cap=0.5"], "pipeline.is_cap"),
    (["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
      "pipeline.mode=async", "pipeline.rollout_dp=2"], "pipeline.rollout_dp"),
])
def test_bad_pipeline_config_names_the_field(sets: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=f"config field '{field}'"):
        with_overrides(preset("tiny-ppo"), sets)


def test_auto_corrects_exactly_where_batches_can_be_stale() -> None:
    applied = {sets: with_overrides(preset("tiny-ppo"), list(sets)).pipeline.applied_correction
               for sets in [(), ("pipeline.mode=one_step_off",),
                            ("pipeline.mode=async", "pipeline.max_staleness=0"),
                            ("pipeline.mode=async",),
                            ("pipeline.mode=one_step_off", "pipeline.correction=none"),
                            ("pipeline.correction=decoupled",)]}
    assert list(applied.values()) == ["none", "tis", "none", "tis", "none", "decoupled"]


def test_the_sync_trainer_refuses_another_mode() -> None:
    with pytest.raises(ValueError, match="PipelinedTrainer"):
        Trainer(config("pipeline.mode=one_step_off", "pipeline.rollout_dp=1"))
    with pytest.raises(ValueError, match="synchronous loop is avrid.ppo's Trainer"):
        PipelinedTrainer(config())


# ---- failures -------------------------------------------------------------------------------

class WithRaisingRollout(PipelinedTrainer):
    rollout_worker = RaisingRollout


class WithDyingRollout(PipelinedTrainer):
    rollout_worker = DyingRollout


class WithCorruptingRollout(PipelinedTrainer):
    rollout_worker = CorruptingRollout


class WithRaisingLearner(PipelinedTrainer):
    policy_worker = RaisingLearner


@pytest.mark.slow
@pytest.mark.parametrize(("trainer_cls", "match"), [
    (WithRaisingRollout, r"(?s)rollout\[0\]\.generate\(\).*injected rollout failure"),
    (WithDyingRollout, r"rollout\[1\]\.generate\(\) died"),
])
def test_a_failing_rollout_worker_stops_the_run_naming_it(trainer_cls: type, match: str,
                                                          ray_cluster: None) -> None:
    cfg = config("pipeline.mode=one_step_off", inprocess=False, steps=4)
    # The third generate call fails (step 1's batch, made while step 0 trains): the error is
    # the failure itself, reported within at most two steps, before any call could have
    # timed out (train.call_timeout_s: what a lost failure would cost).
    seconds = seconds_to_failure(cfg, trainer_cls, match, validate_first=True)
    assert seconds < cfg.train.call_timeout_s


@pytest.mark.slow
def test_a_failing_learner_stops_the_run_while_a_generation_is_in_flight(
        ray_cluster: None) -> None:
    cfg = config("pipeline.mode=one_step_off", inprocess=False, steps=4)
    seconds = seconds_to_failure(cfg, WithRaisingLearner,
                                 r"(?s)policy\[\d\]\.update\(\).*injected learner",
                                 validate_first=True)
    assert seconds < cfg.train.call_timeout_s  # step 1's update: two steps, no timeout


@pytest.mark.slow
def test_a_rollout_engine_that_loads_wrong_weights_is_named(ray_cluster: None) -> None:
    cfg = config("pipeline.mode=one_step_off", inprocess=False, steps=3)
    with pytest.raises(StaleWeightsError, match=r"rollout engine of rollout rank \d"):
        run_steps(cfg, WithCorruptingRollout)


def test_a_failing_rollout_worker_in_process_is_named_too() -> None:
    cfg = config("pipeline.mode=async", "pipeline.rollout_dp=1")
    with pytest.raises(WorkerError, match=r"(?s)rollout\[0\]\.generate\(\).*injected"):
        run_steps(cfg, WithRaisingRollout)


# ---- the command ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_the_command_runs_every_mode(mode: str, tmp_path: Path) -> None:
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-m", "avrid.cli", "ppo", "--backend", "inprocess", "--steps", "3",
         "--out", str(tmp_path), "--set", f"pipeline.mode={mode}",
         "--set", "pipeline.rollout_dp=1", "--set", "train.prompts_per_step=8",
         "--set", "train.progress=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    overlap = [r["pipeline/overlap"] for r in rows if "pipeline/staleness_max" in r]
    assert len(overlap) == 3
    # Step 0 trains while step 1's batch generates (launched before the learning, in both
    # modes): they overlap. The last step has nothing left to generate (its batch was made
    # before it trained): nothing overlaps it. One-step-off overlaps every step but the last;
    # async may have made every batch by then (K = 2: step 1's and step 2's during step 0).
    assert overlap[0] > 0 and overlap[-1] == 0.0
    if mode == "one_step_off":
        assert overlap[1] > 0
