"""The RL math: pure functions of tensors. No Ray, no models, no batches, no config.

Read in this order:

1. logprobs.py       log-probabilities and entropy of tokens from logits, at a temperature
2. advantages.py     KL-penalised rewards, GAE, whitening, GRPO's group-normalised advantages
3. losses.py         KL estimators, the four loss-aggregation modes as per-token weights, the
                     clipped policy loss (dual clip, asymmetric clip) and the clipped value loss
4. estimators.py     more critic-free advantages: RLOO, REINFORCE++, REINFORCE++-baseline
5. policy_losses.py  alternatives to the token-clipped loss: GSPO's sequence-level ratio and
                     CISPO's clipped, stop-gradient importance weight
6. registry.py       the estimators and losses by name (`algo.name`, `algo.policy_loss`), one
                     calling convention each, extended by a user's ``module:function``
7. shaping.py        DAPO's soft overlong penalty on a response's score
8. off_policy.py     chapter 6's off-policy correction: per-token importance weights for stale
                     batches (none, truncated IS, decoupled PPO)
9. pass_at_k.py      pass@k's unbiased estimator (Chen et al. 2021), for `avrid eval`

Every formula is in a docstring and checked against numbers worked by hand in
tests/test_ppo_math.py and tests/test_off_policy.py; the estimators and losses that verl also
has are checked against verl's code, transcribed, in tests/test_ppo_estimators.py. The same
functions run on the driver and inside the workers.
"""
