"""LoRA adapters served by the real vLLM engine from memory (`vllm` tier: `make test-vllm`).

Issue 30's first acceptance item, on vLLM's CPU build: a tiny Qwen2 with PEFT adapters whose
B is random (so the adapter visibly changes the function), served with `AdapterSync` (the
code a policy rank runs) into a `VllmEngine` built with ``lora_rank``:

- the engine's sampled log-probs equal the trainer's on the same tokens (fp32, chapter 5's
  bound), and differ from the base model's (the adapter is applied);
- the same adapter merged into the weights and served by an engine without LoRA gives the
  same greedy tokens and the same log-probs;
- a stale adapter (the engine keeps the previous tensors under the new version) is caught by
  the read-back fingerprint, which names the changed tensors and the version;
- a PEFT adapter directory (what ``avrid export`` writes) serves through `read_adapter_dir`;
- `close` lets the model and the LoRA manager go (on a GPU the next sleep-mode engine of the
  process needs cumem's "weights" pool empty; a gpu test builds that engine).

Two engines are built and closed in turn (vLLM allows one per process at a time).
"""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from avrid.ppo.engines.models import build_tiny_policy
from avrid.ppo.engines.torch_engine import SamplingParams
from avrid.ppo.roles import lora
from avrid.ppo.roles.adapter_sync import AdapterSync
from avrid.ppo.setup.lora import LoraConfig
from avrid.reshard import StaleWeightsError
from tests.helpers import trainer_logprobs
from tests.test_ppo_vllm import PAD, PROMPTS, SPEC

pytestmark = [pytest.mark.chapter(5), pytest.mark.vllm]

F32 = torch.float32


def adapted_policy(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(base, adapted): a tiny policy with a sharpened head (greedy far from ties) and the
    same with rank-8 adapters on every linear layer, B random (PEFT starts it at 0)."""
    base = build_tiny_policy(SPEC, seed=seed, pad_token_id=PAD)
    with torch.no_grad():
        base.lm_head.weight.mul_(4.0)
    adapted = lora.attach(copy.deepcopy(base), LoraConfig(rank=8, alpha=16.0), seed=seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return base.eval(), adapted.eval()


def engine(path: Path, lora_rank: int) -> Any:
    from avrid.ppo.engines.vllm_engine import VllmEngine

    return VllmEngine(str(path), max_model_len=128, seed=0, dtype="float32",
                      enforce_eager=True, lora_rank=lora_rank)


def worst_gap(done: list, ref: list) -> float:
    return max(float((torch.tensor(c.logprobs) - r.cpu()).abs().max())
               for c, r in zip(done, ref, strict=True))


class StaleEngine:
    """Wraps an engine whose adapter loads "miss" an update: every load after the first
    serves the first tensors it was given, under the new version."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.first: dict[str, torch.Tensor] | None = None

    def load_adapter(self, tensors: dict, config: dict, *, version: int) -> None:
        self.first = self.first or {k: v.clone() for k, v in tensors.items()}
        self.inner.load_adapter(self.first, config, version=version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_served_adapters_match_the_trainer_the_merged_model_and_catch_staleness(
        tmp_path: Path) -> None:
    base, adapted = adapted_policy(seed=0)
    base.save_pretrained(tmp_path / "base")
    sampled = SamplingParams(max_new_tokens=16, seed=5)
    greedy = SamplingParams(max_new_tokens=16, greedy=True)

    eng = engine(tmp_path / "base", lora_rank=8)
    try:
        sync = AdapterSync(adapted, rank=0, engine_dtype=F32)
        report = sync.run(adapted, eng, version=1)
        assert eng.adapter == (1, 1) and report.engine_bytes == sync.adapter_bytes
        assert report.bytes_moved == 0  # one rank: nothing crosses a wire
        done = eng.generate(PROMPTS, sampled)
        # fp32 both sides; measured ~1e-6 (kernels' summation order only).
        assert worst_gap(done, trainer_logprobs(adapted, PROMPTS, done, temperature=1.0,
                                                pad_id=PAD)) < 1e-4
        # ... and the adapter is really applied: the base model is far off on these tokens.
        assert worst_gap(done, trainer_logprobs(base, PROMPTS, done, temperature=1.0,
                                                pad_id=PAD)) > 1e-2
        served = eng.generate(PROMPTS, greedy)

        # A new version is served under a new id; the old one is gone.
        layer = adapted.model.layers[1].mlp.down_proj
        version_1 = layer.lora_B[lora.ADAPTER].weight.detach().clone()
        with torch.no_grad():
            layer.lora_B[lora.ADAPTER].weight.add_(0.01)
        sync.run(adapted, eng, version=2)
        assert eng.adapter == (2, 2)
        assert sorted(eng.llm.llm_engine.list_loras()) == [2]

        # Stale: the load of version 3 misses the update made after version 2.
        stale = StaleEngine(eng)
        sync.run(adapted, stale, version=3)  # the first load through it: up to date
        with torch.no_grad():
            layer.lora_B[lora.ADAPTER].weight.add_(0.01)
        with pytest.raises(StaleWeightsError) as caught:
            sync.run(adapted, stale, version=4)
        message = str(caught.value)
        assert "version 4" in message and "(1 tensors)" in message
        assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in message
        with torch.no_grad():  # back to version 1's adapter: served as it was then
            layer.lora_B[lora.ADAPTER].weight.copy_(version_1)
        sync.run(adapted, eng, version=5)
        assert eng.generate(PROMPTS, greedy) == served
    finally:
        eng.close()

    # The same adapter merged into the weights, served by an engine without LoRA.
    with torch.no_grad():
        merged = lora.merged_local_shards(adapted, dict(adapted.named_parameters()))
    plain = build_tiny_policy(SPEC, seed=0, pad_token_id=PAD)
    plain.load_state_dict(merged)
    plain.save_pretrained(tmp_path / "merged")
    eng = engine(tmp_path / "merged", lora_rank=0)
    try:
        again = eng.generate(PROMPTS, greedy)
    finally:
        eng.close()
    assert [c.token_ids for c in again] == [c.token_ids for c in served]
    assert max(abs(a - b) for x, y in zip(again, served, strict=True)
               for a, b in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4


def test_a_bf16_engine_with_some_modules_adapted_holds_exactly_what_the_check_expects(
        tmp_path: Path) -> None:
    """bf16 (the GPU dtype): vLLM casts B and then scales it in bf16, and the check expects
    just that, bit for bit; adapters on q, v and down only leave k (in the fused qkv) and
    gate/up without one, which the read-back skips; alpha 32 makes the scaling 4."""
    base = build_tiny_policy(SPEC, seed=3, pad_token_id=PAD)
    base.save_pretrained(tmp_path / "base")
    adapted = lora.attach(copy.deepcopy(base), LoraConfig(rank=8, alpha=32.0,
                                                          target_modules="q_proj,v_proj,down_proj"),
                          seed=4)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    from avrid.ppo.engines.vllm_engine import VllmEngine

    eng = VllmEngine(str(tmp_path / "base"), max_model_len=128, seed=0, dtype="bfloat16",
                     enforce_eager=True, lora_rank=8)
    try:
        sync = AdapterSync(adapted, rank=0, engine_dtype=torch.bfloat16)
        assert sync.scaling == 4.0 and sync.config["target_modules"] == [
            "down_proj", "q_proj", "v_proj"]
        sync.run(adapted, eng, version=1)  # raises if a held tensor is off by one bit
        held = eng.adapter_checksums()
        assert len(held) == 2 * 3 * SPEC.num_layers  # A and B of three modules per layer
        assert not any(".k_proj." in k or ".gate_proj." in k for k in held)
        done = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=1))
        assert all(len(c.token_ids) == 8 for c in done)
        stale = StaleEngine(eng)
        sync.run(adapted, stale, version=2)  # its first load: up to date
        with torch.no_grad():
            adapted.model.layers[0].self_attn.v_proj.lora_A[lora.ADAPTER].weight.mul_(0.5)
        with pytest.raises(StaleWeightsError,
                           match=r"version 3.*layers\.0\.self_attn\.v_proj\.lora_A"):
            sync.run(adapted, stale, version=3)
    finally:
        eng.close()


@pytest.mark.gpu(duration_s=120)
@pytest.mark.parametrize("level", [0, 1])
def test_on_cuda_a_level_one_sleep_keeps_the_base_and_the_next_adapter_serves(
        tmp_path: Path, level: int) -> None:
    """The hand-overs an adapter-serving engine makes on a GPU (`handoff.to_trainer(...,
    level=...)`, `handoff.trainer_sleep_level`): level 1 offloads the base to host memory and
    brings it back on waking, level 0 keeps it resident and releases the KV cache only; the
    next sync sends the adapter alone and the engine serves what it did."""
    from avrid.ppo.engines.vllm_engine import VllmEngine
    from avrid.ppo.roles import handoff

    base, adapted = adapted_policy(seed=5)
    base.save_pretrained(tmp_path / "base")
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    eng = VllmEngine(str(tmp_path / "base"), max_model_len=128, seed=0, dtype="float32",
                     lora_rank=8, gpu_memory_utilization=0.25)
    try:
        assert eng.enable_sleep_mode
        sync = AdapterSync(adapted, rank=0, engine_dtype=F32)
        sync.run(adapted, eng, version=1)
        before = [c.token_ids for c in eng.generate(PROMPTS, greedy)]
        free_awake, _ = torch.cuda.mem_get_info()
        handoff.to_trainer(eng, level=level)
        assert torch.cuda.mem_get_info()[0] > free_awake  # the GPU went to the trainer
        handoff.wake_for_load(eng, "cuda")
        sync.run(adapted, eng, version=2)  # the adapter alone, checked by read-back
        handoff.wake_for_generate(eng, "cuda")
        assert [c.token_ids for c in eng.generate(PROMPTS, greedy)] == before
    finally:
        eng.close()


def _model_and_lora_manager(worker: Any) -> list[weakref.ref]:
    """On the engine's worker: weak references to its model and its LoRA manager."""
    runner = worker.model_runner
    return [weakref.ref(runner.model), weakref.ref(runner.lora_manager)]


def test_close_lets_the_model_and_the_lora_manager_go(tmp_path: Path) -> None:
    """Before the fix the engine's sink kept the ``vllm.LLM`` alive after `close`, and with
    it the worker's LoRA manager, which holds the model: on a GPU its weights stayed in
    cumem's "weights" pool, and vLLM refused the process's next sleep-mode engine ("CuMem
    allocator can only be used for one instance per process")."""
    base, adapted = adapted_policy(seed=7)
    base.save_pretrained(tmp_path / "base")
    eng = engine(tmp_path / "base", lora_rank=8)
    try:
        AdapterSync(adapted, rank=0, engine_dtype=F32).run(adapted, eng, version=1)
        (refs,) = eng.llm.collective_rpc(_model_and_lora_manager)
        assert all(r() is not None for r in refs)
    finally:
        eng.close()
    gc.collect()  # `eng` itself is still referenced here, as a caller's engine would be
    assert [r() is None for r in refs] == [True, True], "close() left the model alive"


@pytest.mark.gpu(duration_s=120)
def test_on_cuda_a_sleep_mode_engine_builds_after_a_closed_lora_engine(tmp_path: Path) -> None:
    """What the weakrefs above stand for on a GPU: vLLM builds the process's next sleep-mode
    engine only once cumem's "weights" pool is empty."""
    from avrid.ppo.engines.vllm_engine import VllmEngine

    base, adapted = adapted_policy(seed=9)
    base.save_pretrained(tmp_path / "base")
    kwargs = {"max_model_len": 128, "seed": 0, "dtype": "float32",
              "gpu_memory_utilization": 0.25}
    eng = VllmEngine(str(tmp_path / "base"), lora_rank=8, **kwargs)
    try:
        assert eng.enable_sleep_mode
        AdapterSync(adapted, rank=0, engine_dtype=F32).run(adapted, eng, version=1)
    finally:
        eng.close()
    again = VllmEngine(str(tmp_path / "base"), **kwargs)
    try:
        assert again.enable_sleep_mode
        assert len(again.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=1))) == 4
    finally:
        again.close()
