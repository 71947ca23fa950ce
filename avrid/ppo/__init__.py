"""Chapter 5 — PPO and GRPO: the roles, the RL math, rollout engines and the training loop.

The top layer: it uses every layer below (placement, dispatch, canonical results, weight
sync) and adds what makes them a trainer. `avrid ppo` runs `driver.run.train(preset(...))`.

Seven sub-packages, each with its reading order in its ``__init__.py``; the arrows point
down only (import-linter checks it):

    driver/    placement, the `Trainer` and its `train_step`, the whole run
    outputs/   the run directory, checkpoints, metrics, plots, export        | roles/
    roles/     the workers: reward, policy (+ rollout), critic, and what they share
    engines/   models, the torch and vLLM rollout engines                    | data/
    data/      which prompts a step reads, the columns its batch grows
    setup/     config and its validation, presets, tasks, tokenizers
    algo/      the RL math: log-probs, advantages, losses

Follow one step: `driver/trainer.py` (`train_step`) calls into `data/prompts.py`,
`roles/policy.py`, `roles/reward.py`, `roles/critic.py`, `data/columns.py`,
`data/credit.py`, `data/dynamic_sampling.py` and `algo/losses.py` — nine files; the chapter
README walks them.

Nothing is re-exported here: import from the module that defines a name, so "go to
definition" lands on it.
"""
