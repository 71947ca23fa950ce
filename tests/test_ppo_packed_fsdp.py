"""Chapter 5 — the packed, chunked log-probs under FSDP2 on two gloo ranks, tied head included.

`forward.response_logprobs` runs the model as a whole and then calls its output projection
(`get_output_embeddings()`) over the response positions, chunk by chunk, checkpointed under
grad. Under FSDP2 that projection's weight lives in the root unit: this works because the
root is not resharded after its forward, and its gradient reduction runs at the end of
backward, after the chunks' recomputation. This test pins it on two processes (as on Ray):
each rank shards a tiny policy — with an untied LM head, and with one tied to the embedding
as in Qwen2.5-0.5B — computes no-grad log-probs and one `train_shard` walk of its shard
(token-budget micro-batches, the same count on both ranks, one of them empty), and the
gradient FSDP reduces must equal one process's on the whole batch through the old padded,
full-logits layout (rel 1e-5), the log-probs too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from avrid.dispatch import Batch, DispatchConfig, make_plan
from avrid.ppo.algo.losses import aggregate, policy_loss
from avrid.ppo.data.columns import Totals, packed_inputs, padded, padded_inputs
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.roles import fsdp
from avrid.ppo.roles.forward import response_logprobs, train_shard
from avrid.results import ResultBuilder
from avrid.workers import WorkerIdentity
from avrid.workers.outcome import free_port
from tests.helpers import GradRecorder, leave_process_group

pytestmark = [pytest.mark.chapter(5), pytest.mark.slow]

WORLD, VOCAB, PAD, CHUNK = 2, 40, 0, 3
AGG = "token-mean"
PROMPT_LENS, RESPONSE_LENS = [3, 1, 5, 2, 4], [2, 9, 1, 3, 6]


def spec(tied: bool) -> TinyModelSpec:
    return TinyModelSpec(vocab_size=VOCAB, hidden_size=32, num_heads=2, num_kv_heads=2,
                         tie_embeddings=tied)


def make_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(2, VOCAB, (p + r,), generator=g)
              for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)]
    return Batch.from_rows(sample_ids=range(len(tokens)), prompt_lens=PROMPT_LENS,
                           response_lens=RESPONSE_LENS,
                           packed={"tokens": tokens,
                                   "old_logp": [-0.5 * torch.rand(r, generator=g) - 3.5
                                                for r in RESPONSE_LENS],
                                   "advantages": [torch.randn(r, generator=g)
                                                  for r in RESPONSE_LENS]})


def loss_fn(model: torch.nn.Module):  # noqa: ANN201
    def fn(x, mb, w, b):  # noqa: ANN001, ANN202
        logp, _ = response_logprobs(model, x, 0.8, chunk=CHUNK)
        out = policy_loss(logp, padded(mb, "old_logp"), padded(mb, "advantages"),
                          x.response_mask, clip_low=0.2, clip_high=0.2)
        return (out.per_token * w).sum()
    return fn


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    batch = make_batch()
    # One sample per micro-batch, three on each rank (same_micro_count): rank 1 has two
    # samples, so its third micro-batch is empty and its forward/backward runs on nothing.
    plan = make_plan(batch, WORLD, DispatchConfig(micro_batch_tokens=8, same_micro_count=True))
    shard = plan.split(batch)[rank]
    identity = WorkerIdentity(role="actor", rank=rank, world_size=WORLD)
    result = {"micro": [len(mb) for mb in shard.micro_batches()]}
    for tied in (False, True):
        model = fsdp.shard_model(build_tiny_policy(spec(tied), seed=0), dist.group.WORLD,
                                 WORLD, "cpu")
        with torch.no_grad():
            logps = {}
            for mb in shard.micro_batches():
                logp, _ = response_logprobs(model, packed_inputs(mb, PAD), 0.8, chunk=CHUNK)
                for i, sid in enumerate(mb.sample_ids.tolist()):
                    logps[sid] = logp[i, :int(mb.response_lens[i])].clone()
        optimizer = GradRecorder(model)
        builder = ResultBuilder.for_shard(identity, shard)
        train_shard(model, optimizer, shard, builder, loss_fn(model), pad_id=PAD, agg=AGG,
                    totals=Totals.of(batch, 16), world_size=WORLD, grad_clip=1e9,
                    prefix="actor")
        result[tied] = {"grads": optimizer.grads, "logps": logps,
                        "sharded": any(hasattr(p, "full_tensor") for p in model.parameters())}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    leave_process_group()  # not a normal exit: gloo can abort in its teardown (see there)


def test_fsdp2_packed_chunked_update_equals_one_padded_process(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert any(0 in r["micro"] for r in ranks), [r["micro"] for r in ranks]  # an empty one
    batch = make_batch()
    for tied in (False, True):
        assert all(r[tied]["sharded"] for r in ranks), "the policy was not wrapped by FSDP2"
        ref = build_tiny_policy(spec(tied), seed=0)
        x = padded_inputs(batch, PAD)
        logits = ref(input_ids=x.input_ids, attention_mask=x.attention_mask,
                     position_ids=x.position_ids, use_cache=False).logits
        scaled = torch.log_softmax(logits / 0.8, dim=-1)
        picked = scaled[torch.arange(len(batch))[:, None], x.logit_index]
        logp = picked.gather(-1, x.response_ids[..., None]).squeeze(-1)
        out = policy_loss(logp, padded(batch, "old_logp"), padded(batch, "advantages"),
                          x.response_mask, clip_low=0.2, clip_high=0.2)
        aggregate(out.per_token, x.response_mask, AGG).backward()
        want = {n: p.grad for n, p in ref.named_parameters()}
        got_logps = {**ranks[0][tied]["logps"], **ranks[1][tied]["logps"]}
        for i, n in enumerate(RESPONSE_LENS):
            assert float((got_logps[i] - logp[i, :n].detach()).abs().max()) < 1e-5
        for r in ranks:
            grads = r[tied]["grads"]
            assert grads.keys() == want.keys()
            worst = max(float((grads[n] - want[n]).abs().max() / want[n].abs().max())
                        for n in want)
            assert worst < 1e-5, (tied, worst)
