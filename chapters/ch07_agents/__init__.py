"""Chapter 7 — multi-turn agent rollouts: tools in a sandbox, token-in/token-out trajectories,
per-trajectory scheduling, partial rollouts.

Run the demo with ``python -m chapters.ch07_agents``; read ``README.md`` beside this file for
the loop, what is masked and why, what partial rollouts change, and the exercises. The library
layer is `avrid.agents`; `workloads.py` here holds the demo's and notebook's props (a sleepy
tool, a timed engine, weights that change mid-rollout) and `figure.py` draws the chapter's
picture.
"""
