"""Chapter 5 — the hybrid engine hands its GPU over in vLLM's order, and syncs in bounded memory.

No GPU here, so both are checked through what the code does, not what a GPU would show:

- the ORDER: a recording engine (a real `TorchEngine` that logs every `wake(tags)`, `load`,
  `generate` and `sleep(level)` and, like vLLM, refuses to generate with anything asleep) and
  a recorded `handoff.empty_cache` run inside a real `PolicyWorker` through a training step;
  the log must be `handoff.py`'s order: cache emptied, weights woken, loaded bucket by bucket,
  cache emptied, KV cache woken, generate, sleep at level 2 — nothing slept in between;
- the MEMORY: a weight sync of a model ten buckets big, on two gloo ranks in two processes,
  must raise each process's peak resident memory by at most two buckets (the old sync built
  the whole model, and each rank received half of it, before loading anything).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from avrid.dispatch import Batch, Shard
from avrid.ppo.data.columns import Totals
from avrid.ppo.engines.torch_engine import TorchEngine
from avrid.ppo.roles import handoff, weight_sync
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.reshard.engines import TorchEngineSink
from avrid.workers import WorkerIdentity
from avrid.workers.outcome import free_port
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(5)

VOCAB, PAD, EOS = 16, 0, 1


class RecordingSink(TorchEngineSink):
    """The torch engine's sink, logging each `load` call (one per load group)."""

    def __init__(self, engine: TorchEngine, log: list[str]) -> None:
        super().__init__(engine.model)
        self.log = log

    def load(self, tensors, *, layout=None, rank=None) -> None:  # noqa: ANN001
        self.log.append("load")
        super().load(tensors, layout=layout, rank=rank)


class RecordingEngine(TorchEngine):
    """A `TorchEngine` that logs the hand-over calls and keeps vLLM's rules: its KV cache
    sleeps with the weights and wakes on its own tag; nothing generates while any part sleeps."""

    def __init__(self, engine: TorchEngine, log: list[str]) -> None:
        super().__init__(engine.model, pad_token_id=engine.pad_token_id)
        self.log = log
        self.kv_asleep = False
        self._recording_sink = RecordingSink(self, log)

    @property
    def sink(self) -> RecordingSink:
        return self._recording_sink

    @property
    def asleep(self) -> bool:
        return super().asleep or self.kv_asleep

    def sleep(self, level: int = 1) -> None:
        self.log.append(f"sleep({level})")
        super().sleep(level)
        self.kv_asleep = True

    def wake(self, tags=None) -> None:  # noqa: ANN001
        self.log.append(f"wake({','.join(tags) if tags is not None else 'all'})")
        super().wake(tags)
        if tags is None or "kv_cache" in tags:
            self.kv_asleep = False

    def generate(self, prompts, params):  # noqa: ANN001, ANN201
        self.log.append("generate")
        if self.asleep:
            raise RuntimeError("generate() while part of the engine sleeps")
        return super().generate(prompts, params)


class RecordingPolicy(PolicyWorker):
    """A policy rank whose engine records the hand-over (`LOG`)."""

    log: list[str] = []

    def _make_engine(self, model: torch.nn.Module) -> RecordingEngine:
        return RecordingEngine(super()._make_engine(model), self.log)


def step_batch() -> Batch:
    """Four samples with the columns an actor update reads."""
    g = torch.Generator().manual_seed(0)
    prompts, responses = [2, 3, 1, 2], [3, 1, 4, 2]
    tokens = [torch.randint(2, VOCAB, (p + r,), generator=g)
              for p, r in zip(prompts, responses, strict=True)]
    zeros = [torch.zeros(r) for r in responses]
    return Batch.from_rows(sample_ids=[0, 1, 2, 3], prompt_lens=prompts, response_lens=responses,
                           packed={"tokens": tokens, "old_logp": zeros,
                                   "advantages": [torch.ones(r) for r in responses]})


def test_the_hybrid_engine_hands_the_gpu_over_in_vllms_order(monkeypatch) -> None:  # noqa: ANN001
    log: list[str] = []
    monkeypatch.setattr(handoff, "empty_cache", lambda device: log.append("empty_cache"))
    # Small buckets, so that the sync streams the tiny model in several load groups.
    monkeypatch.setattr(weight_sync, "BUCKET_BYTES", 24 << 10)
    RecordingPolicy.log = log
    cfg = with_overrides(PPOConfig(), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "model.hidden_size=32", "model.num_heads=2"])
    worker = RecordingPolicy(WorkerIdentity(role="policy", rank=0, world_size=1), config=cfg,
                             vocab_size=VOCAB, eos_id=EOS, pad_id=PAD, max_response_tokens=4)
    worker.setup()
    groups = len(worker.sync.groups)
    assert groups >= 3, groups
    sync = ["empty_cache", "wake(weights)", *["load"] * groups, "empty_cache", "wake(kv_cache)"]
    assert log == sync  # the first sync, at setup: the engine starts from the actor's weights
    batch = step_batch()
    rows = [batch.packed["tokens"].row(0)[:2], batch.packed["tokens"].row(1)[:3]]
    prompts = Shard(index=0, micro_bounds=(0, 2), batch=Batch.from_rows(
        sample_ids=[0, 1], prompt_lens=[2, 3], response_lens=[0, 0], packed={"tokens": rows}))
    gen = dict(max_new_tokens=3, greedy=False, seed=0)

    log.clear()
    worker.generate(prompts, **gen)
    assert log == ["generate", "sleep(2)"]  # the GPU goes to the trainer right away
    log.clear()
    shard = Shard(index=0, batch=batch, micro_bounds=(0, 2, 4))
    worker.compute_logprobs(shard)
    worker.update(shard, totals=Totals.of(batch, 4), step=0)
    assert log == []  # the trainer's turn: the engine is not touched
    worker.sync_weights()
    worker.generate(prompts, **gen)
    assert log == [*sync, "generate", "sleep(2)"]  # nothing sleeps between sync and generate

    # A generation with no sync since the last one (a critic warm-up step, validation): the
    # level-2 sleep dropped the weights, so the rank reloads them first, in the same order.
    log.clear()
    worker.generate(prompts, **gen)
    assert log == [*sync, "generate", "sleep(2)"]
    worker.close()


def test_a_colocated_critic_gives_its_cached_memory_back_after_its_update(monkeypatch) -> None:  # noqa: ANN001,E501
    from avrid.ppo.roles.critic import CriticWorker

    log: list[str] = []
    monkeypatch.setattr(handoff, "empty_cache", lambda device: log.append("empty_cache"))
    cfg = with_overrides(PPOConfig(), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "model.hidden_size=32", "model.num_heads=2"])
    critic = CriticWorker(WorkerIdentity(role="critic", rank=0, world_size=1), config=cfg,
                          vocab_size=VOCAB, pad_id=PAD)
    critic.setup()
    batch = step_batch()
    zeros = {k: [torch.zeros(r) for r in batch.response_lens.tolist()]
             for k in ("values", "returns")}
    batch = Batch.from_rows(sample_ids=[0, 1, 2, 3], prompt_lens=batch.prompt_lens.tolist(),
                            response_lens=batch.response_lens.tolist(),
                            packed={"tokens": [batch.packed["tokens"].row(i) for i in range(4)],
                                    **zeros})
    critic.update(Shard(index=0, batch=batch, micro_bounds=(0, 4)),
                  totals=Totals.of(batch, 4), step=0)
    assert log == ["empty_cache"]  # once, after the update: the engine beside it can wake
    critic.close()


def test_a_level_two_sleep_drops_the_weights_and_a_wake_needs_a_load() -> None:
    from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
    from avrid.ppo.engines.torch_engine import SamplingParams

    model = build_tiny_policy(TinyModelSpec(vocab_size=VOCAB), seed=0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = TorchEngine(model, pad_token_id=PAD)
    engine.sleep(level=2)
    assert all(p.numel() == 0 for p in model.parameters())  # the storage is gone
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[2, 3]], SamplingParams(max_new_tokens=2))
    engine.wake(tags=["weights"])
    engine.sink.load(weights)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    engine.generate([[2, 3]], SamplingParams(max_new_tokens=2))


# ---- memory: a sync in a subprocess per rank, its peak resident memory measured ------------

SYNC_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch, torch.distributed as dist
    from avrid.ppo.roles.weight_sync import WeightSync
    from avrid.reshard import ModelLayout
    from avrid.reshard.engines import TorchEngineSink

    rank, port, tensors, rows, bucket = (int(a) for a in sys.argv[1:6])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    shapes = {f"layers.{i}.weight": ((rows, 1024), "float32") for i in range(tensors)}
    layout = ModelLayout.fsdp(shapes, 2)
    g = torch.Generator().manual_seed(0)
    # This rank's FSDP shards and an engine holding every tensor whole; one whole
    # tensor at a time, so that nothing before the sync raises the peak it is measured by.
    shards = {n: torch.randn(s, generator=g)[layout[n].regions[rank].to_slices()].clone()
              for n, (s, _) in shapes.items()}
    # Written, so that its pages are resident before the sync (fresh zeros are not).
    engine = {n: torch.full(s, 7.0) for n, (s, _) in shapes.items()}
    sync = WeightSync(shards, shapes, rank=rank, world_size=2, engine_dtype=torch.float32,
                      bucket_bytes=bucket)
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    sync.run(shards, TorchEngineSink(engine), dist.group.WORLD)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rank": rank, "grew": (after - before) * 1024}))
    from tests.helpers import leave_process_group
    leave_process_group()  # not a normal exit: gloo can abort in its teardown (see there)
""")


@pytest.mark.slow
def test_a_sync_streams_in_at_most_two_buckets_of_memory_per_rank(tmp_path: Path) -> None:
    # A bucket large enough for one fingerprint chunk's temporaries (`CHUNK_ELEMENTS`, about
    # 40 MiB), which the check after the load needs whatever the bucket.
    bucket = 32 << 20
    tensors, rows = 40, 2048  # 40 tensors of 8 MiB: 320 MiB, ten buckets
    port = free_port()
    # Every allocation of 1 MiB or more gets its own mapping, returned when freed: glibc's
    # default moving threshold would keep freed buffers resident in its arenas (gloo's threads
    # have their own), and the peak would count the allocator's cache, not live memory.
    env = child_env(MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    script = tmp_path / "sync.py"
    script.write_text(SYNC_SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(tensors),
                               str(rows), str(bucket)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=170) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    grew = [json.loads(out.strip().splitlines()[-1])["grew"] for out, _ in outs]
    assert tensors * rows * 1024 * 4 >= 10 * bucket
    print("peak growth per rank:", [f"{g / 2**20:.1f} MiB" for g in grew])
    assert max(grew) <= 2 * bucket, [f"{g / 2**20:.1f} MiB" for g in grew]


def test_the_streamed_sync_fills_the_engine_exactly_and_never_cuts_a_fused_module() -> None:
    shapes = {f"m.layers.{i}.mlp.{k}.weight": ((6, 5), "float32")
              for i in range(4) for k in ("gate_proj", "up_proj", "down_proj")}
    g = torch.Generator().manual_seed(1)
    weights = {n: torch.randn(s, generator=g) for n, (s, _) in shapes.items()}
    engine = {n: torch.zeros(s, dtype=torch.bfloat16) for n, (s, _) in shapes.items()}
    # Groups of at most 120 bytes: a gate + up pair (vLLM's fused gate_up_proj) is 120.
    sync = weight_sync.WeightSync(weights, shapes, rank=0, world_size=1,
                                  engine_dtype=torch.bfloat16, bucket_bytes=240)
    assert len(sync.groups) == 8
    for group in sync.groups:
        for name in group:
            if "gate_proj" in name:
                assert name.replace("gate_proj", "up_proj") in group
    sync.run(weights, TorchEngineSink(engine), None)
    assert all(torch.equal(engine[n], w.to(torch.bfloat16)) for n, w in weights.items())
