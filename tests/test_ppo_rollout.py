"""Rollout engines on CPU: the torch engine's log-probs are the trainer's (with top-k/top-p: plus
-log(mass kept), the behaviour policy's), sampling is seeded,
stops and weight loads behave, and the tiny models are built reproducibly.

"The trainer's" log-probs are computed by the code training runs (`columns.model_inputs`,
`forward.response_logprobs`: `tests.helpers.trainer_logprobs`), not by a copy of it."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from avrid.ppo.algo.logprobs import logprobs_from_logits
from avrid.ppo.data.columns import model_inputs
from avrid.ppo.engines.models import (
    TinyModelSpec,
    build_tiny_critic,
    build_tiny_policy,
    load_critic,
    load_policy,
    pad_left,
)
from avrid.ppo.engines.torch_engine import (
    Completion,
    RolloutEngine,
    SamplingParams,
    TorchEngine,
    cache_argument,
)
from avrid.ppo.roles.forward import forward, response_logprobs, response_values
from tests.helpers import trainer_batch, trainer_logprobs

pytestmark = pytest.mark.chapter(5)

SPEC = TinyModelSpec(vocab_size=16, num_kv_heads=2)  # grouped-query attention on purpose
PAD, STOP = 0, 15
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11], [12, 13, 14, 1, 2]]  # unequal: left pads


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    return build_tiny_policy(SPEC, seed=0, eos_token_id=STOP, pad_token_id=PAD)


@pytest.fixture(scope="module")
def engine(policy: torch.nn.Module) -> TorchEngine:
    return TorchEngine(policy, pad_token_id=PAD)


def max_gap(policy: torch.nn.Module, prompts: list[list[int]], done: list[Completion],
            temperature: float) -> float:
    ref = trainer_logprobs(policy, prompts, done, temperature=temperature, pad_id=PAD)
    return max(float((torch.tensor(c.logprobs) - r).abs().max()) for c, r in zip(done, ref,
                                                                                 strict=True))


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 0), (0.7, 4), (1.3, 3)])
def test_rollout_logprobs_equal_trainer_logprobs(policy: torch.nn.Module, engine: TorchEngine,
                                                 temperature: float, top_k: int) -> None:
    # THE invariant of the chapter: the KV-cached sampler and the full-sequence trainer pass
    # give each sampled token the same log-prob, across left padding and temperature. With
    # top-k the engine reports the behaviour policy's (renormalised over the top k): the
    # trainer's full-vocabulary value plus -log(mass of the top k), and nothing else.
    for seed in range(3):
        params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k,
                                seed=seed)
        done = engine.generate(PROMPTS, params)
        assert all(len(c.token_ids) == 12 for c in done)
        if top_k == 0:
            assert max_gap(policy, PROMPTS, done, temperature) < 1e-5
            continue
        ref = trainer_logprobs(policy, PROMPTS, done, temperature=temperature, pad_id=PAD)
        for prompt, c, r in zip(PROMPTS, done, ref, strict=True):
            seq = torch.tensor([prompt + list(c.token_ids)])
            with torch.no_grad():
                logits = policy(input_ids=seq).logits[0, len(prompt) - 1:-1]
            kept = torch.softmax(logits / temperature, -1).topk(top_k, dim=-1).values.sum(-1)
            assert torch.allclose(torch.tensor(c.logprobs), r - kept.log(), atol=1e-5)


def test_top_k_samples_only_from_the_top_k(policy: torch.nn.Module, engine: TorchEngine) -> None:
    done = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, top_k=2, seed=3))
    for prompt, c in zip(PROMPTS, done, strict=True):
        seq = torch.tensor([prompt + list(c.token_ids)])
        logits = policy(input_ids=seq).logits[0, len(prompt) - 1:-1]
        top2 = logits.topk(2, dim=-1).indices
        assert all(t in top2[i].tolist() for i, t in enumerate(c.token_ids))
        # The recorded log-prob is of the top-2 distribution it was sampled from.
        full = logprobs_from_logits(logits, torch.tensor(c.token_ids))
        kept = torch.softmax(logits, -1).topk(2, dim=-1).values.sum(-1)
        assert torch.allclose(torch.tensor(c.logprobs), full - kept.log(), atol=1e-5)


def test_top_p_samples_only_from_the_nucleus(policy: torch.nn.Module,
                                            engine: TorchEngine) -> None:
    done = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, top_p=0.3, seed=5))
    for prompt, c in zip(PROMPTS, done, strict=True):
        seq = torch.tensor([prompt + list(c.token_ids)])
        with torch.no_grad():
            probs = torch.softmax(policy(input_ids=seq).logits[0, len(prompt) - 1:-1], -1)
        nucleus = []
        for i, t in enumerate(c.token_ids):
            # the mass of all more likely tokens, "before" a token, must be below top_p for
            # it to be in the nucleus
            before = torch.stack([probs[i][probs[i] > probs[i, v]].sum() for v in range(16)])
            assert before[t] < 0.3
            nucleus.append(probs[i][before < 0.3].sum())
        full = logprobs_from_logits(torch.log(probs), torch.tensor(c.token_ids))
        # renormalised over the nucleus: the distribution the token was sampled from
        assert torch.allclose(torch.tensor(c.logprobs), full - torch.stack(nucleus).log(),
                              atol=1e-5)


def test_same_seed_same_tokens_other_seed_other_tokens(engine: TorchEngine) -> None:
    params = SamplingParams(max_new_tokens=10, seed=7)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert first == again
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=8))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_generate_leaves_the_global_rng_alone(engine: TorchEngine) -> None:
    state = torch.get_rng_state()
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    assert torch.equal(state, torch.get_rng_state())


def test_rows_stop_at_a_stop_token_and_keep_it(policy: torch.nn.Module) -> None:
    # Every token a stop token except one: rows stop at once, unless they draw that one.
    engine = TorchEngine(policy, pad_token_id=PAD)
    stops = tuple(range(1, 16))
    params = SamplingParams(max_new_tokens=5, stop_token_ids=stops, seed=0)
    done = engine.generate(PROMPTS * 4, params)
    assert {c.finish_reason for c in done} == {"stop"}
    for c in done:
        assert 1 <= len(c.token_ids) <= 5 and len(c.logprobs) == len(c.token_ids)
        assert c.token_ids[-1] in stops and all(t == 0 for t in c.token_ids[:-1])
    # One rare stop token: most rows run to the limit, the rest end on it.
    done = engine.generate(PROMPTS * 4, SamplingParams(max_new_tokens=8, stop_token_ids=(STOP,),
                                                       seed=1))
    for c in done:
        assert len(c.token_ids) <= 8
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == STOP and STOP not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 8 and STOP not in c.token_ids
    assert max_gap(policy, PROMPTS * 4, done, 1.0) < 1e-5


def test_greedy_is_the_argmax_of_a_full_forward(policy: torch.nn.Module,
                                                engine: TorchEngine) -> None:
    done = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    for prompt, c in zip(PROMPTS, done, strict=True):
        seq = list(prompt)
        for _ in range(6):  # naive decoding: the whole sequence again for every token
            seq.append(int(policy(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert list(c.token_ids) == seq[len(prompt):]


def test_load_weights_makes_the_engine_generate_like_the_other_model() -> None:
    mine = build_tiny_policy(SPEC, seed=1)
    other = build_tiny_policy(SPEC, seed=2)
    engine = TorchEngine(mine, pad_token_id=PAD)
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    want = TorchEngine(other, pad_token_id=PAD).generate(PROMPTS, greedy)
    assert engine.generate(PROMPTS, greedy) != want
    engine.load_weights(other.named_parameters())
    assert engine.generate(PROMPTS, greedy) == want
    assert engine.model is mine  # copied in place, not swapped


def test_load_weights_names_the_offending_parameter() -> None:
    engine = TorchEngine(build_tiny_policy(SPEC, seed=1), pad_token_id=PAD)
    before = engine.model.lm_head.weight.clone()
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.upp\.weight"):
        engine.load_weights([("lm_head.weight", torch.zeros(16, 64)),
                             ("model.layers.0.mlp.upp.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        engine.load_weights([("model.norm.weight", torch.zeros(32))])
    assert torch.equal(engine.model.lm_head.weight, before)  # checked before copying


def test_batches_of_any_size_give_the_same_greedy_output(policy: torch.nn.Module,
                                                         engine: TorchEngine) -> None:
    prompts = PROMPTS * 3
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    small = TorchEngine(policy, pad_token_id=PAD, batch_size=5)
    chunked, whole = small.generate(prompts, greedy), engine.generate(prompts, greedy)
    # Same tokens; the log-probs may differ in the last bit (other matmul shapes).
    assert [c.token_ids for c in chunked] == [c.token_ids for c in whole]
    for a, b in zip(chunked, whole, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    sampled = small.generate(prompts, SamplingParams(max_new_tokens=6, seed=4))
    assert sampled == small.generate(prompts, SamplingParams(max_new_tokens=6, seed=4))
    assert max_gap(policy, prompts, sampled, 1.0) < 1e-5


def test_sleep_and_wake_are_no_ops_on_cpu(engine: TorchEngine) -> None:
    params = SamplingParams(max_new_tokens=4, seed=2)
    before = engine.generate(PROMPTS, params)
    engine.sleep()
    engine.wake()
    assert engine.device.type == "cpu" and engine.generate(PROMPTS, params) == before


def test_torch_engine_is_a_rollout_engine(engine: TorchEngine) -> None:
    assert isinstance(engine, RolloutEngine)
    assert not isinstance(object(), RolloutEngine)


class RecordWarnings(logging.Handler):
    """Keeps every record at WARNING or above that reaches the logger it is added to."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_generate_uses_the_cache_api_of_the_installed_transformers(policy: torch.nn.Module,
                                                                  engine: TorchEngine) -> None:
    """transformers 5.24 deprecates the KV cache's old name both ways: a FutureWarning for
    every forward that receives ``past_key_values=``, and a logged warning when an output's
    ``.past_key_values`` is read. Neither may happen (the check bites on transformers >= 5.24;
    on older releases the old name is the only one, and the same code must use it)."""
    logged = RecordWarnings()
    library_logger = logging.getLogger("transformers")  # its records reach here, propagated
    library_logger.addHandler(logged)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            done = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=3))
    finally:
        library_logger.removeHandler(logged)
    assert [r.getMessage() for r in logged.records] == [], transformers.__version__
    assert max_gap(policy, PROMPTS, done, 1.0) < 1e-5  # and the cache was really used


def test_the_cache_argument_is_the_name_the_forward_takes() -> None:
    class OldLM(torch.nn.Module):  # transformers < 5.24
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            raise NotImplementedError

    class NewLM(torch.nn.Module):  # transformers >= 5.24
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            raise NotImplementedError

    assert cache_argument(OldLM()) == "past_key_values"
    assert cache_argument(NewLM()) == "cache"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 2, "temperature": 0.0}, "temperature"),
    ({"max_new_tokens": 2, "temperature": float("nan")}, "temperature"),
    ({"max_new_tokens": 2, "greedy": True, "temperature": 0.5}, "temperature"),
    ({"max_new_tokens": 2, "top_k": -1}, "top_k"),
    ({"max_new_tokens": 2, "stop_token_ids": [1]}, "stop_token_ids"),
])
def test_sampling_params_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"vocab_size": 0}, "vocab_size"),
    ({"vocab_size": 16, "num_layers": 0}, "num_layers"),
    ({"vocab_size": 16, "hidden_size": 2.5}, "hidden_size"),
    ({"vocab_size": 16, "num_heads": 3}, "num_heads"),
    ({"vocab_size": 16, "num_kv_heads": 3}, "num_kv_heads"),
    ({"vocab_size": 16, "max_positions": -1}, "max_positions"),
])
def test_tiny_model_spec_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TinyModelSpec(**kwargs)


def test_tiny_policy_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b = build_tiny_policy(SPEC, seed=3), build_tiny_policy(SPEC, seed=3)
    assert torch.equal(state, torch.get_rng_state())
    c = build_tiny_policy(SPEC, seed=4)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert type(a).__name__ == "Qwen2ForCausalLM"
    assert "model.layers.1.self_attn.k_proj.weight" in dict(a.named_parameters())
    with pytest.raises(ValueError, match="eos_token_id"):
        build_tiny_policy(SPEC, seed=0, eos_token_id=16)


def test_trainer_forward_shapes_for_the_policy_and_the_critic() -> None:
    x = model_inputs(trainer_batch([[1, 2], [5]], [[3, 4], [6]]), PAD)  # (2, 4) right-padded
    critic = build_tiny_critic(SPEC, seed=0)
    values = response_values(critic, x)
    assert values.shape == (2, 2) and values.dtype == torch.float32
    policy = build_tiny_policy(SPEC, seed=0)
    assert forward(policy, x).shape == (2, 4, 16)
    logp, entropy = response_logprobs(policy, x, 1.0, with_entropy=True)
    assert logp.shape == entropy.shape == (2, 2)


def test_engine_left_padding_and_trainer_right_padding_give_the_same_values() -> None:
    # Position ids count from each row's first real token, so the engine's left padding
    # (`pad_left`) and the trainer's right padding (`model_inputs`) see the same numbers.
    critic = build_tiny_critic(SPEC, seed=0)
    seqs = [[1, 2, 3, 4, 5], [6, 7]]
    ids, mask, pos = pad_left(seqs, PAD)
    with torch.no_grad():
        left = critic(input_ids=ids, attention_mask=mask, position_ids=pos,
                      use_cache=False).logits.squeeze(-1)
        right = forward(critic, model_inputs(trainer_batch(seqs, [[], []]), PAD)).squeeze(-1)
    assert torch.allclose(left[1, 3:], right[1, :2], atol=1e-5)
    assert torch.allclose(left[0], right[0], atol=1e-5)


def test_save_and_load_round_trip(tmp_path: Path, policy: torch.nn.Module) -> None:
    policy.save_pretrained(tmp_path)
    loaded = load_policy(tmp_path)
    x = model_inputs(trainer_batch(PROMPTS, [[3, 4, 5]] * len(PROMPTS)), PAD)
    with torch.no_grad():
        assert torch.equal(forward(loaded, x), forward(policy, x))
        critic = load_critic(tmp_path)  # decoder from the checkpoint, a fresh score head
        assert response_values(critic, x).shape == x.response_ids.shape
    assert torch.equal(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_policy(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_critic(tmp_path / "nowhere")
