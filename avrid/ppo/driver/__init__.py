"""The driver: one process that places the roles and runs the loop.

Read in this order:

1. placement.py  where each role runs: pools and role specs from the config (chapter 1)
2. trainer.py    `Trainer`: start the workers, `train_step` (the step as named phases),
                 validation, `state` (the whole weights, for tests)
3. scoring.py    `score_batch`: a batch's "reward" phase and, with a reward model, its
                 "reward_model" phase, combined by weight
4. saving.py     a checkpoint of a running trainer: every rank writes its own shards, the
                 driver its position and RNG states; what a resume hands `Trainer.start`
5. run.py        `train`: the whole run around the trainer — resume, validation cadence,
                 metrics, samples, checkpoints, plots, export (what `avrid ppo` calls)
6. stopping.py   Ctrl-C and a scheduler's SIGTERM stop a run alike (what `avrid ppo` sets)
7. eval_target.py  what `avrid eval` evaluates: a checkpoint, an export or the initial model,
                   with the weights and the config each brings
8. evaluate.py   `evaluate`: the trainer's workers, validation's call, greedy and sampled
                 passes, pass@k, reward and lengths (what `avrid eval` calls)
9. step_graph.py  the step as a graph: each phase's group, the columns it reads and writes,
                  what it waits for, derived from them (`avrid ppo --print-graph`)
10. step_graph_figure.py  that graph drawn, left to right, one lane per worker group
11. concurrent.py  with `train.concurrent_phases`: `learn`'s phases issued by that graph,
                   each once its inputs are ready, the results put back in the serial order
12. reference.py  where "ref_logp" is computed: the policy's ranks, or a reference pool's
                  (`placement.reference`), for the serial and the concurrent step alike
13. reward_stream.py  with `rollout.stream_rewards`: each response sent to the reward worker
                      as the engine finishes it; the scores put together as the serial call's
"""
