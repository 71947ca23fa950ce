"""Chapter 6 — `RolloutWorker`: a rollout engine in a pool of its own, stamping its version.

Each rollout rank holds one whole engine (chapter 5's `TorchEngine` or `VllmEngine`, built by
the same `generation.build_engine`) in its own bundle — on GPU its own GPU — and does two
things, never at the same time:

    generate         one response per prompt of its shard, like the policy's hybrid engine
                     (`generation.generate_shard`: same seeds, same samples), each sample
                     stamped with the scalar "version": the weights it was generated with
    receive_weights  take the trainer's weights (one broadcast per bucket in the push group,
                     `transfer.py`), streaming them into the engine as they arrive (one
                     load per push; never a whole copy of the model beside the engine, which
                     at 7B would not fit beside vLLM's share of the GPU), and report the
                     engine's fingerprints and new version; with LoRA served as adapters
                     (`lora.sync=adapter`, vLLM) the push carries the adapters alone, over the
                     base the worker loaded itself at setup (`adapter_sync.load_base`)

The engine has its GPU to itself (`build_engine(..., colocated=False)`): it never sleeps, so
nothing wakes it before a load or a generation, and the model it is built from stays on the
CPU (the torch engine's copy is moved to the device by `build_engine`; vLLM reads only its
config).

The version is the worker's own record of what it holds, set only by `receive_weights`, so
a batch cannot claim weights its engine never had; the driver checks the stamp against the
version it pushed.

Not here: deciding when to generate or receive (the driver, `driver.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from avrid.dispatch import Shard
from avrid.pipeline.push_group import PushGroup
from avrid.pipeline.transfer import (
    PushBucket,
    engine_layout,
    push_buckets,
    receive_bucket,
    received_tensors,
)
from avrid.ppo.engines.models import initial_policy
from avrid.ppo.engines.vllm_lora import peft_config
from avrid.ppo.roles.adapter_sync import load_base, serves_adapters
from avrid.ppo.roles.generation import build_engine, close_engine, generate_shard
from avrid.ppo.setup.config import PPOConfig
from avrid.reshard import TransferPlan
from avrid.reshard.engines import WeightSink
from avrid.results import WorkerResult
from avrid.workers import Worker, WorkerIdentity


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    """What one rollout rank reports after a weight push."""

    rank: int
    version: int
    """The version the engine now holds."""
    checksums: dict[str, int]
    """Whole-tensor fingerprints of what the engine holds now."""
    start: float
    end: float


class RolloutWorker(Worker):
    """One rollout rank: an engine, its weight version, and the transfer group."""

    def __init__(self, identity: WorkerIdentity, *, config: PPOConfig, vocab_size: int,
                 eos_id: int, pad_id: int, stop_ids: tuple[int, ...] = (),
                 max_response_tokens: int) -> None:
        super().__init__(identity)
        self.config, self.vocab_size, self.pad_id, self.eos_id = config, vocab_size, pad_id, eos_id
        self.stop_ids = tuple(dict.fromkeys((eos_id, *stop_ids)))
        self.max_response = max_response_tokens
        self.device = config.placement.device
        self.version: int | None = None  # no trained weights yet (None: never pushed)
        self._transfer: PushGroup | None = None
        self._plan: TransferPlan | None = None
        self._buckets: tuple[PushBucket, ...] = ()
        self._timeout_s = 0.0
        self._engine_dir: str | None = None
        self._adapter_config: dict | None = None  # serving adapters: their PEFT config
        torch.set_num_threads(max(1, int(config.placement.cpus_per_worker)))

    def setup(self) -> None:
        """Build the engine. Its weights are the step-0 model's (torch) or random (vLLM's
        dummy load) until the first `receive_weights`, and nothing is generated before."""
        # On the CPU: it is only read (its config) or copied into the engine, which
        # `build_engine` puts on the device; a GPU copy would cost a model's memory for nothing.
        model = initial_policy(self.config, vocab_size=self.vocab_size, eos_id=self.eos_id,
                               pad_id=self.pad_id)
        self.engine, self._engine_dir = build_engine(
            self.config, model, rank=self.identity.rank, pad_id=self.pad_id,
            max_response=self.max_response, colocated=False)
        if serves_adapters(self.config):
            load_base(self.engine, model, getattr(torch, self.config.model.dtype))

    def join_transfer(self, address: str, port: int, plan: TransferPlan,
                      timeout_s: float) -> None:
        """Join the push group as its rank 1 + rank (trainer rank 0 is its rank 0), with
        every other member at once, and keep the plan and its buckets (`transfer.py`)."""
        self._transfer = PushGroup(address, port, rank=1 + self.identity.rank,
                                   world_size=1 + plan.target_world, device=self.device,
                                   timeout_s=timeout_s)
        self._plan, self._timeout_s = plan, timeout_s
        self._buckets = push_buckets(plan.target, plan.bucket_bytes)
        self._layout = engine_layout(plan)  # what the engine's fingerprints are taken under
        # Serving adapters, the push carries them alone (PEFT keys): vLLM needs their config.
        lo = self.config.lora
        self._adapter_config = (peft_config(lo.rank, lo.alpha, [n for n, _ in plan.target.params])
                                if serves_adapters(self.config) else None)

    def receive_weights(self, version: int) -> Received:
        """Receive the trainer's weights of `version`, bucket by bucket, each within the push
        timeout of the start (a trainer or peer that stopped raises `PushTimeout` naming
        this rank and the bucket), loading each tensor into the engine as soon as it is
        whole, then fingerprint the engine; every trainer and rollout rank at once. A push
        that fails part-way leaves the engine holding old and new weights mixed, and its
        version unchanged: the run stops on the error."""
        start = time.time()
        return self._install(self._receive_stream(), version, start)

    def _receive_stream(self) -> Iterator[dict[str, torch.Tensor]]:
        """The push's whole tensors as they complete, bucket by bucket
        (`transfer.received_tensors`); the next bucket is received only when the engine
        asks for more."""
        transfer, plan = self._transfer, self._plan
        if transfer is None or plan is None:
            raise RuntimeError(f"{self.identity.name}: join_transfer() must run before "
                               f"receive_weights()")
        deadline = time.monotonic() + self._timeout_s

        def stream() -> Iterator[dict[str, torch.Tensor]]:
            try:
                yield from received_tensors(plan, self._buckets,
                                            lambda b: self._receive_bucket(b, deadline),
                                            self.device)
            except BaseException:
                # Leave the group: the trainer's and the other receivers' pending broadcasts
                # fail now rather than at the timeout, and this rank's error is the first
                # one seen. (Also when the engine stopped asking: the push is abandoned.)
                transfer.leave()
                self._transfer = None
                raise

        return stream()  # checked above at once; the receiving starts with the first group

    def _receive_all(self) -> dict[str, torch.Tensor]:
        """Every tensor of one push, staged whole in host memory without touching the engine
        (chapter 7 receives while its engine generates, and loads at a call boundary)."""
        return {name: t.to("cpu") for group in self._receive_stream()
                for name, t in group.items()}

    def _install(self, groups: Iterable[dict[str, torch.Tensor]], version: int,
                 start: float) -> Received:
        """Load received weights into the engine, fingerprint it, take their version."""
        if self._adapter_config is not None:  # a new adapter id; its read-back fingerprints
            adapters = {name: t for group in groups for name, t in group.items()}  # small
            self.engine.load_adapter(adapters, self._adapter_config, version=version)
            sums = self.engine.adapter_checksums()
        else:
            sink = self.engine.sink
            self._load(sink, groups)
            sums = sink.checksums(self._layout, 0)  # what the engine now holds
        self.version = version
        return Received(rank=self.identity.rank, version=version, checksums=sums,
                        start=start, end=time.time())

    def _receive_bucket(self, bucket: PushBucket, deadline: float) -> torch.Tensor:
        """Receive one bucket's flat buffer (a test overrides this to die part-way through)."""
        return receive_bucket(bucket, self._transfer, deadline=deadline,
                              who=self.identity.name, of=len(self._buckets))

    def _load(self, sink: WeightSink, groups: Iterable[dict[str, torch.Tensor]]) -> None:
        """Stream the received tensors into the engine, one load for the whole push (a test
        overrides this to corrupt one)."""
        sink.load_stream(groups)
        sink.finish()

    def generate(self, shard: Shard, *, max_new_tokens: int, greedy: bool,
                 seed: int) -> WorkerResult:
        """Sample one response per prompt of the shard (`generation.generate_shard`), each
        sample stamped with the scalar "version" of the weights that made it."""
        if self.version is None:
            raise RuntimeError(f"{self.identity.name}: no weights received yet; the driver "
                               f"pushes them before the first generation")
        return generate_shard(self.engine, shard, self.identity, self.config,
                              stop_ids=self.stop_ids, max_response=self.max_response,
                              max_new_tokens=max_new_tokens,
                              greedy=greedy, seed=seed, scalars={"version": self.version})

    def close(self) -> None:
        """Stop the engine and remove its scratch directory."""
        close_engine(getattr(self, "engine", None), self._engine_dir)
        self._transfer = None
