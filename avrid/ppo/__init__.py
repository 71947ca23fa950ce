"""Chapter 5 — PPO and GRPO: the roles, the RL math, rollout engines and the training loop.

The top layer: it uses every layer below (placement, dispatch, canonical results, weight
sync) and adds what makes them a trainer. `avrid ppo` runs `run.train(preset(...))`.

Read in this order:

1. the math, pure functions:   logprobs.py, advantages.py, losses.py
2. what a run is made of:      config.py (typed, validated once), presets.py,
                               tasks.py + gsm8k.py (prompts and rewards), tokenizer.py
3. models and generation:      models.py, rollout.py (TorchEngine), vllm_engine.py (vLLM)
4. inside the workers:         batching.py, actor.py, fsdp.py, weight_sync.py,
                               trained_worker.py (what actor and critic share),
                               policy_worker.py (actor + reference + rollout), critic_worker.py,
                               reward_worker.py
5. the driver:                 roles.py (placement), data.py, trainer.py (the loop),
                               run.py (resume, logging, checkpoints, plots)
6. around it:                  outdir.py (one run per directory, safe writes),
                               checkpoint.py, metrics.py, plots.py

Nothing is re-exported here: import from the module that defines a name, so "go to
definition" lands on it.
"""
