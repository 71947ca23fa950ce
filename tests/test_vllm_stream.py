"""vLLM's engine stepped by avrid, each response told as it ends (`vllm` tier: `make test-vllm`).

`VllmEngine.generate` with an ``on_finish`` (what ``rollout.stream_rewards`` passes through
`roles/streaming.py`) runs `vllm_stream.run_streamed` instead of ``LLM.generate``:

- the completions are the non-streamed call's bit for bit (token ids, log-probs, finish
  reasons), greedy and sampled, per-request and batch seeds, with a LoRA adapter served;
- a response that stops early is told while other rows still decode (the old code told
  every row after ``LLM.generate`` had returned);
- an ``on_finish`` that raises leaves no request in the engine: the next calls, streamed or
  not, give what they gave before.

One tiny fp32 engine (test_ppo_vllm.py's model shape) serves the module, built with LoRA
slots so that the last test can serve an adapter on it (vLLM allows one engine per process
at a time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

from avrid.ppo.engines.torch_engine import Completion, SamplingParams
from avrid.ppo.roles.adapter_sync import AdapterSync
from tests.test_ppo_vllm import PROMPTS
from tests.test_ppo_vllm_lora import adapted_policy

if TYPE_CHECKING:  # vllm is imported inside the engine only
    from avrid.ppo.engines.vllm_engine import VllmEngine

pytestmark = [pytest.mark.chapter(5), pytest.mark.vllm]

GROUP = [*PROMPTS, PROMPTS[1], PROMPTS[1]]  # a group of identical prompts: sampled, they differ


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    from avrid.ppo.engines.vllm_engine import VllmEngine

    path = tmp_path_factory.mktemp("vllm_stream") / "base"
    adapted_policy(seed=0)[0].save_pretrained(path)
    eng = VllmEngine(str(path), max_model_len=128, seed=0, dtype="float32",
                     enforce_eager=True, lora_rank=8)
    try:
        yield eng
    finally:
        eng.close()


class Told:
    """An ``on_finish`` that records each call with the number of the engine's requests
    still unfinished at that moment (0 once ``LLM.generate`` has returned)."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[int, Completion, int]] = []

    def __call__(self, i: int, completion: Completion) -> None:
        left = self.engine.llm.llm_engine.get_num_unfinished_requests()
        self.calls.append((i, completion, left))


def streamed(engine: VllmEngine, prompts: list[list[int]],
             params: SamplingParams) -> tuple[list[Completion], Told]:
    told = Told(engine)
    done = engine.generate(prompts, params, on_finish=told)
    # Each row told once, with the very completion returned for it.
    assert sorted(i for i, _, _ in told.calls) == list(range(len(prompts)))
    assert all(done[i] == c for i, c, _ in told.calls)
    return done, told


def an_early_stop(engine: VllmEngine,
                  params: SamplingParams) -> tuple[SamplingParams, int, int]:
    """`params` with a stop token that one row r of the call samples at its step k > 1 (not
    before) and no other row in its first eight steps, and (r, k): with it, row r ends
    after k tokens while the others go on."""
    done = [c.token_ids for c in engine.generate(GROUP, params)]
    for r, head in enumerate(done):
        later = {t for row, c in enumerate(done) if row != r for t in c[:8]}
        for k in range(2, 7):
            if head[k - 1] not in head[:k - 1] and head[k - 1] not in later:
                return dataclasses.replace(params, stop_token_ids=(head[k - 1],)), r, k
    raise AssertionError(f"no row stops early on a token of its own: {done}")


CASES = {"greedy": SamplingParams(max_new_tokens=12, greedy=True),
         "sampled": SamplingParams(max_new_tokens=12, temperature=0.8, seed=5)}


@pytest.mark.parametrize("seed_mode", ["request", "batch"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_completions_are_the_plain_ones_bit_for_bit(
        engine: VllmEngine, monkeypatch: pytest.MonkeyPatch, case: str,
        seed_mode: str) -> None:
    monkeypatch.setattr(engine, "seed_mode", seed_mode)  # one engine per process: switch it
    params = CASES[case]
    caller_rng = torch.random.get_rng_state()
    stopping, r, k = an_early_stop(engine, params)
    plain = engine.generate(GROUP, stopping)
    done, told = streamed(engine, GROUP, stopping)
    assert done == plain  # token ids, log-probs (floats compared exactly), finish reasons
    assert done[r].finish_reason == "stop" and len(done[r].token_ids) == k
    assert told.calls[0][0::2] == (r, len(GROUP) - 1)  # ... and row r told as it stopped
    assert {c.finish_reason for c in done} == {"stop", "length"}
    if seed_mode == "batch":  # the caller's RNG put back after the streamed loop too
        assert torch.equal(torch.random.get_rng_state(), caller_rng)
    if case == "sampled":
        assert len({done[1].token_ids, done[-2].token_ids, done[-1].token_ids}) > 1


def test_a_response_that_stops_early_is_told_while_others_decode(engine: VllmEngine) -> None:
    params, r, k = an_early_stop(engine, CASES["greedy"])
    _, told = streamed(engine, GROUP, params)
    first, completion, left = told.calls[0]
    assert (first, len(completion.token_ids), completion.finish_reason) == (r, k, "stop")
    # Told at the step it stopped: the other rows (12 tokens, or a later stop) still decode.
    assert left == len(GROUP) - 1
    assert told.calls[-1][2] == 0
    assert [left for _, _, left in told.calls] == sorted(
        (left for _, _, left in told.calls), reverse=True)


def test_an_on_finish_that_raises_leaves_the_engine_usable(engine: VllmEngine) -> None:
    params = an_early_stop(engine, CASES["sampled"])[0]  # raised while the others decode
    before = engine.generate(GROUP, params)

    def boom(i: int, completion: Completion) -> None:
        raise ValueError(f"reward queue closed at row {i}")

    with pytest.raises(ValueError, match="reward queue closed"):
        engine.generate(GROUP, params, on_finish=boom)
    assert not engine.llm.llm_engine.has_unfinished_requests()  # the others aborted
    assert engine.generate(GROUP, params) == before
    assert streamed(engine, GROUP, params)[0] == before


def test_streamed_with_a_served_adapter(engine: VllmEngine) -> None:
    params = CASES["sampled"]
    base = engine.generate(GROUP, params)
    adapted = adapted_policy(seed=0)[1]
    AdapterSync(adapted, rank=0, engine_dtype=torch.float32).run(adapted, engine, version=1)
    plain = engine.generate(GROUP, params)
    assert plain != base  # the adapter is applied ...
    assert streamed(engine, GROUP, params)[0] == plain  # ... streamed as well
