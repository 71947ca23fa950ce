"""Chapter 5: LoRA on the actor (issue 30, its first part). PEFT's adapters go in, the base is
frozen and outside AdamW; the adapted model starts as the base; the reference is the base
(adapters off) with no second copy; every sync sends the torch engine the merged weights,
which equal W + (alpha / r) B A and give the adapted model's log-probs; a checkpoint holds the
adapters only and a resumed run is the uninterrupted one; it runs with FSDP2 over two ranks
and in chapter 6's one-step-off mode. The export: `tests/test_ppo_lora_export.py`. vLLM
adapter serving is the vllm tier's (`tests/test_ppo_vllm_lora.py`, and chapter 6's push of
adapters in `tests/test_ppo_vllm_loop.py`)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from avrid.pipeline import make_trainer
from avrid.ppo.driver.run import train
from avrid.ppo.engines.models import build_tiny_policy, seeded_init, tiny_spec
from avrid.ppo.outputs.checkpoint import latest_checkpoint, load_checkpoint
from avrid.ppo.outputs.shards import read_model_weights
from avrid.ppo.roles import lora
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.lora import LoraConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.workers import WorkerIdentity
from tests.test_ppo_trainer import algorithmic

pytestmark = pytest.mark.chapter(5)

RANK, ALPHA = 4, 8.0


def tiny(out: Path, *extra: str, inprocess: bool = True) -> PPOConfig:
    """GRPO with LoRA on the actor and a KL term (so the reference runs), in seconds."""
    where = (["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1"]
             if inprocess else ["placement.cpus_per_worker=0.5", "train.call_timeout_s=120"])
    return with_overrides(preset("tiny-grpo"), [
        *where, "train.steps=3", "train.prompts_per_step=8", "algo.responses_per_prompt=4",
        "train.mini_batch_size=16", "train.val_prompts=16", "train.val_every=2",
        "train.progress=false", f"lora.rank={RANK}", f"lora.alpha={ALPHA}",
        "algo.kl_coef=0.05", "train.actor_lr=1e-2", f"train.out_dir={out}", *extra])


def policy(vocab: int = 16) -> torch.nn.Module:
    cfg = with_overrides(preset("tiny-grpo"), [])
    return build_tiny_policy(tiny_spec(cfg, vocab), seed=3, eos_token_id=1, pad_token_id=0,
                             dtype=torch.float32)


# ---- the adapters, on one model -----------------------------------------------------------------

def test_the_config_checks_each_field() -> None:
    assert not LoraConfig().enabled and LoraConfig(rank=8).enabled
    assert LoraConfig(target_modules="q_proj, v_proj").targets == ["q_proj", "v_proj"]
    for field, value, match in [("rank", -1, "lora.rank"), ("alpha", 0.0, "lora.alpha"),
                                ("dropout", 0.1, "lora.dropout"),
                                ("target_modules", "q_proj,,v", "lora.target_modules"),
                                ("sync", "both", "lora.sync")]:
        with pytest.raises(ValueError, match=match):
            LoraConfig(**{field: value})
    vllm = ["lora.rank=8", "rollout.engine=vllm", "model.num_heads=2"]  # head dim 32
    assert with_overrides(preset("tiny-grpo"), vllm).lora.sync == "adapter"  # the default
    for mode in ("one_step_off", "async"):  # pushed to a rollout pool: adapters or merged
        for sync in ("adapter", "merged"):
            assert with_overrides(preset("tiny-grpo"), [*vllm, f"pipeline.mode={mode}",
                                                        f"lora.sync={sync}"]).lora.enabled
    with pytest.raises(ValueError, match=r"lora.rank.*rank <= 512, got 600.*lora.sync=merged"):
        with_overrides(preset("tiny-grpo"), [*vllm, "lora.rank=600"])


def test_the_adapters_are_drawn_while_no_other_worker_of_the_process_draws() -> None:
    # In process, every worker builds its models on a thread of one process: A's draw from
    # torch's global RNG must wait while another worker seeds it and draws (the critic's
    # initialisation ran beside it, and two runs of one seed got different critics).
    inside, release, done = threading.Event(), threading.Event(), threading.Event()

    def other_worker() -> None:
        with seeded_init(1):
            inside.set()
            release.wait(30)

    model = policy()  # (built under the same lock)
    threading.Thread(target=other_worker, daemon=True).start()
    assert inside.wait(30)
    threading.Thread(target=lambda: (lora.attach(model, LoraConfig(rank=RANK), seed=5),
                                     done.set()), daemon=True).start()
    assert not done.wait(1.0), "the adapters were drawn while another worker drew"
    release.set()
    assert done.wait(30)
    again = lora.attach(policy(), LoraConfig(rank=RANK), seed=5)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(),
                                                 strict=True))


def test_adapters_start_as_the_base_train_alone_and_switch_off_for_the_reference() -> None:
    base = policy()
    x = torch.randint(2, 16, (3, 7))
    expected = base(x).logits
    model = lora.attach(policy(), LoraConfig(rank=RANK, alpha=ALPHA), seed=5)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(lora.is_adapter(n) for n in trained)
    assert torch.equal(model(x).logits, expected)  # B = 0: the base model's function
    again = lora.attach(policy(), LoraConfig(rank=RANK, alpha=ALPHA), seed=5)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(),
                                                 strict=True))  # same seed, same A
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.2)
    adapted = model(x).logits
    assert not torch.allclose(adapted, expected)
    with lora.adapters_off(model):
        assert torch.equal(model(x).logits, expected)
    assert torch.equal(model(x).logits, adapted)
    with pytest.raises(ValueError, match="matched no linear layer"):
        lora.attach(policy(), LoraConfig(rank=2, target_modules="nonexistent"), seed=0)


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if lora.is_adapter(n)}


def test_the_adapters_start_from_the_seed_whatever_was_drawn_before() -> None:
    # Two runs with the same seed start from the same A even when their processes drew
    # different random numbers before (a worker that built a critic, a resumed run); a
    # different seed gives a different A. Through the policy role too: from `train.seed`.
    config = LoraConfig(rank=RANK, alpha=ALPHA)
    torch.manual_seed(0)
    model = policy()
    state = torch.random.get_rng_state()
    first = adapters(lora.attach(model, config, seed=5))
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's own draws untouched
    torch.manual_seed(1)
    torch.rand(7)
    again = adapters(lora.attach(policy(), config, seed=5))
    assert again.keys() == first.keys()
    assert all(torch.equal(t, first[n]) for n, t in again.items()), "same seed, other adapters"
    other = adapters(lora.attach(policy(), config, seed=6))
    assert not any(torch.equal(t, first[n]) for n, t in other.items() if ".lora_A." in n)

    def role_adapters(seed: int, noise: int) -> dict[str, torch.Tensor]:
        cfg = with_overrides(preset("tiny-grpo"), [f"lora.rank={RANK}", f"train.seed={seed}"])
        worker = PolicyWorker(WorkerIdentity(role="policy", rank=0, world_size=1), config=cfg,
                              vocab_size=16, eos_id=1, pad_id=0, max_response_tokens=4)
        torch.manual_seed(noise)  # what the process drew before: not the adapters' business
        return adapters(worker._adapt(policy()))

    run = role_adapters(3, noise=0)
    assert all(torch.equal(t, run[n]) for n, t in role_adapters(3, noise=1).items()), \
        "the same train.seed gave other adapters"
    assert not any(torch.equal(t, run[n]) for n, t in role_adapters(4, noise=0).items()
                   if ".lora_A." in n)


def test_the_merged_weights_are_w_plus_scaled_ba_and_compute_the_adapted_function() -> None:
    model = lora.attach(policy(), LoraConfig(rank=RANK, alpha=ALPHA), seed=5)
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.2)
    params = dict(model.named_parameters())
    merged = lora.merged_local_shards(model, {n: p.detach() for n, p in params.items()})
    assert list(merged) == list(lora.served_shapes(model))
    plain = policy()
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    q = "model.layers.0.self_attn.q_proj"
    a = params[f"{q}.lora_A.default.weight"]
    b = params[f"{q}.lora_B.default.weight"]
    w = params[f"{q}.base_layer.weight"]
    assert torch.allclose(merged[f"{q}.weight"], w + (ALPHA / RANK) * (b @ a))
    for name in merged:  # the push's tensor by tensor path (biases of adapted layers too)
        assert torch.equal(lora.merged_whole(model, name, params), merged[name].float()), name
    plain.load_state_dict(merged, strict=False)
    x = torch.randint(2, 16, (2, 9))
    assert torch.allclose(plain(x).logits, model(x).logits, atol=1e-5)


# ---- in the trainer -----------------------------------------------------------------------------

def run(cfg: PPOConfig) -> tuple[list, dict, list]:
    """Steps of `cfg`: each step's batch; the final state; the engine's weights at the end."""
    batches = []
    with make_trainer(cfg) as tr:
        tr.start()
        for step in range(cfg.train.steps):
            batches.append(tr.train_step(step)[1])
        state = tr.state()
        engines = (tr.policy.call(PolicyWorker.engine_weights)
                   if not cfg.pipeline.disaggregated else [])
    return batches, state, engines


def merged_from_state(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {lora.served_name(n): t for n, t in weights.items() if not lora.is_adapter(n)}
    for n, t in weights.items():
        if n.endswith(".lora_A.default.weight"):
            module = n.removesuffix(".lora_A.default.weight")
            b = weights[f"{module}.lora_B.default.weight"]
            out[f"{module}.weight"] = out[f"{module}.weight"] + (ALPHA / RANK) * (b @ t)
    return out


def test_only_the_adapters_train_the_engine_serves_the_merge_and_the_reference_is_the_base(
        tmp_path: Path) -> None:
    batches, state, engines = run(tiny(tmp_path / "a"))
    actor = state.weights["actor"]
    base = policy_like(tmp_path).state_dict()
    for name, t in actor.items():
        if not lora.is_adapter(name):
            assert torch.equal(t, base[lora.served_name(name)]), f"the frozen {name} moved"
    # AdamW holds state for the adapters alone.
    [opt] = state.optimizers["actor"]
    n_adapters = sum(lora.is_adapter(n) for n in actor)
    assert len(opt["state"]) == n_adapters > 0
    assert any(".lora_B." in n and t.abs().sum() > 0 for n, t in actor.items())
    # The engine holds the merged weights (cast to its dtype): what the sync checked.
    merged = merged_from_state(actor)
    [engine] = engines
    for name, t in engine.items():
        if name in merged:
            assert torch.allclose(t, merged[name].to(t.dtype), atol=1e-6), name
    # Step 0: the adapters are still 0, so the reference (adapters off) IS the policy.
    first = batches[0]
    assert torch.equal(first.packed["ref_logp"].values, first.packed["old_logp"].values)
    last = batches[-1]
    assert not torch.equal(last.packed["ref_logp"].values, last.packed["old_logp"].values)


def policy_like(tmp_path: Path) -> torch.nn.Module:
    """The run's base policy, rebuilt as `initial_policy` builds it."""
    from avrid.ppo.driver.trainer import Trainer
    from avrid.ppo.engines.models import initial_policy

    cfg = tiny(tmp_path / "unused")
    tr = Trainer(cfg)
    return initial_policy(cfg, vocab_size=tr.tokenizer.vocab_size,
                          eos_id=tr.tokenizer.eos_token_id, pad_id=tr.tokenizer.pad_token_id)


def test_a_checkpoint_holds_the_adapters_only_and_resume_is_exact(tmp_path: Path) -> None:
    full = train(tiny(tmp_path / "full", "train.steps=4"))
    out = tmp_path / "split"
    train(tiny(out, "train.steps=2"))
    resumed = train(tiny(out, "train.steps=4", "train.resume=true"))
    assert algorithmic(resumed.rows)[3:] == algorithmic(full.rows)[3:]
    a = load_checkpoint(latest_checkpoint(tmp_path / "full" / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    wa, wb = read_model_weights(a.sharded["actor"]), read_model_weights(b.sharded["actor"])
    assert wa and all(lora.is_adapter(n) for n in wa)  # no base weight is saved
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)


def test_lora_trains_over_two_fsdp_ranks_in_bf16_and_one_step_off(tmp_path: Path,
                                                         ray_cluster: None) -> None:
    # bf16 compute over fp32 adapters (FSDP2's mixed precision), the engine in bf16.
    batches, state, engines = run(tiny(tmp_path / "dp2", "placement.actor_dp=2",
                                       "train.steps=2", "model.dtype=bfloat16",
                                       inprocess=False))
    actor = state.weights["actor"]
    assert {t.dtype for t in actor.values()} == {torch.float32}
    merged = merged_from_state(actor)
    for engine in engines:  # each rank's engine holds the whole merged model, cast once
        for name, t in engine.items():
            if name in merged:
                assert t.dtype == torch.bfloat16 and torch.equal(t, merged[name].to(t.dtype))
    batches, state, _ = run(tiny(tmp_path / "osf", "pipeline.mode=one_step_off",
                                 "pipeline.rollout_dp=1", "train.steps=3"))
    assert len(batches) == 3 and any(".lora_B." in n and t.abs().sum() > 0
                                     for n, t in state.weights["actor"].items())
