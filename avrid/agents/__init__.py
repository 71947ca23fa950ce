"""Chapter 7 — multi-turn agent rollouts: environments, tools, token-in/token-out trajectories,
per-trajectory scheduling, on top of chapters 5 and 6.

Read in this order:

1. sandbox.py       a tool call's code run in a child process under limits (wall time,
                    memory, disk, no network, no processes); its outcome as an observation
2. tools.py         a tool call found at the end of a turn; the calculator and Python tools
3. env.py           the environment protocol: reset, step -> observation, reward, done
4. trajectory.py    an episode in tokens: ids, action mask, behaviour log-prob, version
5. episodes.py      the episode loop: many episodes over one engine, each at its own pace
6. calc.py          the laptop task: multiply with a calculator tool
7. worker.py        multi-turn rollouts on a policy rank (chapter 5's worker, one method)
8. trainer.py       chapter 5's loop on episodes; `train`, what ``avrid ppo`` calls

Research behind the chapter: `docs/agents-vllm-cpu.md` (what vLLM's engine does for
per-trajectory scheduling and weight updates mid-rollout).
"""

from avrid.agents.trainer import AgentTrainer, make_trainer, train

__all__ = ["AgentTrainer", "make_trainer", "train"]
