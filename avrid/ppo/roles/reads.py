"""The batch columns each worker method reads, so that a call carries only those.

The driver holds one batch that grows a column per phase: by the updates it has the tokens,
the rollout's and the actor's log-probs, values, advantages, returns and half a dozen
per-sample columns. Sending all of them to every call would serialise, ship and deserialise
columns the worker never looks at — on a small model, most of a call's transport. So for
each method this file says what it reads, and the driver sends `batch.only(*reads)`:

    run_shards(policy, PolicyWorker.update, mini_batch.only(*ACTOR_UPDATE(config)), ...)

A method that reads a column left out fails at once with the column's name (a `KeyError` in
the worker), never silently. The lists live here, next to the roles that read them, not in
the driver; the tests run every method on exactly these columns.
"""

from __future__ import annotations

from avrid.ppo.setup.config import PPOConfig

FORWARD = ("tokens",)
"""`PolicyWorker.compute_logprobs` and `CriticWorker.compute_values`: a forward pass needs
the token ids (and the lengths every batch carries)."""

SCORE = ("tokens", "split", "prompt_index")
"""`RewardWorker.score`: the response tokens, and which prompt of which split they answer."""

CRITIC_UPDATE = ("tokens", "loss_mask", "values", "returns")
"""`CriticWorker.update`: the clipped value loss against the old values and the returns,
over the samples whose loss_mask is 1."""


def actor_update(config: PPOConfig) -> tuple[str, ...]:
    """`PolicyWorker.update` under `config`: the PPO loss (old log-probs, advantages,
    loss_mask), the rollout's log-probs when an off-policy correction applies (chapter 6),
    the reference's when the KL is in the loss."""
    a = config.algo
    reads = ("tokens", "loss_mask", "old_logp", "advantages")
    if config.pipeline.applied_correction != "none":
        reads += ("rollout_logp",)
    if a.kl_coef > 0 and a.kl_in == "loss":
        reads += ("ref_logp",)
    return reads
