"""Chapter 5 — meta-device init (`roles/meta_init.py`) on two gloo ranks, each a subprocess
that runs a real `PolicyWorker` or `CriticWorker` from a checkpoint written by
``save_pretrained``: the sharded model starts, computes and trains bit for bit as it did
when every rank loaded the whole model (weights after setup and after one update, old and
reference log-probs — the reference is filled from rank 0's copy too —, the rollout
engine's weights, values, the critic's new value head, the rotary buffers); a non-zero
rank's peak resident memory during setup stays well under one full fp32 copy (the old
path's exceeds one); a resume from sharded checkpoints still works.

Not here: the old path itself (the tiny random models: test_ppo_critic_fsdp.py,
test_ppo_trainer.py), sharded checkpoints (test_ppo_sharded_checkpoint.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.workers.outcome import free_port
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(5)

VOCAB = 64

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from avrid.ppo.roles import fsdp, meta_init

    mode, role, rank, port, ckpt, out, dtype, shards = sys.argv[1:9]
    rank, port = int(rank), int(port)
    used = []
    if mode.startswith("old"):  # every rank loads the whole model, as before meta_init
        meta_init.applies = lambda *a, **k: False
    else:
        fill = meta_init.fill
        meta_init.fill = lambda *a, **k: (used.append(True), fill(*a, **k))
    from avrid.dispatch import Batch, Shard
    from avrid.ppo.data.columns import Totals
    from avrid.ppo.roles.critic import CriticWorker
    from avrid.ppo.roles.policy import PolicyWorker
    from avrid.ppo.setup.config import PPOConfig
    from avrid.ppo.setup.overrides import with_overrides
    from avrid.workers import WorkerIdentity
    from avrid.workers.identity import Rendezvous
    from tests.helpers import ragged_batch

    VOCAB, PAD, EOS = 64, 0, 1
    cfg = with_overrides(PPOConfig(), [
        "placement.actor_dp=2", "placement.critic_dp=2", f"model.path={ckpt}",
        "model.tokenizer=char", f"model.dtype={dtype}", "algo.kl_coef=0.1",
        "algo.kl_in=loss"])
    ident = WorkerIdentity(role=role, rank=rank, world_size=2,
                           rendezvous=Rendezvous(master_addr="127.0.0.1", master_port=port))
    if role == "policy":
        w = PolicyWorker(ident, config=cfg, vocab_size=VOCAB, eos_id=EOS, pad_id=PAD,
                         max_response_tokens=4)
    else:
        w = CriticWorker(ident, config=cfg, vocab_size=VOCAB, pad_id=PAD)

    def status(field):  # bytes, from /proc/self/status (kB there)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on
        f.write("5")
    before = status("VmRSS")
    w.setup(shards if mode == "resume" else None)
    res = {"grew": status("VmHWM") - before, "meta": len(used)}  # models filled
    if not mode.endswith("memory"):
        res["init"] = fsdp.full_state_dict(w.model)
        batch = ragged_batch([2, 3, 1, 2], [3, 1, 4, 2], vocab=VOCAB,
                             sample_ids=[10, 11, 12, 13], seed=rank,
                             columns={"returns": 1.0, "advantages": 1.0, "values": 1.0})
        shard = Shard(index=rank, batch=batch, micro_bounds=(0, 2, 4))
        if role == "policy":
            res["engine"] = w.engine_weights()
            # The engine generates (its kernel, its weights): the same tokens and log-probs.
            rows = [batch.packed["tokens"].row(i)[:n] for i, n in enumerate([2, 3])]
            prompts = Shard(index=rank, micro_bounds=(0, 2), batch=Batch.from_rows(
                sample_ids=[0, 1], prompt_lens=[2, 3], response_lens=[0, 0],
                packed={"tokens": rows}))
            gen = w.generate(prompts, max_new_tokens=3, greedy=False, seed=rank).outputs
            res["response"], res["rollout_logp"] = (gen.packed[k] for k in
                                                    ("response", "rollout_logp"))
            for name, ref in (("old_logp", False), ("ref_logp", True)):
                res[name] = w.compute_logprobs(shard, reference=ref).outputs.packed[name]
            batch = Batch(sample_ids=batch.sample_ids, prompt_lens=batch.prompt_lens,
                          response_lens=batch.response_lens, scalars=batch.scalars,
                          packed={**batch.packed, "old_logp": res["old_logp"],
                                  "ref_logp": res["ref_logp"]})
            shard = Shard(index=rank, batch=batch, micro_bounds=(0, 2, 4))
        else:
            res["values"] = w.compute_values(shard).outputs.packed["values"]
        w.update(shard, totals=Totals.of(batch, 8), step=0)
        res["trained"] = fsdp.full_state_dict(w.model)
        res["buffers"] = dict(w.model.named_buffers())
        if mode == "save":
            w.save_shards(shards)
        res = {k: v.values if hasattr(v, "values") and isinstance(v.values, torch.Tensor)
               else v for k, v in res.items()}
        torch.save(res, f"{out}/{mode}-{role}-{rank}.pt")
    w.close()
    print(json.dumps({"grew": res["grew"], "meta": res["meta"]}))
    from tests.helpers import leave_process_group
    leave_process_group()  # not a normal exit: gloo can abort in its teardown (see there)
""")


def save_checkpoint(path: Path, spec: TinyModelSpec) -> Path:
    """A policy checkpoint as transformers writes one (config + safetensors)."""
    build_tiny_policy(spec, seed=3, eos_token_id=1, pad_token_id=0).save_pretrained(path)
    return path


def run_ranks(tmp_path: Path, mode: str, role: str, ckpt: Path, *,
              dtype: str = "float32") -> list[dict]:
    """Run the rank script on two gloo ranks; each prints one JSON line."""
    port = free_port()
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    # Allocations of 1 MiB or more get their own mappings, returned when freed: the peak
    # counts live memory, not glibc's cache (as in test_ppo_sharded_checkpoint.py).
    env = child_env(MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    procs = [subprocess.Popen([sys.executable, str(script), mode, role, str(r), str(port),
                               str(ckpt), str(tmp_path), dtype, str(tmp_path / "shards")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def load(tmp_path: Path, mode: str, role: str, rank: int) -> dict:
    return torch.load(tmp_path / f"{mode}-{role}-{rank}.pt", weights_only=False)


def assert_bit_equal(a: object, b: object, where: str) -> None:
    """Equal bytes, dtypes and shapes, through nested dicts of tensors."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for k in a:
            assert_bit_equal(a[k], b[k], f"{where}.{k}")
        return
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
    assert (a.dtype, a.shape) == (b.dtype, b.shape), where
    flat = (a.detach().contiguous().reshape(-1).view(torch.uint8),
            b.detach().contiguous().reshape(-1).view(torch.uint8))
    assert torch.equal(*flat), where


@pytest.mark.parametrize("role", ["policy", "critic"])
def test_meta_init_starts_and_trains_bit_for_bit_like_loading_everywhere(
        tmp_path: Path, role: str) -> None:
    # A tied LM head and bf16 mixed precision: the two ways a fill could go wrong quietly.
    spec = TinyModelSpec(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_heads=2,
                         num_kv_heads=2, tie_embeddings=True)
    ckpt = save_checkpoint(tmp_path / "ckpt", spec)
    # Filled from rank 0's copy: the actor and its (sharded) reference, or the critic.
    fills = 2 if role == "policy" else 1
    assert [r["meta"] for r in run_ranks(tmp_path, "meta", role, ckpt,
                                         dtype="bfloat16")] == [fills, fills]
    assert [r["meta"] for r in run_ranks(tmp_path, "old", role, ckpt,
                                         dtype="bfloat16")] == [0, 0]
    for rank in (0, 1):
        new, old = load(tmp_path, "meta", role, rank), load(tmp_path, "old", role, rank)
        assert sorted(new) == sorted(old)
        for key in sorted(new):
            if key not in ("grew", "meta"):
                assert_bit_equal(new[key], old[key], f"{role}[{rank}].{key}")
        assert any("inv_freq" in n for n in new["buffers"])  # the rotary buffers were checked
        if role == "critic":  # the new value head: drawn from the run's seed, not noise
            assert new["init"]["score.weight"].abs().sum() > 0


def test_a_non_zero_rank_never_holds_a_full_fp32_copy_during_setup(tmp_path: Path) -> None:
    # The critic (no rollout engine, which is a whole copy by design): ~140 MiB of fp32
    # weights in 12 layers, its largest tensor (the embedding) 16 MiB.
    spec = TinyModelSpec(vocab_size=8192, hidden_size=512, intermediate_size=1024,
                         num_layers=12, num_heads=8, num_kv_heads=8)
    ckpt = save_checkpoint(tmp_path / "ckpt", spec)
    from safetensors.torch import load_file

    full = 4 * sum(t.numel() for k, t in load_file(ckpt / "model.safetensors").items()
                   if not k.startswith("lm_head"))  # the critic keeps no LM head
    new = run_ranks(tmp_path, "memory", "critic", ckpt)
    old = run_ranks(tmp_path, "old-memory", "critic", ckpt)
    print("setup peak growth per rank, meta init:",
          [f"{r['grew'] / 2**20:.1f} MiB" for r in new],
          "old:", [f"{r['grew'] / 2**20:.1f} MiB" for r in old],
          f"one full fp32 copy: {full / 2**20:.1f} MiB")
    assert (new[1]["meta"], old[1]["meta"]) == (1, 0)
    assert new[1]["grew"] < 0.75 * full, new
    assert old[1]["grew"] >= full, old  # the measure sees a full copy where there is one


def test_a_meta_init_run_resumes_from_its_sharded_checkpoint(tmp_path: Path) -> None:
    spec = TinyModelSpec(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_heads=2,
                         num_kv_heads=2)
    ckpt = save_checkpoint(tmp_path / "ckpt", spec)
    run_ranks(tmp_path, "save", "policy", ckpt)
    assert [r["meta"] for r in run_ranks(tmp_path, "resume", "policy", ckpt)] == [2, 2]
    for rank in (0, 1):
        saved, resumed = load(tmp_path, "save", "policy", rank), load(tmp_path, "resume",
                                                                       "policy", rank)
        assert_bit_equal(resumed["init"], saved["trained"], f"policy[{rank}].init")
        # The engine holds the resumed weights (the first sync), not the checkpoint's.
        assert_bit_equal(resumed["engine"], {n: t.to(resumed["engine"][n].dtype)
                                             for n, t in saved["trained"].items()}, "engine")


def pretrained(path: Path) -> Path:
    """A checkpoint as `model.path` names one: a tiny policy and its own word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", *"0123456789+=-*abcdefghijklmnopqrstuvwxyz"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(path)
    return save_checkpoint(path, TinyModelSpec(vocab_size=len(words), max_positions=128))


@pytest.mark.slow
def test_a_ray_run_from_a_checkpoint_with_meta_init_matches_the_old_path(
        tmp_path: Path, ray_cluster: None) -> None:
    # Ray workers, dp = 2, PPO with a KL term: the actor, its reference and the critic start
    # from the checkpoint by meta init. `memory.cpu_offload` keeps the old path (every rank
    # loads the whole model; `meta_init.applies`) and changes no result (test_ppo_cpu_offload).
    from avrid.ppo.driver.run import train
    from avrid.ppo.setup.overrides import with_overrides
    from avrid.ppo.setup.presets import preset
    from tests.test_ppo_trainer import algorithmic

    ckpt = pretrained(tmp_path / "pretrained")

    def run(name: str, offload: bool) -> list[dict]:
        cfg = with_overrides(preset("tiny-ppo"), [
            f"model.path={ckpt}", "model.tokenizer=null",
            "placement.backend=ray", "placement.actor_dp=2", "placement.critic_dp=2",
            "train.steps=2", "train.prompts_per_step=8", "algo.responses_per_prompt=4",
            "train.mini_batch_size=16", "train.val_prompts=8", "train.val_every=1000",
            "algo.kl_coef=0.01", "train.progress=false", f"train.out_dir={tmp_path / name}",
            f"memory.cpu_offload={str(offload).lower()}"])
        return train(cfg).rows

    meta, old = run("meta", False), run("old", True)
    assert len(meta) == 3
    assert algorithmic(meta) == algorithmic(old)
