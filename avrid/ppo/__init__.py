"""Chapter 5 — PPO/GRPO (declared now so the layer contract covers it; built in issue 6):
roles, the RL math, rollout engines and the single-controller training loop. The top layer:
may import every layer below it."""
