"""Chapter 5 — PPO and GRPO: the roles, the RL math, rollout engines and the single-controller
training loop that ties chapters 1 to 4 together into a trainer.

Run the demo with ``python -m chapters.ch05_ppo``; read ``README.md`` beside this file for the
dataflow, the reading order and the exercises. Unlike the earlier chapters there is no
``workers.py`` here: the policy, critic and reward workers are the library's own
(``avrid/ppo/``), and the demo drives the library's `Trainer` step by step.
"""
