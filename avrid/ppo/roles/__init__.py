"""The worker roles: what each rank does with the shard it is sent. They run in worker
processes (Ray actors) or, with the in-process backend, on threads of the driver.

Read in this order:

1. reward.py       `RewardWorker`: decode each response and score it with the task
2. forward.py      what the actor and critic compute on a micro-batch, and the one training
                   walk both updates share (`train_shard`)
3. fsdp.py         sharding a model with FSDP2 and reading its full weights back
4. trained.py      `TrainedWorker`: the base of the FSDP-trained roles (process group, build
                   or load, shard, AdamW, restore, state, close)
5. meta_init.py    a sharded role starting from a checkpoint: a meta-device skeleton, sharded,
                   then filled from the one copy rank 0 loads (no whole model per GPU)
6. generation.py   a rank's rollout engine: build it, load weights into it, generate a shard
7. lora.py         LoRA on the actor: PEFT's adapters put in, the base as the reference,
                   the merged weights a sync sends
8. policy.py       `PolicyWorker`: actor + reference + rollout engine per rank (hybrid engine)
9. weight_sync.py  the actor's shards into each rank's engine (chapter 4), streamed group by
                   group, fingerprint-checked
10. adapter_sync.py  LoRA into vLLM: the base once, then only the adapters, read back
11. handoff.py     one GPU, two tenants: the order in which the engine sleeps and wakes
12. critic.py      `CriticWorker`: values and the clipped value-loss update
13. reward_model.py  `RewardModelWorker`: a learned reward model (an HF sequence
                   classifier) scores (prompt + response) texts in padded forwards
14. reference.py   `ReferenceWorker`: the frozen reference on ranks of its own
                   (`placement.reference=pool`), the same forward as the policy's
15. streaming.py    `StreamingPolicyWorker`: the policy's generation, each response handed
                   out on a lane of its own as the engine finishes it (`rollout.stream_rewards`)

The driver (`driver/trainer.py`) calls their public methods through chapter 3's
`run_shards`, sending each only the batch columns it reads (the ``*_READS`` next to each
role); nothing here knows about steps, checkpoints or the other roles.
"""
