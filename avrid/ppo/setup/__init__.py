"""What a run is made of: its config, the task that sets prompts and rewards, the tokenizer.

Read in this order:

1.  config.py       `PPOConfig`: eleven frozen sections, every field documented and checked alone
2.  algo.py         its `algo` section: estimator, policy loss, KL, clips, score shaping
3.  rollout.py      its `rollout` section: engine, sampling, vLLM's GPU share, seed mode
4.  memory.py       its `memory` section: packing, attention kernel, log-prob chunk, offload
5.  lora.py         its `lora` section: LoRA rank, alpha, target modules, what vLLM is sent
6.  pipeline.py     its `pipeline` section (chapter 6): sync, one-step-off or async, and K
7.  tools.py        its `tools` section (chapter 7): which sandbox runs a task's tool code
8.  validate.py     `validate`: every check that involves more than one field, in one place
9.  overrides.py    ``section.field=value`` assignments (the command line's ``--set``)
10. presets.py      named configs (`tiny-ppo`, `tiny-grpo`, `tiny-ppo-lora`, `tiny-ppo-vllm`,
                    `tiny-agent`, `small-cpu`, `pipeline-cpu`, `qwen-gsm8k`)
11. field_help.py   every field's type, default and docstring (``--help-config``)
12. config_file.py  a config as a YAML/JSON file, out and back in (``--print-config``, ``--config``)
13. task.py         the `Task` contract: prompts, a verifiable reward, `check_reward`
14. digits.py       the built-in digit task a tiny model learns on a CPU
15. gsm8k.py        grade-school maths from a local GSM8K file, for real models
16. catalog.py      `load_task`: a task by name or by ``package.module:factory``
17. reward_functions.py   your reward function without a class (``task.reward=module:function``)
18. task_options.py ``--set task.options=key:value,...``, typed by what the task declares
19. tokenizer.py    the character tokenizer of tiny runs and a local Hugging Face one
20. memory_shapes.py      a model's shape without loading it (``--estimate-memory``), LoRA's
                         adapter parameters
21. memory_activations.py the worst micro-batch, and its activations and logits
22. memory_setup.py       what a GPU holds while `setup` builds and shards the models
23. memory_pipeline.py    the pipeline modes: rank 0's push buffers, the rollout GPU
24. memory_estimate.py    the predicted peak bytes of each phase per GPU, by component; the
                         LoRA engine's sleep level
25. memory_report.py      ``--estimate-memory``'s table, its verdict and a layout that fits
26. reward_model.py       its `reward_model` section: a learned reward model, its weights and
                         placement; `check_checkpoint` reads its config.json
27. memory_reward_model.py  a reward model's weights and forward on the GPU its placement
                         names (``--estimate-memory``)

Pure: nothing here imports Ray, and nothing starts a process or loads a model.
"""
