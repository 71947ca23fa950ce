"""Truncated responses (finish reason "length") from the engines to the losses, and the KL
estimator the config refuses in the loss.

The finish reason comes from the rollout engine, travels as the per-sample scalar "truncated"
out of `PolicyWorker.generate` into the step's batch, is logged as `rollout/truncation_rate`,
and `algo.truncation` decides what it does: "keep", "mask" (no loss weight; the gradient side
is pinned in test_ppo_updates.py) or "penalty" (a lower score before the advantages).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from avrid.dispatch import Batch, Shard
from avrid.ppo.driver.run import train
from avrid.ppo.driver.trainer import compute_advantages
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.engines.torch_engine import SamplingParams, TorchEngine
from avrid.ppo.engines.vllm_engine import _completion
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.results import merge_metrics
from avrid.workers import WorkerIdentity

pytestmark = pytest.mark.chapter(5)

T = torch.tensor


# ---- config ----------------------------------------------------------------------------------

def test_k1_in_the_loss_is_refused_with_the_reason_and_the_sound_choices() -> None:
    with pytest.raises(ValueError, match=r"algo\.kl_kind") as err:
        with_overrides(PPOConfig(), ["algo.kl_coef=0.01", "algo.kl_in=loss", "algo.kl_kind=k1"])
    message = str(err.value)
    assert "expectation" in message and "k2" in message and "k3" in message
    assert "kl_in=reward" in message
    # k1 in the reward is sound (its value is an unbiased KL estimate), and so are k2/k3 anywhere.
    for kind, where in (("k1", "reward"), ("k2", "loss"), ("k3", "loss"), ("k2", "reward")):
        with_overrides(PPOConfig(), ["algo.kl_coef=0.01", f"algo.kl_in={where}",
                                     f"algo.kl_kind={kind}"])


@pytest.mark.parametrize("overrides, field", [
    (["algo.truncation=drop"], "algo.truncation"),
    (["algo.truncation=penalty", "algo.truncation_penalty=0"], "algo.truncation_penalty"),
    (["algo.truncation_penalty=-1"], "algo.truncation_penalty"),
    (["algo.truncation_penalty=nan"], "algo.truncation_penalty"),
    (["algo.truncation_penalty=inf"], "algo.truncation_penalty"),
])
def test_bad_truncation_settings_name_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        with_overrides(PPOConfig(), overrides)


# ---- compute_advantages on hand-made batches ----------------------------------------------

def scored_batch(truncated: list[int] | None) -> Batch:
    """One GRPO group of 4 responses of 2 tokens, scores [1, 1, 0, 0]; values 0 (for PPO)."""
    n = 4
    scalars = {"score": T([1.0, 1.0, 0.0, 0.0]), "group": torch.zeros(n, dtype=torch.int64)}
    if truncated is not None:
        scalars["truncated"] = T(truncated)
    return Batch.from_rows(sample_ids=range(n), prompt_lens=[1] * n, response_lens=[2] * n,
                           packed={"tokens": [T([3, 4, 5])] * n,
                                   "values": [torch.zeros(2)] * n,
                                   "old_logp": [torch.zeros(2)] * n},
                           scalars=scalars)


def advantages(batch: Batch, algo: str, *extra: str) -> tuple[list[float], list[float]]:
    """(first-token advantage per sample, loss_mask per sample)."""
    cfg = with_overrides(PPOConfig(), [f"algo.name={algo}", "algo.grpo_norm_by_std=false",
                                       "algo.whiten_advantages=false", "algo.kl_coef=0",
                                       *extra])
    out = compute_advantages(batch, cfg)
    adv = out.packed["advantages"]
    return ([round(float(adv.row(i)[0]), 6) for i in range(len(out))],
            out.scalars["loss_mask"].tolist())


def test_keep_trains_on_truncated_responses_as_before() -> None:
    # Dr.GRPO: A = s - mean(s) = [1, 1, 0, 0] - 0.5.
    assert advantages(scored_batch([0, 1, 0, 1]), "grpo") == ([0.5, 0.5, -0.5, -0.5], [1.0] * 4)
    # A hand-made batch without the column is fine for "keep" (nothing reads it).
    assert advantages(scored_batch(None), "grpo") == ([0.5, 0.5, -0.5, -0.5], [1.0] * 4)


def test_penalty_lowers_the_score_before_the_group_statistics() -> None:
    # Penalty 0.5 on samples 1 and 3: s = [1, 0.5, 0, -0.5], mean 0.25,
    # A = s - 0.25 = [0.75, 0.25, -0.25, -0.75].
    got = advantages(scored_batch([0, 1, 0, 1]), "grpo", "algo.truncation=penalty",
                     "algo.truncation_penalty=0.5")
    assert got == ([0.75, 0.25, -0.25, -0.75], [1.0] * 4)


def test_penalty_lowers_the_ppo_return() -> None:
    # PPO, gamma = lam = 1, V = 0, no whitening: A_t = the (penalised) score at every token:
    # [1, 1 - 2, 0, 0 - 2] with penalty 2.
    got = advantages(scored_batch([0, 1, 0, 1]), "ppo", "algo.truncation=penalty",
                     "algo.truncation_penalty=2")
    assert got == ([1.0, -1.0, 0.0, -2.0], [1.0] * 4)


def test_mask_zeroes_the_loss_weight_of_truncated_responses_only() -> None:
    # Scores unchanged (the group statistics still see every sample); loss_mask = 1 - truncated.
    for algo in ("grpo", "ppo"):
        adv, keep = advantages(scored_batch([0, 1, 0, 1]), algo, "algo.truncation=mask")
        assert keep == [1.0, 0.0, 1.0, 0.0]
    assert adv == [1.0, 1.0, 0.0, 0.0]  # PPO with V = 0: A = score


@pytest.mark.parametrize("choice", ["mask", "penalty"])
def test_a_batch_without_the_finish_reason_is_refused(choice: str) -> None:
    with pytest.raises(ValueError, match=f"algo.truncation='{choice}'.*'truncated'"):
        advantages(scored_batch(None), "grpo", f"algo.truncation={choice}")


# ---- the finish reason from the engines to the batch -----------------------------------------

def vllm_output(ids: list[int], reason: str) -> SimpleNamespace:
    """A stand-in for vLLM's CompletionOutput: token ids, per-token log-prob dicts, reason."""
    return SimpleNamespace(token_ids=ids, finish_reason=reason,
                           logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in ids])


def test_vllm_finish_reason_means_what_the_torch_engines_does() -> None:
    # vLLM checks max_tokens before the stop tokens: a stop token drawn as the last allowed
    # token comes back as "length". The response did finish: it must read "stop".
    assert _completion(vllm_output([5, 7, 2], "length"), (2, 3)).finish_reason == "stop"
    assert _completion(vllm_output([5, 7, 9], "length"), (2, 3)).finish_reason == "length"
    assert _completion(vllm_output([5, 3], "stop"), (2, 3)).finish_reason == "stop"


def test_torch_engine_calls_a_stop_at_the_last_allowed_token_a_stop() -> None:
    # Every token but 0 stops: with max_new_tokens=1 each row ends on its first token, so a
    # row that drew a stop token ended by choice, one that drew 0 was cut off.
    engine = TorchEngine(build_tiny_policy(TinyModelSpec(vocab_size=16), seed=0),
                         pad_token_id=0)
    done = engine.generate([[1, 2]] * 32, SamplingParams(max_new_tokens=1,
                                                         stop_token_ids=tuple(range(1, 16))))
    assert all((c.finish_reason == "stop") == (c.token_ids[-1] != 0) for c in done)
    assert any(c.finish_reason == "stop" for c in done)


def test_generate_returns_the_truncated_column_and_its_rate() -> None:
    cfg = with_overrides(PPOConfig(), ["placement.backend=inprocess", "placement.actor_dp=1",
                                       "placement.critic_dp=1", "model.hidden_size=32",
                                       "model.num_heads=2"])
    stops = (1, 2, 3, 4)  # a quarter of the vocabulary stops: some rows finish, some not
    worker = PolicyWorker(WorkerIdentity(role="policy", rank=0, world_size=1), config=cfg,
                          vocab_size=16, eos_id=1, pad_id=0, stop_ids=stops,
                          max_response_tokens=3)
    worker.setup()
    n = 24
    prompts = Batch.from_rows(sample_ids=range(n), prompt_lens=[2] * n,
                              response_lens=[0] * n, packed={"tokens": [T([5, 6])] * n})
    result = worker.generate(Shard(index=0, batch=prompts, micro_bounds=(0, n)),
                             max_new_tokens=3, greedy=False, seed=0)
    out = result.outputs
    truncated = out.scalars["truncated"].tolist()
    response = out.packed["response"]
    for i, flag in enumerate(truncated):
        row = response.row(i).tolist()
        assert flag == int(len(row) == 3 and row[-1] not in stops), (row, flag)
    assert 0 < sum(truncated) < n, "the seed should give both kinds"
    rate = merge_metrics(result.metrics)["rollout/truncation_rate"].value
    assert rate == pytest.approx(sum(truncated) / n)


def test_a_run_logs_the_truncation_rate_and_trains_with_each_choice(tmp_path: Path) -> None:
    # End to end: generate -> batch -> advantages -> updates, for every choice, in-process.
    for choice in ("keep", "mask", "penalty"):
        cfg = with_overrides(preset("tiny-grpo"), [
            "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
            "train.steps=1", "train.prompts_per_step=4", "algo.responses_per_prompt=4",
            "train.mini_batch_size=16", "train.val_prompts=4", "train.progress=false",
            f"train.out_dir={tmp_path / choice}", f"algo.truncation={choice}"])
        rows = train(cfg).rows
        step = rows[1]
        assert 0.0 <= step["rollout/truncation_rate"] <= 1.0
        assert 0.0 <= rows[0]["val/truncation_rate"] <= 1.0
        assert all(math.isfinite(v) for v in step.values() if isinstance(v, float))
