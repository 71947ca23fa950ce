"""Chapter 7 (being built) — multi-turn agent rollouts: environments, tools, token-in/token-out
trajectories and partial rollouts, on top of chapters 5 and 6.

Read in this order:

1. sandbox.py       a tool call's code run in a child process under limits (wall time,
                    memory, disk, no network, no processes); its outcome as an observation

Research behind the rest of the chapter: `docs/agents-vllm-cpu.md` (what vLLM's engine does
for per-trajectory scheduling and weight updates mid-rollout).
"""
