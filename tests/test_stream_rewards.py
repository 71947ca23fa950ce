"""`rollout.stream_rewards` (`avrid/ppo/driver/reward_stream.py`, `roles/streaming.py`): each
response is scored as soon as the engine finishes it, while the step still generates.

What must hold: the same seed gives the serial run bit for bit — every algorithmic metric
(reward/score and a reward function's own extras included), every column of every batch,
the final weights — for GRPO with dynamic sampling, PPO with the concurrent controller and
a reward model beside the rule reward, in process and on Ray with two policy ranks; the
reward worker does score while the engine generates; a reward function that raises or hangs
ends the step with the serial run's one-line errors; the torch engine tells each response
once, as it stops, identical to what it returns; with the vLLM engine (`vllm` tier) the run
is the serial one too, scored while it generates. Chapter 7's episodes need no setting: the
environment gives each episode's reward at its last step, while the engine generates the
others (pinned here too).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from avrid.agents.env import EpisodeLimits, StepResult
from avrid.agents.episodes import run_episodes
from avrid.agents.worker import AgentPolicyWorker
from avrid.ppo.driver.reward_stream import streaming_worker
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.engines.torch_engine import Completion, SamplingParams, TorchEngine
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.roles.streaming import FinishedResponses, StreamingPolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.workers import WorkerError
from tests.test_agents_episodes import IdTokenizer, ScriptedEnv
from tests.test_concurrent_phases import assert_same_batches, assert_same_weights, config, run

pytestmark = pytest.mark.chapter(5)

STREAM = "rollout.stream_rewards=true"
GRADED = "task.reward=tests.test_stream_rewards:graded"


def graded(prompt: str, response: str, answer: str, **metadata: object) -> dict:
    """A reward with fractions and an extra (`reward/length`), so that a metric summed in
    another order than the serial one would show. `AVRID_TEST_REWARD` = "raise" or "hang"
    breaks it on training prompts (validation is not streamed)."""
    broken = os.environ.get("AVRID_TEST_REWARD", "")
    if broken == "raise":
        raise ValueError("graded: broken on purpose")
    if broken == "hang":
        time.sleep(600)
    right = sum(a == r for a, r in zip(answer, response, strict=False))
    return {"score": right / 3 + len(response) / 7, "length": float(len(response))}


def assert_streamed_is_serial(cfg: PPOConfig, tmp_path: Path) -> None:
    serial = run(with_overrides(cfg, [f"train.out_dir={tmp_path / 'serial'}"]))
    streamed = run(with_overrides(cfg, [STREAM, f"train.out_dir={tmp_path / 'stream'}"]))
    assert streamed[0] == serial[0]
    assert "reward/length" in serial[0][0]
    assert_same_batches(streamed[1], serial[1])
    assert_same_weights(streamed[2], serial[2])


# ---- bit for bit the serial run ----------------------------------------------------------------

CASES = {
    # every round of dynamic sampling is generated, so streamed, and scored
    "grpo, dynamic sampling": ("tiny-grpo", "algo.dynamic_sampling=true"),
    # the reward phase issued beside old_logp and values
    "ppo, concurrent phases, kl": ("tiny-ppo", "train.concurrent_phases=true",
                                   "algo.kl_coef=0.05"),
}


@pytest.mark.parametrize("case", CASES)
def test_streamed_rewards_give_the_serial_run_bit_for_bit(case: str, tmp_path: Path) -> None:
    name, *sets = CASES[case]
    assert_streamed_is_serial(config(name, GRADED, "rollout.max_response_tokens=12", *sets),
                              tmp_path)


def test_a_reward_model_beside_the_streamed_rule_reward_gives_the_serial_scores(
        tmp_path: Path) -> None:
    from tests.test_ppo_reward_model import save_reward_model

    rm = save_reward_model(tmp_path / "rm")
    assert_streamed_is_serial(config("tiny-grpo", GRADED, f"reward_model.path={rm}",
                                     "reward_model.rule_weight=0.5", "train.steps=1",
                                     "train.concurrent_phases=true"), tmp_path)


@pytest.mark.slow
def test_streamed_rewards_give_the_serial_run_on_ray_with_two_policy_ranks(
        tmp_path: Path, ray_cluster: None) -> None:
    assert_streamed_is_serial(config("tiny-grpo", GRADED, "train.steps=1",
                                     "placement.actor_dp=2", inprocess=False), tmp_path)


# ---- the reward worker works while the engine generates ----------------------------------------

def test_the_reward_worker_scores_while_the_engine_still_generates(tmp_path: Path) -> None:
    cfg = config("tiny-grpo", STREAM, "train.steps=1", "rollout.max_response_tokens=24",
                 f"train.out_dir={tmp_path}")
    with Trainer(cfg) as trainer:
        trainer.start()
        _, batch = trainer.train_step(0)
        lanes = {lane.label: lane.spans for lane in trainer.timeline.lanes}
    assert len(set(batch.response_lens.tolist())) > 1  # responses end at different steps
    generated = next(s for s in lanes["policy[0]"] if s.name == "generate")
    scored = [s for s in lanes["reward[0]"] if s.name == "reward"]
    assert len(scored) > 1  # a call per handful of finished responses, not one at the end
    assert scored[0].end < generated.end  # ... the first scored before the engine was done
    phase = next(s for s in lanes["driver"] if s.name == "reward")
    assert phase.start >= generated.end  # the step's reward phase: only what was left


@pytest.mark.vllm
def test_the_vllm_engine_streams_too_bit_for_bit(tmp_path: Path) -> None:
    """`tiny-ppo-vllm` in process: vLLM's engine is stepped by `VllmEngine.generate` itself
    (`engines/vllm_stream.py`), so its responses are scored while it generates, and the run
    is the serial one bit for bit."""
    cfg = config("tiny-ppo-vllm", GRADED, "rollout.max_response_tokens=24")
    assert_streamed_is_serial(cfg, tmp_path)
    with Trainer(with_overrides(cfg, [STREAM, "train.steps=1",
                                      f"train.out_dir={tmp_path / 'timed'}"])) as trainer:
        trainer.start()
        _, batch = trainer.train_step(0)
        lanes = {lane.label: lane.spans for lane in trainer.timeline.lanes}
    assert len(set(batch.response_lens.tolist())) > 1
    generated = next(s for s in lanes["policy[0]"] if s.name == "generate")
    scored = [s for s in lanes["reward[0]"] if s.name == "reward"]
    assert len(scored) > 1 and scored[0].end < generated.end


def test_the_streaming_policy_rank_is_chosen_only_for_chapter_5s_own() -> None:
    on = with_overrides(preset("tiny-grpo"), [STREAM])
    assert streaming_worker(on, PolicyWorker) is StreamingPolicyWorker
    assert streaming_worker(preset("tiny-grpo"), PolicyWorker) is PolicyWorker
    # chapter 7's environments score each episode as it ends: their worker stays theirs
    assert streaming_worker(on, AgentPolicyWorker) is AgentPolicyWorker
    # a reward model alone (rule_weight=0): no rule reward, nothing to stream
    rm_only = with_overrides(on, ["reward_model.path=/nowhere", "reward_model.rule_weight=0"])
    assert streaming_worker(rm_only, PolicyWorker) is PolicyWorker


def test_streamed_rewards_in_a_pipelined_mode_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"config field 'rollout\.stream_rewards'.*"
                                         r"pipeline\.mode='one_step_off'"):
        with_overrides(preset("tiny-ppo"), [STREAM, "pipeline.mode=one_step_off"])


# ---- failures: the serial run's errors ---------------------------------------------------------

@pytest.mark.parametrize("broken", ["raise", "hang"])
def test_a_broken_reward_function_ends_a_streamed_step_as_a_serial_one(
        broken: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config("tiny-grpo", STREAM, GRADED, "train.steps=1", "train.call_timeout_s=3",
                 f"train.out_dir={tmp_path}")
    expected = (r"reward\[0\]\.score\(\) raised: ValueError: .*graded: broken on purpose"
                if broken == "raise" else
                r"reward\[0\]\.score\(\) timeout: ranks \[0\] still running after 3\.0 s")
    started = time.monotonic()
    with Trainer(cfg) as trainer:
        trainer.start()
        monkeypatch.setenv("AVRID_TEST_REWARD", broken)  # in-process: the workers see it
        with pytest.raises(WorkerError) as failed:
            trainer.train_step(0)
    assert failed.value.role == "reward" and failed.value.method == "score"
    assert len(failed.value.headline.splitlines()) == 1
    assert re.search(expected, failed.value.headline), failed.value.headline
    assert time.monotonic() - started < 60


# ---- the engine's side, and the hand-over between two lanes ------------------------------------

def test_the_torch_engine_tells_each_response_once_as_it_stops() -> None:
    model = build_tiny_policy(TinyModelSpec(vocab_size=12), seed=0)
    engine = TorchEngine(model, pad_token_id=0, batch_size=5)  # two batches: indices carry on
    prompts = [[3, 4, 5], [6], [7, 8], [9, 10, 11], [4], [5, 6], [7]]
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(1, 2, 3), seed=7)
    told: list[tuple[int, Completion]] = []
    done = engine.generate(prompts, params, lambda i, c: told.append((i, c)))
    assert done == engine.generate(prompts, params)  # telling changes nothing drawn
    assert sorted(i for i, _ in told) == list(range(len(prompts)))  # each once
    assert all(done[i] == c for i, c in told)
    first_batch = [c for i, c in told if i < 5]
    lengths = [len(c.token_ids) for c in first_batch]
    assert lengths == sorted(lengths)  # in the order they ended
    assert len(set(lengths)) > 1 and first_batch[0].finish_reason == "stop"


def test_finished_responses_go_to_the_asking_lane_as_they_come() -> None:
    q = FinishedResponses()
    t = time.monotonic()
    early = q.take(0, wait_s=0.05)  # asked before the generate call began: waits, then none
    assert (early.sample_ids, early.last) == ((), False) and time.monotonic() - t >= 0.04
    q.put(0, 5, (1, 2))
    q.put(0, 3, (4,))
    got = q.take(0, wait_s=10)  # something is there: at once
    assert (got.sample_ids, got.responses, got.last) == ((5, 3), ((1, 2), (4,)), False)
    q.put(0, 8, ())
    q.end(0)
    last = q.take(0, wait_s=10)
    assert (last.sample_ids, last.last) == ((8,), True)


# ---- chapter 7: an episode is scored when it ends -----------------------------------------------

class TimedEngine:
    """`TorchEngine`, timing each generate call."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine, self.calls = engine, []

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Completion]:
        start = time.monotonic()
        out = self.engine.generate(prompts, params)
        self.calls.append((start, time.monotonic()))
        return out


class ScoredEnv(ScriptedEnv):
    """`ScriptedEnv` noting when it gave its reward (its last step)."""

    scored_at: float | None = None

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        result = super().step(action_ids, action_text)
        if result.done:
            self.scored_at = time.monotonic()
        return result


def test_an_episode_is_scored_when_it_ends_while_the_engine_serves_the_others() -> None:
    engine = TimedEngine(TorchEngine(build_tiny_policy(TinyModelSpec(vocab_size=24), seed=0),
                                     pad_token_id=0))
    short = ScoredEnv([5, 6], [], turns=1)
    long = ScoredEnv([7, 8], [[9], [10], [11]], turns=4, delay_s=0.02)
    limits = EpisodeLimits(max_turns=4, turn_tokens=3, max_tokens=30)
    trajs, _ = run_episodes(engine, [short, long], tokenizer=IdTokenizer(), limits=limits,
                            params=SamplingParams(max_new_tokens=1, stop_token_ids=(1, 23),
                                                  seed=0))
    assert trajs[0].reward == 1.0 and trajs[1].reward == 4.0
    assert len(engine.calls) >= 3 and short.scored_at is not None
    assert short.scored_at < engine.calls[-1][0]  # before the engine's last call began
