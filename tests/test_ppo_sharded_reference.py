"""Chapter 5 — the frozen reference sharded like the actor (`fsdp.shard_frozen`).

When the actor is sharded (dp > 1, bf16 or CPU offload), `PolicyWorker._initial_policy`
wraps the reference with FSDP2 over the actor's group, in the dtype it computes in and with
no optimizer, so each rank holds 1/dp of it. Checked on two gloo ranks, each a subprocess:
its log-probs (`forward.response_logprobs`: the hidden states, then the output projection
the model holds, chunk by chunk) are bit-identical to the unsharded reference's on the same
micro-batch, fp32 and bf16, packed and padded; each rank holds half of it; and the root's
weights, which FSDP2 leaves gathered after a forward, are sharded again by `fsdp.reshard`.
Then on Ray: a dp = 2 policy's `ref_logp` equals an unsharded reference's in this process.

Not here: the actor's sharding (test_ppo_bf16.py), the KL terms that read `ref_logp`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from avrid.workers.outcome import free_port
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(5)

RANKS_SCRIPT = textwrap.dedent("""
    import copy, json, sys
    import torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from avrid.dispatch import Batch
    from avrid.ppo.data.columns import model_inputs
    from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
    from avrid.ppo.roles import fsdp
    from avrid.ppo.roles.forward import response_logprobs

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    spec = TinyModelSpec(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2)
    gen = torch.Generator().manual_seed(rank)  # each rank its own micro-batch (data parallel)
    prompts, responses = [3, 5, 2, 4], [6, 1, 9, 4]
    batch = Batch.from_rows(
        sample_ids=range(4), prompt_lens=prompts, response_lens=responses,
        packed={"tokens": [torch.randint(1, 40, (p + r,), generator=gen)
                           for p, r in zip(prompts, responses)]})
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = build_tiny_policy(spec, seed=0)
        frozen = fsdp.cast_parameters(model, getattr(torch, dtype)).eval()
        frozen.requires_grad_(False)
        plain = copy.deepcopy(frozen)
        sharded = fsdp.shard_frozen(frozen, dist.group.WORLD, "cpu")
        held = sum(p.to_local().numel() for p in sharded.parameters())
        same, gap = True, 0.0
        for packed in (True, False):
            x = model_inputs(batch, 0, packed=packed)
            with torch.no_grad():
                want, _ = response_logprobs(plain, x, 0.7, chunk=5)
                got, _ = response_logprobs(sharded, x, 0.7, chunk=5)
            same = same and bool(got.equal(want))
            gap = max(gap, float((got.float() - want.float()).abs().max()))
        embed = sharded.model.embed_tokens.weight
        gathered = not isinstance(embed, DTensor)  # FSDP2 left the root whole
        fsdp.reshard(sharded)
        embed = sharded.model.embed_tokens.weight
        out[dtype] = {"same": same, "gap": gap, "held": held,
                      "whole": sum(p.numel() for p in plain.parameters()),
                      "dtypes": sorted({str(p.dtype) for p in sharded.parameters()}),
                      "gathered_after_forward": gathered,
                      "sharded_after_reshard": isinstance(embed, DTensor)
                                               and embed.to_local().shape[0] == 20}
    print(json.dumps(out))
    from tests.helpers import leave_process_group
    leave_process_group()  # not a normal exit: gloo can abort in its teardown (see there)
""")


def run_ranks(tmp_path: Path, script: str, *args: str) -> list[dict]:
    """Run `script` on two gloo ranks (subprocesses); each prints one JSON line last."""
    port = free_port()
    path = tmp_path / "ranks.py"
    path.write_text(script)
    procs = [subprocess.Popen([sys.executable, str(path), str(r), str(port), *args],
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=170) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_a_sharded_reference_gives_the_unsharded_log_probs_bit_for_bit(tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(tmp_path, RANKS_SCRIPT)):
        for dtype, r in result.items():
            print(f"rank {rank} {dtype}: holds {r['held']} of {r['whole']} parameters, "
                  f"max |ref_logp difference| {r['gap']}")
            # The same bytes gathered, then the same ops on them: bit-identical.
            assert r["same"] and r["gap"] == 0.0, (rank, dtype, r)
            assert r["dtypes"] == [f"torch.{dtype}"]  # no fp32 master for a frozen model
            # Every parameter's dim 0 is even here, so each rank holds exactly half.
            assert 2 * r["held"] == r["whole"], (rank, dtype, r)
            assert r["gathered_after_forward"] and r["sharded_after_reshard"], (rank, r)


@pytest.mark.slow
def test_the_policy_shards_its_reference_and_ref_logp_is_unchanged(
        tmp_path: Path, ray_cluster: None) -> None:
    from avrid.ppo.data.columns import model_inputs, padded, response_mask, with_responses
    from avrid.ppo.driver.trainer import Trainer
    from avrid.ppo.engines.models import initial_policy
    from avrid.ppo.roles.forward import response_logprobs
    from avrid.ppo.roles.policy import PolicyWorker
    from avrid.ppo.setup.overrides import with_overrides
    from avrid.ppo.setup.presets import preset
    from avrid.results import run_shards

    cfg = with_overrides(preset("tiny-ppo"), [
        "placement.backend=ray", "placement.actor_dp=2", "placement.critic_dp=1",
        "algo.kl_coef=0.01", "train.progress=false", f"train.out_dir={tmp_path}"])
    with Trainer(cfg) as trainer:
        trainer.start()
        prompts = trainer.step_prompts(0)
        gen = run_shards(trainer.policy, PolicyWorker.generate, prompts, None,
                         **trainer.sampling(0))
        batch = with_responses(prompts, gen.batch).only("tokens")
        ref = run_shards(trainer.policy, PolicyWorker.compute_logprobs, batch,
                         trainer.dispatch, reference=True)
        tok = trainer.tokenizer
        plain = initial_policy(cfg, vocab_size=int(tok.vocab_size), eos_id=tok.eos_token_id,
                               pad_id=tok.pad_token_id).eval()
    with torch.no_grad():
        x = model_inputs(batch, tok.pad_token_id, packed=cfg.memory.pack_sequences)
        want, _ = response_logprobs(plain, x, cfg.rollout.temperature)
    got = padded(ref.batch, "ref_logp")
    mask = response_mask(batch).bool()
    # Each rank computes its micro-batches, not this one packed row: only the float
    # summation order of attention and matmuls differs (measured max below; fp32).
    gap = float((got - want)[mask].abs().max())
    print(f"dp=2 sharded reference vs unsharded here: max |ref_logp difference| {gap:.2e}")
    assert gap < 1e-5
