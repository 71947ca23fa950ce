"""Chapter 4 into the real vLLM engine (`vllm` tier: vLLM's CPU build here, CUDA on GPUs).

What `tests/test_reshard_engines.py` checks against fake fused tensors, checked inside vLLM:

- full-tensor loads switch an engine from checkpoint A to B: its outputs then equal a fresh
  engine built on B, and the fingerprints it reports are B's;
- a load resets the prefix cache (vLLM would otherwise reuse KV blocks of the old weights);
- the minimum-bytes slice path: each TP rank's regions (what chapter 4's executor delivers
  from FSDP shards, bit-identical: `test_reshard_execute.py`) loaded into a real
  tensor_parallel_size=2 engine, fingerprint-checked, generating what a TP=1 engine with
  the full weights generates. On CPU vLLM's TP=2 runs two worker processes over gloo; on
  CUDA it needs two GPUs, so it is a twin test marked ``gpu(count=2)`` (the CPU one skips
  there: under ``pytest --gpus`` a ``vllm`` test alone is given one GPU).

One engine at a time (vLLM's parallel state is process-global), so each test closes its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.engines.torch_engine import SamplingParams
from avrid.reshard import ModelLayout, check_same, fingerprint
from avrid.reshard.fingerprint import StaleWeightsError
from avrid.reshard.tp_layout import decoder_tp_layout

pytestmark = [pytest.mark.chapter(4), pytest.mark.vllm]

SPEC = TinyModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=2, num_kv_heads=2, max_positions=256)
HEAD_DIM = 64  # hidden 128 / 2 heads: a size vLLM's CPU attention accepts
PROMPTS = [[5, 17, 301, 44, 9, 128, 77], [3], [250, 251, 252], list(range(100, 140))]
GREEDY = SamplingParams(max_new_tokens=12, greedy=True)


def save(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """A tiny policy with a sharpened head (greedy far from ties) saved to `path`."""
    policy = build_tiny_policy(SPEC, seed=seed, pad_token_id=0)
    with torch.no_grad():
        policy.lm_head.weight.mul_(4.0)
    policy.save_pretrained(path)
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


def engine(path: Path, **kwargs: object):  # noqa: ANN201 (VllmEngine)
    from avrid.ppo.engines.vllm_engine import VllmEngine

    return VllmEngine(str(path), max_model_len=256, seed=0, dtype="float32", **kwargs)


def fresh_greedy(path: Path) -> list:
    """Greedy completions of PROMPTS from a new TP=1 engine on the checkpoint at `path`."""
    eng = engine(path)
    try:
        return eng.generate(PROMPTS, GREEDY)
    finally:
        eng.close()


def whole(weights: dict[str, torch.Tensor]) -> ModelLayout:
    """One rank holding every tensor whole: the layout of an engine without TP."""
    return ModelLayout.fsdp({n: (tuple(t.shape), t.dtype) for n, t in weights.items()}, 1)


def tokens(done: list) -> list[tuple[int, ...]]:
    return [c.token_ids for c in done]


def test_full_load_switches_a_to_b_like_a_fresh_engine(tmp_path: Path) -> None:
    save(tmp_path / "a", seed=0)
    b = save(tmp_path / "b", seed=1)
    eng = engine(tmp_path / "a")
    try:
        before = tokens(eng.generate(PROMPTS, GREEDY))
        eng.load_weights(b.items())
        check_same(fingerprint(b).checksums, eng.checksums(whole(b)), where="vLLM after load")
        switched = eng.generate(PROMPTS, GREEDY)
    finally:
        eng.close()
    want = fresh_greedy(tmp_path / "b")
    assert tokens(switched) != before
    assert tokens(switched) == tokens(want)
    for got, ref in zip(switched, want, strict=True):  # same weights, same kernels
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-6)


def test_a_stale_engine_fails_the_fingerprint_check(tmp_path: Path) -> None:
    a = save(tmp_path / "a", seed=0)
    b = {n: t + 1e-3 for n, t in a.items()}
    eng = engine(tmp_path / "a")
    try:
        check_same(fingerprint(a).checksums, eng.checksums(whole(a)), where="vLLM on A")
        with pytest.raises(StaleWeightsError, match="lm_head.weight"):  # names what is stale
            check_same(fingerprint(b).checksums, eng.checksums(whole(a)), where="vLLM")
    finally:
        eng.close()


def test_a_load_resets_the_prefix_cache(tmp_path: Path) -> None:
    save(tmp_path / "a", seed=0)
    b = save(tmp_path / "b", seed=1)
    prompt = {"prompt_token_ids": list(range(100, 164))}  # 2 full blocks of 32: cacheable

    def cached_tokens() -> int:
        return eng.llm.generate([prompt], use_tqdm=False)[0].num_cached_tokens

    eng = engine(tmp_path / "a", enable_prefix_caching=True, block_size=32)
    try:
        cached_tokens()
        assert cached_tokens() > 0  # the cache is on and is hit
        eng.sink.load(b)  # new weights, no reset yet: vLLM still serves A's KV blocks
        assert cached_tokens() > 0  # the hazard a missing reset leaves behind
        eng.sink.finish()  # what every sync ends with (VllmEngine.load_weights included)
        assert cached_tokens() == 0  # nothing computed with A's weights is reused
    finally:
        eng.close()


@pytest.mark.slow
def test_slices_into_a_tp2_engine_match_a_tp1_engine(tmp_path: Path) -> None:
    """vLLM's CPU build: two worker processes over gloo on this machine."""
    # On CUDA, TP=2 needs two GPUs, which this test's markers do not ask for.
    if torch.cuda.is_available():
        pytest.skip("vLLM's CUDA build: the gpu(count=2) twin below runs it")
    tp2_slices_match_tp1(tmp_path)


@pytest.mark.gpu(count=2, duration_s=120)
@pytest.mark.slow
def test_slices_into_a_tp2_engine_match_a_tp1_engine_on_two_gpus(tmp_path: Path) -> None:
    """vLLM's CUDA build: TP=2 spans two GPUs, so `pytest --gpus` must give it two."""
    tp2_slices_match_tp1(tmp_path)


def tp2_slices_match_tp1(tmp_path: Path) -> None:
    """Each TP rank's regions of checkpoint A loaded into a TP=2 engine built with random
    weights: the fingerprints are A's and its greedy output is a TP=1 engine's on A."""
    full = save(tmp_path / "a", seed=3)
    shapes = {n: (tuple(t.shape), "float32") for n, t in full.items()}
    layout = decoder_tp_layout(shapes, 2, head_dim=HEAD_DIM)
    tp2 = engine(tmp_path / "a", tensor_parallel_size=2, load_format="dummy")
    try:
        random_weights = tokens(tp2.generate(PROMPTS, GREEDY))
        for rank in range(2):  # each rank gets only its own regions (the minimum bytes)
            mine = {n: full[n][layout[n].regions[rank].to_slices()].contiguous()
                    for n in full if layout[n].regions[rank] is not None}
            assert sum(t.numel() for t in mine.values()) < sum(t.numel() for t in full.values())
            tp2.sink.load(mine, layout=layout, rank=rank)
        tp2.sink.finish()
        check_same(fingerprint(full).checksums, tp2.sink.checksums(layout), where="TP=2 engine")
        sliced = tp2.generate(PROMPTS, GREEDY)
    finally:
        tp2.close()
    want = fresh_greedy(tmp_path / "a")  # a TP=1 engine reading the full checkpoint
    assert tokens(sliced) != random_weights
    assert tokens(sliced) == tokens(want)
    for got, ref in zip(sliced, want, strict=True):  # TP all-reduces: summation order only
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
