"""Chapter 5: `lora.sync=adapter` inside a real `PolicyWorker`, on CPU, with a stand-in for
vLLM (the real engine is the vllm tier's: `tests/test_ppo_vllm_lora.py`).

The stand-in is chapter 5's recording torch engine (`test_hybrid_handoff.py`) taught vLLM's
adapter calls. Like vLLM it copies what it is sent into buffers of its own and folds the
scaling alpha / r into B (vLLM's `LoRALayerWeights.optimize`), then serves W + B' A over the
base it was first loaded with; `adapter_checksums` fingerprints its copies. It never calls
avrid's `held_form` (what avrid predicts vLLM holds), and what it must serve is computed by
PEFT (`get_delta_weight`: PEFT's own merge), so neither side of a check is built from the
code it checks. Through three training steps (A moves only from the second: B starts at 0):

- the base is loaded once, at setup; every sync after it sends only the adapter, under the
  driver's version, and the engine sleeps at level 1 (it keeps its base) instead of 2;
- after each update the engine holds the live A and alpha / r times the live B (copies, by
  value) and serves PEFT's merged W + (alpha / r) B A; avrid's predicted held form agrees;
- `sync/engine_bytes` is the adapter's size, a fraction of the model's;
- an engine that misses an adapter load is caught, naming the version and the tensors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from avrid.dispatch import Batch, Shard
from avrid.ppo.data.columns import Totals
from avrid.ppo.engines.torch_engine import TorchEngine
from avrid.ppo.engines.vllm_lora import PEFT_PREFIX, peft_key
from avrid.ppo.roles import handoff, lora
from avrid.ppo.roles.generation import build_engine
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.reshard import StaleWeightsError, fingerprint
from avrid.workers import WorkerIdentity
from tests.test_hybrid_handoff import EOS, PAD, VOCAB, RecordingEngine, step_batch

pytestmark = pytest.mark.chapter(5)


class AdapterServingEngine(RecordingEngine):
    """A recording torch engine that serves LoRA adapters as vLLM does (module docstring)."""

    def __init__(self, engine: TorchEngine, log: list[str]) -> None:
        super().__init__(engine, log)
        self.adapter: tuple[int, int] | None = None
        self.held: dict[str, torch.Tensor] = {}
        self.base: dict[str, torch.Tensor] | None = None
        self.skip_loads = False  # a broken load: the call returns, nothing changes

    def load_adapter(self, tensors: dict, config: dict, *, version: int) -> None:
        self.log.append(f"adapter(v{version})")
        if self.base is None:  # the weights loaded so far are the base
            self.base = {n: t.detach().clone() for n, t in self.model.state_dict().items()}
        lora_id = 1 if self.adapter is None else self.adapter[1] + 1
        self.adapter = (version, lora_id)
        if self.skip_loads:
            return
        dtype = next(self.model.parameters()).dtype
        scaling = config["lora_alpha"] / config["r"]
        self.held = {}
        for key, t in tensors.items():  # copies: what was sent may change after the call
            held = t.detach().to(dtype, copy=True)
            self.held[key] = held * scaling if ".lora_B." in key else held
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for key, a in self.held.items():
                if ".lora_A." not in key:
                    continue
                module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
                b = self.held[key.replace(".lora_A.", ".lora_B.")]
                params[f"{module}.weight"].copy_(self.base[f"{module}.weight"] + b @ a)

    def adapter_checksums(self) -> dict[str, int]:
        return dict(fingerprint(self.held).checksums)


class AdapterPolicy(PolicyWorker):
    """A policy rank configured for vLLM with adapters, whose engine is the stand-in."""

    log: list[str] = []

    def _make_engine(self, model: torch.nn.Module) -> AdapterServingEngine:
        torch_engine = dataclasses.replace(
            self.config, rollout=dataclasses.replace(self.config.rollout, engine="torch"))
        engine, _ = build_engine(torch_engine, model, rank=0, pad_id=self.pad_id,
                                 max_response=self.max_response)
        return AdapterServingEngine(engine, self.log)


def test_the_adapter_sync_sends_the_base_once_then_only_adapters_checked(monkeypatch) -> None:  # noqa: ANN001,E501
    log: list[str] = []
    monkeypatch.setattr(handoff, "empty_cache", lambda device: log.append("empty_cache"))
    AdapterPolicy.log = log
    cfg = with_overrides(PPOConfig(), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "model.hidden_size=64", "model.num_heads=2", "rollout.engine=vllm", "lora.rank=4",
        "train.actor_lr=0.05"])
    worker = AdapterPolicy(WorkerIdentity(role="policy", rank=0, world_size=1), config=cfg,
                           vocab_size=VOCAB, eos_id=EOS, pad_id=PAD, max_response_tokens=4)
    worker.setup()
    groups = len(worker.sync.groups)
    sync = ["empty_cache", "wake(weights)", "adapter(v{})", "empty_cache", "wake(kv_cache)"]
    assert log == ["load"] * groups + [s.format(0) for s in sync]  # the base, once

    batch = step_batch()
    rows = [batch.packed["tokens"].row(0)[:2], batch.packed["tokens"].row(1)[:3]]
    prompts = Shard(index=0, micro_bounds=(0, 2), batch=Batch.from_rows(
        sample_ids=[0, 1], prompt_lens=[2, 3], response_lens=[0, 0], packed={"tokens": rows}))
    log.clear()
    worker.generate(prompts, max_new_tokens=3, greedy=False, seed=0)
    assert log == ["generate", "sleep(1)"]  # level 1: the base stays with the engine

    shard = Shard(index=0, batch=batch, micro_bounds=(0, 2, 4))
    worker.compute_logprobs(shard)
    worker.update(shard, totals=Totals.of(batch, 4), step=0)
    log.clear()
    result = worker.sync_weights(version=1)
    assert log == [s.format(1) for s in sync]  # no "load": only the adapter moved
    engine_bytes = next(m.value for m in result.metrics if m.name == "sync/engine_bytes")
    model_bytes = sum(p.numel() * 4 for n, p in worker.model.named_parameters()
                      if not lora.is_adapter(n))
    assert engine_bytes == worker.adapter_sync.adapter_bytes < model_bytes / 5
    served_as_peft_merges(worker)
    a_before = {n: p.detach().clone() for n, p in worker.model.named_parameters()
                if ".lora_A." in n}

    # The second update moves A too (its gradient is B^T ..., and B is no longer 0): an A
    # the engine still holds from before is stale.
    worker.update(shard, totals=Totals.of(batch, 4), step=1)
    params = dict(worker.model.named_parameters())
    assert any(not torch.equal(params[n], a) for n, a in a_before.items())
    worker.sync_weights(version=2)
    served_as_peft_merges(worker)

    # A load that does not happen is caught by the read-back, with the version; the engine
    # still serves the previous adapter.
    worker.update(shard, totals=Totals.of(batch, 4), step=2)
    worker.engine.skip_loads = True
    with pytest.raises(StaleWeightsError, match=r"version 3.*differ: \[.*lora_"):
        worker.sync_weights(version=3)
    assert any(not torch.equal(m, served) for m, served in peft_and_served(worker).values())
    worker.close()


def peft_and_served(worker: PolicyWorker) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Served name -> (W + delta by PEFT's own merge of the live actor, what the engine
    serves) for every adapted weight."""
    served = worker.engine.model.state_dict()
    out = {}
    for name, layer in lora.lora_layers(worker.model):
        with torch.no_grad():
            merged = layer.base_layer.weight + layer.get_delta_weight(lora.ADAPTER)
        out[f"{name}.weight"] = (merged, served[f"{name}.weight"])
    return out


def served_as_peft_merges(worker: PolicyWorker) -> None:
    """The engine holds copies of the live A and of (alpha / r) times the live B, which
    avrid's prediction of vLLM's held form (`AdapterSync.held_local`) matches, and serves
    PEFT's merged weights."""
    cfg = worker.config.lora
    params = dict(worker.model.named_parameters())
    held = worker.engine.held
    predicted = worker.adapter_sync.held_local(worker.model)
    for name in (n for n in params if lora.is_adapter(n)):
        key, live = peft_key(name), params[name].detach()
        want = live * (cfg.alpha / cfg.rank) if ".lora_B." in name else live
        assert held[key].data_ptr() != live.data_ptr()  # a copy, not the live parameter
        assert torch.equal(held[key], want), f"{key}: the engine does not hold the live value"
        assert torch.equal(predicted[key], held[key]), key
    pairs = peft_and_served(worker)
    assert pairs and any(not torch.equal(worker.engine.base[n], m) for n, (m, _) in pairs.items())
    for name, (merged, served) in pairs.items():
        torch.testing.assert_close(served, merged, rtol=0, atol=1e-6, msg=name)
