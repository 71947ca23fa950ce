"""Chapter 7 — multi-turn agent rollouts: environments, tools, token-in/token-out trajectories,
per-trajectory scheduling, on top of chapters 5 and 6.

Read in this order:

1. sandbox/        a tool call's code run where it cannot reach the host (kernel
                    namespaces by default), under limits; its outcome as an observation
2. tools.py         a tool call found at the end of a turn; the calculator and Python tools
3. env.py           the environment protocol: reset, step -> observation, reward, done
4. trajectory.py    an episode in tokens: ids, action mask, behaviour log-prob, version
5. episodes.py      the episode loop: many episodes over one engine, each at its own pace
                    (steps on step_pool.py's daemon threads: a time limit, fail fast)
6. calc.py          the laptop task: multiply with a calculator tool
7. worker.py        multi-turn rollouts on a policy rank (chapter 5's worker, one method)
8. trainer.py       chapter 5's loop on episodes: no reward call, episode metrics
9. partial.py       partial rollouts: weights pushed mid-generation load between engine calls
10. pipelined.py    the same in chapter 6's modes: a rollout pool running episodes
11. gsm8k_tool.py   the real-model recipe: GSM8K with a Python tool (Qwen's tool markers)

`make_trainer` picks the trainer for a config, `train` is what ``avrid ppo`` calls.

Research behind the chapter: `docs/agents-vllm-cpu.md` (what vLLM's engine does for
per-trajectory scheduling and weight updates mid-rollout).
"""

from collections.abc import Callable

from avrid.agents.env import is_agent_task
from avrid.agents.pipelined import AgentPipelinedTrainer
from avrid.agents.trainer import AgentTrainer
from avrid.agents.worker import agent_task
from avrid.pipeline import make_trainer as pipeline_trainer
from avrid.ppo.driver.run import RunSummary
from avrid.ppo.driver.run import train as run_train
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.config import PPOConfig


def make_trainer(config: PPOConfig) -> Trainer:
    """The trainer for `config`: a multi-turn task (`env.is_agent_task`) runs episodes,
    synchronously (`AgentTrainer`) or in chapter 6's modes (`AgentPipelinedTrainer`); any
    other task gets chapter 6's choice (`avrid.pipeline.make_trainer`)."""
    if not is_agent_task(agent_task(config)):
        return pipeline_trainer(config)
    return AgentPipelinedTrainer(config) if config.pipeline.disaggregated else \
        AgentTrainer(config)


def train(config: PPOConfig, *, log: Callable[[str], None] | None = None) -> RunSummary:
    """`avrid.ppo.driver.run.train` with `make_trainer` (what ``avrid ppo`` calls)."""
    return run_train(config, log=log, make_trainer=make_trainer)


__all__ = ["AgentPipelinedTrainer", "AgentTrainer", "make_trainer", "train"]
