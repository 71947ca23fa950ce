"""Chapter 7 — the per-token "action_mask" column: the trainer trains on the policy's tokens only.

A multi-turn response interleaves the policy's tokens (actions) with observation tokens a tool
or an environment returned (`columns.ACTION_MASK`). Pinned here, from the column up:

- the mask itself (`columns.action_mask`, `columns.reads`, `Totals`), and bad values refused;
- advantages on the compressed view (`credit.ActionView`): GAE over the action tokens only,
  as if the observations were not there, 0 on observation tokens; all ones = no column;
- the actor's and critic's updates: nothing at an observation token (its advantage,
  old/ref/rollout log-probs, value, return) reaches the gradient; all ones = no column;
- whole in-process runs (PPO with a critic, GRPO) whose batches get a random action mask:
  all ones gives the metrics of no column bit for bit, and garbage rollout log-probs on
  observation tokens change nothing (with the off-policy correction on).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from avrid.dispatch import Batch, Packed, Shard
from avrid.ppo.algo.advantages import gae
from avrid.ppo.data.columns import (
    ACTION_MASK,
    Totals,
    action_mask,
    add_columns,
    model_inputs,
    packed,
    reads,
    response_mask,
)
from avrid.ppo.data.credit import ActionView, compute_advantages
from avrid.ppo.driver.run import train
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.forward import response_logprobs
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.workers import WorkerIdentity
from tests.helpers import GradRecorder, ragged_batch

pytestmark = pytest.mark.chapter(7)

VOCAB, PAD, EOS = 16, 0, 1
NORM_LEN = 6
PROMPT_LENS, RESPONSE_LENS = [2, 3, 1, 2], [5, 3, 4, 2]
ACTIONS = [[1, 1, 0, 0, 1], [0, 1, 1], [1, 0, 1, 1], [0, 0]]
"""One row [a a o o a] as in the brief, one starting with an observation, one without any
action token."""


def with_mask(batch: Batch, rows: list[list[int]] | None) -> Batch:
    """`batch` with the "action_mask" column `rows` (None: the batch as it is)."""
    if rows is None:
        return batch
    return add_columns(batch, packed={ACTION_MASK: Packed.from_rows(
        [torch.tensor(r, dtype=torch.int64) for r in rows])})


def scored(*, seed: int = 0) -> Batch:
    """Four responses to two prompts, with every column `compute_advantages` may read."""
    b = ragged_batch(PROMPT_LENS, RESPONSE_LENS, vocab=VOCAB, sample_ids=[10, 11, 12, 13],
                     columns={"values": 0.5, "old_logp": 0.3, "ref_logp": 0.3}, seed=seed,
                     scalars={"score": torch.tensor([1.0, 0.0, 0.5, 1.0]),
                              "group": torch.tensor([0, 0, 1, 1])})
    return b


def config(*overrides: str) -> PPOConfig:
    return with_overrides(PPOConfig(), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "model.hidden_size=32", "model.num_heads=2", "train.grad_clip=1e9", *overrides])


# ---- the mask, what is sent, what is counted ---------------------------------------------------

def test_action_mask_is_the_response_mask_times_the_column() -> None:
    b = scored()
    assert torch.equal(action_mask(b), response_mask(b))  # no column: every token is an action
    m = action_mask(with_mask(b, ACTIONS))
    assert m.tolist() == [[1, 1, 0, 0, 1], [0, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0]]
    x = model_inputs(with_mask(b, ACTIONS), PAD)
    assert torch.equal(x.action_mask, m) and torch.equal(x.response_mask, response_mask(b))
    floats = add_columns(b, packed={ACTION_MASK: packed(m, response_mask(b))})
    assert torch.equal(action_mask(floats), m)  # float 0/1 reads the same as int


@pytest.mark.parametrize("rows, match", [
    ([[1, 2, 0, 0, 1], [0, 1, 1], [1, 0, 1, 1], [0, 0]], "only 0 .* and 1"),
    ([[1, 1, 0, 0], [0, 1, 1], [1, 0, 1, 1], [0, 0]], "one value per response token"),
])
def test_a_bad_action_mask_is_refused_naming_the_column(rows: list, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        action_mask(with_mask(scored(), rows))
    assert "action_mask" in str(err.value)


def test_reads_sends_the_action_mask_only_when_the_batch_has_it() -> None:
    b = scored()
    assert set(reads(b, ("tokens",)).packed) == {"tokens"}
    assert set(reads(with_mask(b, ACTIONS), ("tokens",)).packed) == {"tokens", ACTION_MASK}
    with pytest.raises(KeyError, match="returns"):  # a required column still must be there
        reads(with_mask(b, ACTIONS), ("tokens", "returns"))


def test_totals_count_action_tokens_of_the_samples_that_train() -> None:
    b = with_mask(scored(), ACTIONS)
    assert Totals.of(b, NORM_LEN) == Totals(tokens=3 + 2 + 3, seqs=3, norm_len=NORM_LEN)
    kept = dataclasses.replace(b, scalars={**b.scalars,
                                           "loss_mask": torch.tensor([1.0, 0.0, 1.0, 1.0])})
    assert Totals.of(kept, NORM_LEN) == Totals(tokens=3 + 3, seqs=2, norm_len=NORM_LEN)
    ones = with_mask(scored(), [[1] * n for n in RESPONSE_LENS])
    assert Totals.of(ones, NORM_LEN) == Totals.of(scored(), NORM_LEN)


# ---- advantages --------------------------------------------------------------------------------

ESTIMATORS = [["algo.name=grpo"], ["algo.name=ppo", "algo.gamma=0.9", "algo.lam=0.8"],
              ["algo.name=rloo"], ["algo.name=reinforce_plus_plus", "algo.kl_coef=0.1",
                                   "algo.kl_in=reward"],
              ["algo.name=ppo", "algo.kl_coef=0.1", "algo.kl_in=reward"]]


@pytest.mark.parametrize("sets", ESTIMATORS, ids=lambda s: " ".join(s))
def test_an_all_ones_action_mask_gives_the_advantages_of_no_column(sets: list[str]) -> None:
    cfg = config(*sets)
    plain = compute_advantages(scored(), cfg)
    ones = compute_advantages(with_mask(scored(), [[1] * n for n in RESPONSE_LENS]), cfg)
    for name in ("advantages", "returns"):
        if name in plain.packed:
            assert torch.equal(plain.packed[name].values, ones.packed[name].values)


def test_compressed_gae_is_gae_over_the_action_tokens_only() -> None:
    cfg = config("algo.name=ppo", "algo.gamma=0.9", "algo.lam=0.8", "algo.kl_coef=0.1",
                 "algo.kl_in=reward", "algo.kl_kind=k1", "algo.whiten_advantages=false")
    b = with_mask(scored(), ACTIONS)
    out = compute_advantages(b, cfg)
    full = response_mask(b).bool()
    adv = torch.zeros(full.shape).masked_scatter(full, out.packed["advantages"].values)
    ret = torch.zeros(full.shape).masked_scatter(full, out.packed["returns"].values)
    pad = lambda name: torch.zeros(full.shape).masked_scatter(full, b.packed[name].values)  # noqa: E731
    values, kl = pad("values"), pad("old_logp") - pad("ref_logp")
    for i, row in enumerate(ACTIONS):
        at = [j for j, a in enumerate(row) if a]
        off = [j for j, a in enumerate(row) if not a]
        assert not adv[i, off].any() and not ret[i, off].any()  # observation tokens: 0
        if not at:
            continue
        # By hand: the action tokens alone, the score (minus nothing) at the last of them.
        r = -0.1 * kl[i, at]
        r[-1] += b.scalars["score"][i]
        want_adv, want_ret = gae(r[None], values[i, at][None], torch.ones(1, len(at)),
                                 gamma=0.9, lam=0.8)
        torch.testing.assert_close(adv[i, at], want_adv[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ret[i, at], want_ret[0], rtol=0, atol=1e-6)
    # Not the same as GAE over every response token: the observations are skipped steps.
    assert not torch.allclose(adv, torch.zeros(full.shape).masked_scatter(
        full, compute_advantages(scored(), cfg).packed["advantages"].values))


@pytest.mark.parametrize("sets", ESTIMATORS, ids=lambda s: " ".join(s))
def test_advantages_are_zero_off_the_action_tokens(sets: list[str]) -> None:
    b = with_mask(scored(), ACTIONS)
    out = compute_advantages(b, config(*sets))
    off = (response_mask(b) - action_mask(b)).bool()[response_mask(b).bool()]
    assert not out.packed["advantages"].values[off].any()
    assert bool(out.packed["advantages"].values[~off].ne(0).any())  # not vacuous


def test_action_view_round_trips_and_handles_an_empty_row() -> None:
    v = ActionView(torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    assert v.mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    full = torch.tensor([[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]])
    assert v.compress(full).tolist() == [[3.0, 5.0], [0.0, 0.0]]
    assert v.expand(v.compress(full)).tolist() == [[3.0, 0.0, 5.0], [0.0, 0.0, 0.0]]


# ---- the updates: observation tokens weigh nothing -----------------------------------------------

def identity(role: str) -> WorkerIdentity:
    return WorkerIdentity(role=role, rank=0, world_size=1)


def update_batch(worker: PolicyWorker, batch: Batch) -> Batch:
    """`batch` with old, reference and rollout log-probs of the worker's actor."""
    with torch.no_grad():
        x = model_inputs(batch, PAD)
        logp, _ = response_logprobs(worker.model, x, worker.config.rollout.temperature)
    mask = x.response_mask.bool()
    columns = {"old_logp": logp, "ref_logp": logp - 0.3, "rollout_logp": logp + 0.1}
    return add_columns(batch, packed={k: packed(v, mask) for k, v in columns.items()})


def garbled(batch: Batch, names: tuple[str, ...]) -> Batch:
    """`batch` with large random values in the `names` columns at observation tokens."""
    full = response_mask(batch).bool()
    obs = (response_mask(batch) - action_mask(batch)).bool()[full]
    g = torch.Generator().manual_seed(7)
    out = {n: Packed(values=torch.where(obs, 30 * torch.randn(obs.shape, generator=g),
                                        batch.packed[n].values), offsets=batch.packed[n].offsets)
           for n in names}
    return add_columns(batch, packed=out)


def grads(role: str, cfg: PPOConfig, rows: list[list[int]] | None,
          garble: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The gradient one update of `role` computes on the batch (two micro-batches)."""
    torch.manual_seed(0)
    base = ragged_batch(PROMPT_LENS, RESPONSE_LENS, vocab=VOCAB, sample_ids=[10, 11, 12, 13],
                        columns={"values": 0.5, "returns": 1.0, "advantages": 1.0}, seed=3)
    if role == "actor":
        worker = PolicyWorker(identity("policy"), config=cfg, vocab_size=VOCAB, eos_id=EOS,
                              pad_id=PAD, max_response_tokens=NORM_LEN)
    else:
        worker = CriticWorker(identity("critic"), config=cfg, vocab_size=VOCAB, pad_id=PAD)
    worker.setup()
    batch = with_mask(update_batch(worker, base) if role == "actor" else base, rows)
    batch = garbled(batch, garble) if garble else batch
    worker.optimizer = GradRecorder(worker.model)
    shard = Shard(index=0, batch=batch, micro_bounds=(0, 2, len(batch)))
    worker.update(shard, totals=Totals.of(batch, NORM_LEN), step=0)
    return worker.optimizer.grads


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys() and a
    return all(torch.equal(a[n], b[n]) for n in a)


ACTOR = ("advantages", "old_logp", "ref_logp", "rollout_logp")
CRITIC = ("values", "returns")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_observation_tokens_give_no_gradient(role: str, mode: str) -> None:
    cfg = config(f"algo.loss_agg={mode}", "algo.kl_coef=0.1", "algo.kl_kind=k3",
                 "algo.entropy_coef=0.01", "pipeline.correction=tis", "algo.value_clip=0.2")
    masked = grads(role, cfg, ACTIONS)
    garble = ACTOR if role == "actor" else CRITIC
    assert same(masked, grads(role, cfg, ACTIONS, garble))
    # All ones is no column, bit for bit; and the mask does change the gradient.
    assert same(grads(role, cfg, None), grads(role, cfg, [[1] * n for n in RESPONSE_LENS]))
    assert not same(masked, grads(role, cfg, None))


# ---- whole runs ----------------------------------------------------------------------------------

class MaskedTrainer(Trainer):
    """A trainer whose generated batches get an action mask before `learn` (what chapter 7's
    agents loop hands it): "ones", or "random" (the first token an action, the others one in
    two), with rollout_logp 0 on observation tokens ("random-garbage": -40 there)."""

    kind = "random"

    def learn(self, step, batch, phases):  # noqa: ANN001, ANN201 - as Trainer.learn
        g = torch.Generator().manual_seed(100 + step)
        rows = []
        for n in batch.response_lens.tolist():
            row = torch.ones(n, dtype=torch.int64)
            if self.kind != "ones" and n > 1:
                row[1:] = torch.randint(0, 2, (n - 1,), generator=g)
            rows.append(row)
        mask = Packed.from_rows(rows)
        fill = -40.0 if self.kind == "random-garbage" else 0.0
        rollout = batch.packed["rollout_logp"]
        logp = torch.where(mask.values.bool(), rollout.values, fill)
        batch = add_columns(batch, packed={ACTION_MASK: mask, "rollout_logp": Packed(
            values=logp, offsets=rollout.offsets)})
        return super().learn(step, batch, phases)


def run(out: Path, algo: str, kind: str | None) -> list[dict]:
    cfg = with_overrides(preset("tiny-ppo"), [
        f"algo.name={algo}", "placement.backend=inprocess", "placement.actor_dp=1",
        "placement.critic_dp=1", "train.steps=2", "train.prompts_per_step=4",
        "algo.responses_per_prompt=4", "train.mini_batch_size=8", "train.val_every=2",
        "train.val_prompts=8", "train.progress=false", "pipeline.correction=tis",
        "algo.kl_coef=0.05", f"train.out_dir={out}"])
    make = Trainer if kind is None else type("T", (MaskedTrainer,), {"kind": kind})
    rows = train(cfg, make_trainer=make).rows
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "sync/"))}
            for r in rows]


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_runs_with_an_action_mask_train_on_the_policys_tokens_only(tmp_path: Path,
                                                                   algo: str) -> None:
    plain = run(tmp_path / "plain", algo, None)
    assert run(tmp_path / "ones", algo, "ones") == plain  # all ones: no column, bit for bit
    masked = run(tmp_path / "random", algo, "random")
    # Garbage behaviour log-probs on observation tokens: no metric, no loss, no weight moves.
    assert run(tmp_path / "garbage", algo, "random-garbage") == masked
    assert masked != plain
    for row in masked[1:]:
        assert row["rollout/logprob_gap"] < 1e-5  # observation tokens (rollout_logp 0) ignored
        assert math.isfinite(row["actor/ref_kl"])  # a mean over the action tokens
