"""bf16 training keeps fp32 master weights: FSDP2 mixed precision, a bf16 engine, checked syncs.

With `model.dtype=bfloat16` the actor and critic hold fp32 parameters and AdamW state and only
compute in bf16 (`fsdp.shard_model`'s `MixedPrecisionPolicy`, over a 1-rank group for dp=1);
the rollout engine holds bf16 and the weight sync casts the shards before they move. These
tests run on Ray (a bf16 run needs a process group per role) with tiny models and budgets.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from avrid.ppo.driver.run import train
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.outputs.checkpoint import latest_checkpoint, load_checkpoint
from avrid.ppo.outputs.shards import read_model_weights
from avrid.ppo.roles import fsdp
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.workers import Mesh, RayBackend, ResourcePool, RoleSpec, Worker, plan_placement
from tests.test_ppo_trainer import algorithmic

pytestmark = pytest.mark.chapter(5)

SPEC = TinyModelSpec(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=4)


def tiny(out: Path, *extra: str, dtype: str = "bfloat16",
         backend: str = "ray") -> PPOConfig:
    """A seconds-long run, one rank per role: 8 prompts x 4 responses, one optimizer step."""
    return with_overrides(preset("tiny-ppo"), [
        f"model.dtype={dtype}", f"placement.backend={backend}", "placement.actor_dp=1",
        "placement.critic_dp=1", "train.steps=3", "train.prompts_per_step=8",
        "algo.responses_per_prompt=4", "train.mini_batch_size=32", "train.val_prompts=8",
        "train.val_every=1000", "train.progress=false", f"train.out_dir={out}", *extra])


def changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Fraction of elements that differ between two snapshots of the same tensors."""
    diff = sum(int((a[n] != b[n]).sum()) for n in a)
    return diff / sum(t.numel() for t in a.values())


@pytest.mark.slow
def test_a_tiny_lr_step_moves_the_fp32_masters_and_the_bf16_engine(
        tmp_path: Path, ray_cluster: None) -> None:
    # lr 1e-6: in bf16 (8 mantissa bits) a weight of size ~0.02 has a spacing of ~1e-4, so an
    # AdamW step of ~lr rounds away; the fp32 masters (spacing ~2e-9) keep every update.
    cfg = tiny(tmp_path, "train.actor_lr=1e-6", "train.critic_lr=1e-6")
    with Trainer(cfg) as trainer:
        trainer.start()
        before = trainer.policy.call(PolicyWorker.state)[0].weights
        engine_before = trainer.policy.call(PolicyWorker.engine_weights)[0]
        trainer.train_step(0)
        state = trainer.policy.call(PolicyWorker.state)[0]
        after = state.weights
        engine_after = trainer.policy.call(PolicyWorker.engine_weights)[0]
    assert {t.dtype for t in after.values()} == {torch.float32}
    moments = [v for s in state.optimizer["state"].values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert moments and {v.dtype for v in moments} == {torch.float32}
    # Every element with a gradient moves (AdamW's first step is ~lr * sign(grad)); only
    # embedding rows of tokens absent from the batch keep theirs (weight_decay is 0).
    master = changed(before, after)
    assert master > 0.9, master
    # The engine holds exactly the bf16 cast of the new masters (parameters bf16, buffers as
    # built), so only elements whose update crossed a bf16 rounding boundary flip.
    params = {n: t for n, t in engine_after.items() if n in after}
    assert {t.dtype for t in params.values()} == {torch.bfloat16}
    for name, t in params.items():
        assert t.equal(after[name].to(torch.bfloat16)), name
    flipped = changed({n: engine_before[n] for n in params}, params)
    print(f"lr=1e-6, one step: {master:.1%} of fp32 master elements changed, "
          f"{flipped:.2%} of the bf16 engine's")
    assert 0 < flipped < master


@pytest.mark.slow
def test_a_bf16_run_tracks_an_fp32_run(tmp_path: Path, ray_cluster: None) -> None:
    # Two mini-batches per step, so the actor loss is not just -mean(whitened advantages) ~ 0.
    # fp32 in-process: the same metrics as fp32 on Ray (test_ppo_trainer), in less time.
    # The trainer's forward as the engine's decode computes it (eager attention, padded rows),
    # so that the log-prob gap below measures the weights alone. With the defaults (SDPA,
    # packed rows) bf16 rounds differently in the two computations: gap 2.3e-4 measured.
    same_forward = ("memory.attention=eager", "memory.pack_sequences=false")
    ref = train(tiny(tmp_path / "fp32", "train.mini_batch_size=16", *same_forward,
                     dtype="float32", backend="inprocess")).rows
    low = train(tiny(tmp_path / "bf16", "train.mini_batch_size=16", *same_forward)).rows
    assert [r["step"] for r in low] == [r["step"] for r in ref] == [0, 1, 2, 3]
    for a, b in zip(ref[1:], low[1:], strict=True):
        print(f"step {a['step']}: actor loss {a['actor/loss']:+.6f} (fp32) "
              f"{b['actor/loss']:+.6f} (bf16), critic loss {a['critic/loss']:.6f} "
              f"{b['critic/loss']:.6f}, bf16 logprob gap {b['rollout/logprob_gap']:.1e}")
        # Measured (seed 0, 3 steps): the same samples; |actor loss difference| <= 1.5e-4 on
        # losses of size ~1e-2 (a mean of +-ratio*advantage terms, near 0, so an absolute
        # bound) and critic losses within 0.6% — bf16's own rounding (2**-8 = 0.4%) on each
        # forward. The bounds leave ~6x margin over those measurements.
        assert math.isclose(b["actor/loss"], a["actor/loss"], rel_tol=0.0, abs_tol=1e-3)
        assert math.isclose(b["critic/loss"], a["critic/loss"], rel_tol=0.03)
        # The engine holds exactly the bf16 weights the actor gathers, so the rollout's and
        # the trainer's log-probs agree (measured 0.0); fp32 against bf16 weights of this
        # model differ by ~7e-4 per token on average (measured), well above this bound.
        assert b["rollout/logprob_gap"] < 1e-4


@pytest.mark.slow
def test_a_resumed_bf16_run_matches_an_uninterrupted_one(tmp_path: Path,
                                                        ray_cluster: None) -> None:
    # Exact only if the checkpoint holds the fp32 masters: bf16 weights would lose their low
    # bits on the way through and the resumed step would differ.
    full = train(tiny(tmp_path / "full")).rows
    out = tmp_path / "split"
    train(tiny(out, "train.steps=2"))
    resumed = train(tiny(out, "train.resume=true")).rows
    assert algorithmic(resumed)[3:] == algorithmic(full)[3:]
    a = load_checkpoint(latest_checkpoint(tmp_path / "full" / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    assert a.step == b.step == 3
    for model in ("actor", "critic"):
        wa, wb = read_model_weights(a.sharded[model]), read_model_weights(b.sharded[model])
        assert {t.dtype for t in wa.values()} == {torch.float32}
        for name, t in wa.items():
            assert t.equal(wb[name]), f"{model}.{name} differs after resume"


class ShardWorker(Worker):
    """Applies `fsdp.shard_model` with bf16 compute over its group (1 or 2 ranks)."""

    def check(self) -> dict[str, object]:
        torch.manual_seed(0)
        group = self.init_distributed("gloo")
        try:
            model = build_tiny_policy(SPEC, seed=0)
            plain = fsdp.cast_parameters(copy.deepcopy(model), torch.bfloat16)
            sharded = fsdp.shard_model(model.eval(), group, self.identity.world_size, "cpu",
                                       compute_dtype=torch.bfloat16)
            ids = torch.randint(0, SPEC.vocab_size, (2, 12))
            logits = sharded(input_ids=ids, use_cache=False).logits
            logits.float().logsumexp(-1).mean().backward()
            with torch.no_grad():
                want = plain(input_ids=ids, use_cache=False).logits
            shards = fsdp.local_shards(sharded)  # after a backward: resharded fp32
            return {"logits": str(logits.dtype), "same_as_bf16_copy": bool(logits.equal(want)),
                    "params": sorted({str(p.dtype) for p in sharded.parameters()}),
                    "grads": sorted({str(p.grad.dtype) for p in sharded.parameters()}),
                    "shard_rows": sum(t.shape[0] for t in shards.values())}
        finally:
            self.destroy_distributed()


@pytest.mark.slow
def test_shard_model_mixed_precision_on_one_and_two_ranks(ray_cluster: None) -> None:
    plan = plan_placement(
        [ResourcePool.uniform("one", 1, cpus=1), ResourcePool.uniform("two", 2, cpus=1)],
        [RoleSpec(role="one", worker=ShardWorker, mesh=Mesh.of(dp=1), pool="one"),
         RoleSpec(role="two", worker=ShardWorker, mesh=Mesh.of(dp=2), pool="two")])
    with RayBackend(placement_timeout_s=30).launch(plan) as cluster:
        pending = [cluster.group(r, ShardWorker).submit(ShardWorker.check) for r in ("one", "two")]
        one, two = (p.result() for p in pending)
    whole = sum(p.shape[0] for p in build_tiny_policy(SPEC, seed=0).parameters())
    for out in [*one, *two]:
        assert out["logits"] == "torch.bfloat16"
        # The gathered bf16 weights are exactly the cast fp32 ones: the same function as a
        # model that holds bf16 parameters (the rollout engine).
        assert out["same_as_bf16_copy"]
        assert out["params"] == out["grads"] == ["torch.float32"]
    assert one[0]["shard_rows"] == whole
    assert two[0]["shard_rows"] + two[1]["shard_rows"] == whole


def test_fp32_on_one_rank_stays_a_plain_module_and_bf16_needs_a_group() -> None:
    model = build_tiny_policy(SPEC, seed=0)
    assert fsdp.shard_model(model, None, 1, "cpu") is model
    with pytest.raises(ValueError, match="needs a process group"):
        fsdp.shard_model(model, None, 1, "cpu", compute_dtype=torch.bfloat16)


def test_bf16_with_the_in_process_backend_is_refused_naming_the_fields() -> None:
    with pytest.raises(ValueError, match=r"model\.dtype.*placement\.backend='ray'"):
        with_overrides(preset("tiny-ppo"), ["placement.backend=inprocess",
                                            "placement.actor_dp=1", "placement.critic_dp=1",
                                            "model.dtype=bfloat16"])
