"""Models and the engines that sample from them.

Read in this order:

1. models.py        tiny Qwen2-shaped policies and critics built from a config, local
                    checkpoints loaded, the critic's value head, the trainer's attention kernel
2. packed_attention.py  SDPA over a packed row one sequence at a time (no N x N mask)
3. torch_engine.py  the `RolloutEngine` protocol and `TorchEngine`, a hand-written KV-cache
                    sampler whose log-probs match the trainer's forward pass
4. vllm_engine.py   `VllmEngine`: the same protocol over a real ``vllm.LLM`` (CPU or GPU)
5. vllm_lora.py     LoRA adapters served by that engine from memory, and read back from its
                    kernels for the fingerprint
6. vllm_logs.py     the scope the vLLM engine works in: vLLM's own log lines and warnings
                    kept off the screen unless asked for, and put back afterwards
7. vllm_process.py  what that engine asks of its process: the one vLLM release it supports,
                    and the variables set while it is built (the V1 model runner everywhere)
8. vllm_stream.py   that engine stepped by hand, each response told in the step it ends
                    (`rollout.stream_rewards`)

No Ray here; the policy worker (`roles/policy.py`) owns an engine per rank.
"""
