"""Chapter 5 — the level a hybrid engine sleeps at, chosen from the memory estimate.

An engine served LoRA adapters (vLLM, `lora.sync=adapter`) keeps its base model, which never
changes. It used to sleep at level 1 after every generation: the whole base to pinned host
memory and back (about 2 x 15 GB per step at 7B; issue 41, item 10). Now
`memory_estimate.sleep_level` keeps the base resident (level 0: only the KV cache released)
where the trainer's phases leave room for it, `handoff.trainer_sleep_level` asks the estimate
for this GPU's memory, and `VllmEngine.sleep(0)` releases the KV cache alone. No GPU here: the
decision is checked as a function, the engine's calls on a recording stand-in for `vllm.LLM`;
the real engine's level 0 and 1 run in test_ppo_vllm_lora.py's `gpu` test.

Not here: the estimate's other figures (test_ppo_memory_layouts.py), the hand-over's order
(test_hybrid_handoff.py).
"""

from __future__ import annotations

import pytest

from avrid.ppo.engines.vllm_engine import VllmEngine
from avrid.ppo.roles import handoff
from avrid.ppo.setup.memory_estimate import (
    RESIDENT_HEADROOM,
    SLEEP_DROP,
    SLEEP_KV_ONLY,
    SLEEP_OFFLOAD,
    GiB,
    estimate,
    sleep_level,
)
from avrid.ppo.setup.memory_shapes import KNOWN_SHAPES
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

pytestmark = pytest.mark.chapter(5)

SEVEN_B = "model.path=/nonexistent/Qwen2.5-7B-Instruct"
BASE_7B = 2 * KNOWN_SHAPES["qwen2.5-7b"].params  # the bf16 base an engine holds


def lora_7b(*sets: str):  # noqa: ANN201 (PPOConfig)
    return with_overrides(preset("qwen-gsm8k"), [SEVEN_B, "lora.rank=16", *sets])


def test_the_decision_keeps_the_base_only_where_it_fits_with_headroom() -> None:
    peak, base = 40 * GiB, 15 * GiB
    room = int((peak + base) / (1 - RESIDENT_HEADROOM))  # the smallest GPU that keeps it
    assert sleep_level(serves_adapters=True, trainer_peak=peak, base_bytes=base,
                       gpu_bytes=room + 1) == SLEEP_KV_ONLY
    assert sleep_level(serves_adapters=True, trainer_peak=peak, base_bytes=base,
                       gpu_bytes=room - 2) == SLEEP_OFFLOAD
    # Sent whole weights at every sync: dropped, whatever the memory.
    assert sleep_level(serves_adapters=False, trainer_peak=0, base_bytes=base,
                       gpu_bytes=1 << 50) == SLEEP_DROP


def test_the_estimate_puts_the_resident_base_in_the_trainer_phases() -> None:
    kept = estimate(lora_7b(), gpu_bytes=80 * GiB)
    assert kept.sleep_level == SLEEP_KV_ONLY and kept.sleep_transfer_bytes == 0
    trainer = [p for p in kept.phases if p.name in ("old log-probs", "actor update")]
    assert all(p.parts["engine"] == BASE_7B for p in trainer)
    assert any("kept resident" in n for n in kept.notes)
    # On a 48 GiB GPU it does not fit beside the trainer: offloaded, and what it costs shows.
    moved = estimate(lora_7b(), gpu_bytes=48 * GiB)
    assert moved.sleep_level == SLEEP_OFFLOAD
    assert all(p.parts["engine"] == 0 for p in moved.phases if p.name == "actor update")
    assert moved.host_bytes == BASE_7B and moved.sleep_transfer_bytes == 2 * BASE_7B
    assert any(f"{2 * BASE_7B / GiB:.1f} GiB host <-> GPU per step" in n for n in moved.notes)


def test_merged_weights_and_the_torch_engine_still_drop_them() -> None:
    for sets in (["lora.sync=merged"], ["rollout.engine=torch"], ["lora.rank=0"]):
        assert estimate(lora_7b(*sets)).sleep_level == SLEEP_DROP, sets
    assert handoff.trainer_sleep_level(lora_7b(), adapters=False, device="cuda",
                                       vocab_size=10) == handoff.TRAINER_SLEEP_LEVEL == 2
    # Off CUDA nothing sleeps (no sleep mode): the adapter engine's choice is the safe one.
    assert handoff.trainer_sleep_level(lora_7b(), adapters=True, device="cpu",
                                       vocab_size=10) == SLEEP_OFFLOAD


class RecordingLLM:
    """Stands in for `vllm.LLM`: records the sleep-mode calls the engine makes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep({level})")

    def release_kv_cache_memory(self) -> None:
        self.calls.append("release_kv_cache_memory")

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(f"wake_up({tags})")


def recording_engine() -> tuple[VllmEngine, RecordingLLM]:
    """A `VllmEngine` whose `llm` is a `RecordingLLM` (nothing else of it is used here)."""
    engine = object.__new__(VllmEngine)
    llm = RecordingLLM()
    engine.llm, engine.enable_sleep_mode, engine._asleep = llm, True, set()
    return engine, llm


def test_level_zero_releases_the_kv_cache_and_keeps_the_weights() -> None:
    engine, llm = recording_engine()
    handoff.to_trainer(engine, level=SLEEP_KV_ONLY)
    assert llm.calls == ["sleep(0)", "release_kv_cache_memory"] and engine.asleep
    handoff.wake_for_load(engine, "cpu")  # the weights never slept: nothing to wake
    handoff.wake_for_generate(engine, "cpu")
    assert llm.calls[2:] == ["wake_up(['kv_cache'])"] and not engine.asleep
    engine, llm = recording_engine()
    handoff.to_trainer(engine, level=SLEEP_OFFLOAD)  # level 1 as before: both come back
    handoff.wake_for_load(engine, "cpu")
    handoff.wake_for_generate(engine, "cpu")
    assert llm.calls == ["sleep(1)", "wake_up(['weights'])", "wake_up(['kv_cache'])"]
    with pytest.raises(ValueError, match="sleep level must be 0, 1 or 2, got 3"):
        engine.sleep(level=3)
