"""Chapter 7's laptop task and trainer: tool-call parsing, the bounded calculator, the
calculator environment's reward, and whole multi-turn training steps through `AgentTrainer`
(the batch keeps the episode's exact ids with an action mask; the environment scores it)."""

from __future__ import annotations

import pytest
import torch

from avrid.agents import AgentTrainer, make_trainer
from avrid.agents.calc import ALPHABET, CalcTask
from avrid.agents.tools import calculator, parse_call
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.task import Prompt
from avrid.ppo.setup.tokenizer import CharTokenizer

pytestmark = pytest.mark.chapter(7)


@pytest.mark.parametrize("text, call", [
    ("[48*7]", "48*7"), ("answer [1+2]", "1+2"), ("[a][b]", "b"), ("336", None),
    ("48*7]", None), ("[48*7", None), ("[]", ""),
])
def test_a_call_is_what_closes_the_turn(text: str, call: str | None) -> None:
    assert parse_call(text) == call


@pytest.mark.parametrize("expression, status, output", [
    ("48*7", "ok", "336"), ("(2+3)*4-1", "ok", "19"), ("7//2", "ok", "3"), ("-5%3", "ok", "1"),
    ("2**10", "ok", "1024"), ("1/0", "error", None), ("7//0", "error", "ZeroDivisionError"),
    ("__import__('os')", "error", "not integer arithmetic"), ("1.5*2", "error", None),
    ("9**9**9", "error", "out of range"), ("10**70", "error", None), ("48*", "error", None),
])
def test_the_calculator_accepts_integer_arithmetic_only(expression: str, status: str,
                                                       output: str | None) -> None:
    result = calculator(expression)
    assert result.status == status
    if output is not None:
        assert output in result.output
    assert result.seconds < 1.0


def test_the_shaped_reward_credits_the_first_call_not_a_later_one() -> None:
    # "48*7=": a right call then a wrong one scores the call's half in full; a wrong call
    # then a right one scores the wrong call's credit ("12*3" holds only "*" of "48*7": 1/4).
    task = CalcTask(call_weight=0.5)
    prompt = Prompt(index=0, text="48*7=", answer="336")
    for calls, want in ((["[48*7]", "[12*3]"], 0.5 + 0.5 * 1.0),
                        (["[12*3]", "[48*7]"], 0.5 + 0.5 * 0.25)):
        env = task.make_env(prompt)
        env.reset()
        for call in calls:
            assert not env.step([], call).done
        end = env.step([], "336")  # the right answer
        assert end.done and end.reward == pytest.approx(want), calls


def test_calc_episodes_score_the_answer_and_the_call() -> None:
    task = CalcTask(call_weight=0.5, hint=True)
    tok = CharTokenizer(task.alphabet)
    train, val = task.train_prompts(), task.val_prompts()
    assert len(val) == 30 and not {p.text for p in train} & {p.text for p in val}
    p = train[0]
    expression = p.text.split("=")[0]
    env = task.make_env(p)
    assert env.reset() == p.text and p.text.endswith("=[")  # the hint opens the first call
    step = env.step(tok.encode(expression + "]"), expression + "]")
    assert (step.observation, step.done, step.tool_calls, step.tool_errors) == \
        (p.answer + ";", False, 1, 0)
    assert env.step([], p.answer).reward == 1.0  # right call, right answer
    env = task.make_env(p)
    env.reset()
    bad = env.step([], "4**]")  # not arithmetic: answered within the alphabet
    assert bad.observation == "=;" and bad.tool_errors == 1
    assert all(ch in ALPHABET for ch in bad.observation)
    end = env.step([], p.answer)
    assert end.done and 0.5 <= end.reward < 1.0  # the answer's half, part of the call's
    q = CalcTask().train_prompts()[0]
    plain = CalcTask().make_env(q)  # no shaping, no hint: the digit credit alone
    assert plain.reset() == q.text and q.text.endswith("=")
    assert plain.step([], q.answer).reward == 1.0


@pytest.mark.parametrize("options, match", [
    ({"digits": 0}, "digits"), ({"call_weight": 1.0}, "call_weight"), ({"num_val": 0}, "num_val"),
])
def test_bad_calc_options_are_refused_by_name(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CalcTask(**options)


def agent_config(*overrides: str) -> PPOConfig:
    return with_overrides(preset("tiny-agent"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.prompts_per_step=4", "algo.responses_per_prompt=4", "train.mini_batch_size=16",
        "train.val_prompts=8", *overrides])


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_agent_trainer_trains_on_the_episodes_ids_with_the_action_mask(algo: str) -> None:
    with AgentTrainer(agent_config(f"algo.name={algo}")) as trainer:
        trainer.start()
        for step in range(2):
            metrics, batch = trainer.train_step(step)
        val = trainer.validate()
    mask = batch.packed["action_mask"]
    assert torch.equal(mask.lengths, batch.response_lens)
    assert set(mask.values.tolist()) <= {0, 1} and int(mask.values.sum()) > 0
    versions = batch.packed["token_version"]
    # The policy's tokens of step 1 were generated by the weights after one update.
    assert set(versions.values[mask.values == 1].tolist()) == {1}
    assert set(versions.values[mask.values == 0].tolist()) <= {-1}
    for name in ("agent/turns", "agent/tool_calls", "agent/tool_errors", "agent/tool_s",
                 "agent/action_share", "train/reward", "rollout/logprob_gap_max"):
        assert torch.isfinite(torch.tensor(metrics[name])), name
    # The environment's scores are the batch's; the engine's log-probs = the trainer's.
    assert batch.scalars["score"].min() >= 0 and batch.scalars["score"].max() <= 1
    assert metrics["rollout/logprob_gap_max"] < 1e-4
    assert {"val/reward", "val/tool_calls", "val/turns"} <= set(val)


def test_make_trainer_picks_the_trainer_by_task() -> None:
    assert type(make_trainer(agent_config())) is AgentTrainer
    digits = with_overrides(PPOConfig(), ["placement.backend=inprocess", "placement.actor_dp=1",
                                          "placement.critic_dp=1"])
    assert type(make_trainer(digits)) is Trainer
    with pytest.raises(ValueError, match="single-turn"):
        AgentTrainer(digits)
    with pytest.raises(ValueError, match="AgentPipelinedTrainer"):
        AgentTrainer(agent_config("pipeline.mode=one_step_off", "pipeline.rollout_dp=1"))


def test_a_reward_function_beside_a_multi_turn_task_is_refused() -> None:
    # The environments give an episode's reward; a task.reward would never be called.
    config = agent_config("task.reward=avrid.ppo.setup.task:check_reward")
    with pytest.raises(ValueError, match=r"config field 'task.reward': task "
                                         r"'avrid.agents.calc:make_task' is multi-turn"):
        AgentTrainer(config)
