"""The critic under FSDP2 on two gloo ranks: no "returned a view" warning, exact gradients.

`nn.Linear` with a bias returns a VIEW for a 3-D input, and the critic's value head is its
last module, so FSDP2 used to warn on every forward that the wrapped module "returned a view
tensor ... can cause wrong gradients". The head (`models.ValueHead`) now returns a fresh
tensor, so the warning cannot be raised; this test records every warning of a real
`CriticWorker` (setup, values, one update) on two processes, and compares the gradient the
update would apply with a plain single-process critic's on the same batch.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from avrid.dispatch import DispatchConfig, make_plan
from avrid.ppo.algo.losses import aggregate, value_loss
from avrid.ppo.data.columns import Totals, model_inputs, padded
from avrid.ppo.engines.models import build_tiny_critic, tiny_spec
from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.forward import response_values
from avrid.workers import WorkerIdentity
from avrid.workers.identity import Rendezvous
from avrid.workers.outcome import free_port
from tests.helpers import GradRecorder, leave_process_group
from tests.test_ppo_updates import NORM_LEN, PAD, VOCAB, config, make_batch

pytestmark = pytest.mark.chapter(5)

WORLD = 2
AGG = "seq-mean-token-mean"  # per-row weights that span ranks: the weighting is exercised


def _rank(rank: int, port: int, out: str) -> None:
    """One critic rank in its own process (as on Ray): setup, values, one update."""
    cfg = config(f"algo.loss_agg={AGG}")
    batch = make_batch()
    plan = make_plan(batch, WORLD, DispatchConfig(micro_batch_tokens=10, same_micro_count=True))
    shard = plan.split(batch)[rank]
    identity = WorkerIdentity(role="critic", rank=rank, world_size=WORLD,
                              rendezvous=Rendezvous(master_addr="127.0.0.1", master_port=port))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = CriticWorker(identity, config=cfg, vocab_size=VOCAB, pad_id=PAD)
        worker.setup()
        sharded = any(hasattr(p, "full_tensor") for p in worker.model.parameters())
        worker.optimizer = GradRecorder(worker.model)
        worker.compute_values(shard)
        worker.update(shard, totals=Totals.of(batch, NORM_LEN), step=0)
        worker.close()
    torch.save({"grads": worker.optimizer.grads, "sharded": sharded,
                "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]},
               Path(out) / f"rank{rank}.pt")
    leave_process_group()  # not a normal exit: gloo can abort in its teardown (see there)


def test_fsdp2_critic_warns_nothing_and_its_gradients_match_one_process(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert all(r["sharded"] for r in ranks), "the critic was not wrapped by FSDP2"
    for r, got in enumerate(ranks):
        views = [w for w in got["warnings"] if "view" in w]
        assert not views, f"rank {r} warned: {views}"
    # The same critic, whole, in this process, on the whole batch.
    cfg = config(f"algo.loss_agg={AGG}")
    batch = make_batch()
    ref = build_tiny_critic(tiny_spec(cfg, VOCAB), seed=cfg.train.seed + 1)
    x = model_inputs(batch, PAD)
    out = value_loss(response_values(ref, x), padded(batch, "values"), padded(batch, "returns"),
                     x.response_mask, clip=cfg.algo.value_clip)
    aggregate(out.per_token, x.response_mask, AGG, norm_len=NORM_LEN).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for got in ranks:
        assert got["grads"].keys() == want.keys()
        worst = max(float((got["grads"][n] - want[n]).abs().max()) for n in want)
        assert worst < 1e-5, worst
