"""Chapter 6 — the memory of the pipeline modes: the trainer's push, and the rollout GPU.

With `pipeline.mode` one_step_off or async the layout has two kinds of GPU
(`avrid.pipeline`): the trainer's (`LearnerWorker`: actor and reference, no rollout engine)
and a rollout worker's (one engine on a GPU of its own, which never sleeps). After every step
trainer rank 0 posts the new weights to the rollout ranks in flat buckets of
`PUSH_BUCKET_BYTES` (`pipeline/transfer.py`), and each rollout rank loads them into its engine
bucket by bucket. So:

    trainer rank 0, "weight push"   the masters and AdamW (resident), the one fp32 tensor
                                    being gathered and its cast to the engine's dtype, and at
                                    most `PUSH_BUCKETS_HELD` buckets posted and not yet sent
    rollout GPU, "generate"         the engine: vLLM's `gpu_memory_utilization` share (weights +
                                    KV cache; `OWN_POOL_GPU_SHARE` by default), or the torch
                                    engine's weights and its generate batch's KV cache
    rollout GPU, "receive"          the engine, plus `RECEIVE_BUCKETS_HELD` buckets' worth (the
                                    one being received, the one being loaded into the engine's
                                    weights: no whole-model copy) and, where one tensor is
                                    larger than a bucket (the embedding), that tensor put
                                    together whole before it is loaded

Not here: the trainer's other phases (the same as chapter 5's, `memory_estimate.py`), the push
itself (`pipeline/transfer.py`, `pipeline/push_group.py`).
"""

from __future__ import annotations

from avrid.ppo.setup.memory_shapes import ModelShape

PUSH_BUCKET_BYTES = 64 << 20
"""`pipeline.transfer.BUCKET_BYTES`, the bound of one push bucket (a test keeps them equal;
setup may not import the pipeline package)."""
PUSH_BUCKETS_HELD = 2
"""Buckets trainer rank 0 holds at once while it posts a push: the one being broadcast and
the next one being packed (`pipeline.transfer.POSTED_BUCKETS`; a test keeps them equal)."""
RECEIVE_BUCKETS_HELD = 3
"""Buckets' worth a rollout rank holds at once (`pipeline.transfer.received_tensors`): the one
arriving, the one whose tensors its engine is loading, and a tensor spanning two buckets put
together (tests/test_push_memory.py pins this bound)."""


def push_parts(policy: ModelShape, *, cd: int) -> dict[str, int]:
    """Trainer rank 0's push buffers beyond its resident state: the largest fp32 tensor
    gathered whole (`full_tensor`), its cast to `cd` bytes, and `PUSH_BUCKETS_HELD` buckets."""
    largest = max(policy.embedding_params, policy.hidden * policy.intermediate)
    return {"sync": PUSH_BUCKETS_HELD * PUSH_BUCKET_BYTES + (4 + cd) * largest}


def receive_bytes(policy: ModelShape, *, cd: int) -> int:
    """A rollout rank's push buffers beside its engine: `RECEIVE_BUCKETS_HELD` buckets, plus
    the largest tensor in the engine's dtype where it spans buckets (it is assembled whole,
    then loaded; a tensor within one bucket is loaded from the bucket in place)."""
    largest = cd * max(policy.embedding_params, policy.hidden * policy.intermediate)
    return RECEIVE_BUCKETS_HELD * PUSH_BUCKET_BYTES + (
        largest if largest > PUSH_BUCKET_BYTES else 0)


def rollout_phases(engine: dict[str, int], *, runtime: int, vllm: bool, received: int
                   ) -> list[tuple[str, dict[str, int]]]:
    """(name, parts) of a rollout GPU's two phases, given its engine's generate-time parts
    (`engine`: "engine", and for the torch engine "kv" too). vLLM keeps its whole share while
    it receives (its KV cache is allocated once and never released: no sleep mode on a GPU of
    its own); the torch engine keeps its weights only between generations. `received`: the
    push buffers (`receive_bytes`)."""
    receive = dict(engine) if vllm else {"engine": engine["engine"]}
    return [("generate", {**engine, "runtime": runtime}),
            ("receive", {**receive, "sync": received, "runtime": runtime})]
