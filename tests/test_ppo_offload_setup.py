"""Chapter 5 — `memory.cpu_offload` builds the model without ever putting it whole on the GPU.

`TrainedWorker.setup` used to move the whole fp32 model to its device before FSDP2 sharded it,
offloaded or not, and to build the rollout engine while it was there (issue 41, item 4: at
14B, 59 GB + vLLM's share). Offloaded, the model now stays on the CPU and `fully_shard` moves
one unit at a time (each decoder layer, then the root), so no more than one FSDP unit is on
the device at once. The CPU proxy: a real 1-rank `PolicyWorker` (gloo, in a subprocess)
records every `nn.Module.to` / `.cuda` call on the actor's model before `fsdp.shard_model`,
and which tensors `fully_shard` moves at once; offloaded, the whole model is never moved.
A `gpu` test measures the setup's peak on a CUDA device against the estimate's "setup" phase.

Not here: offloaded training itself (test_ppo_cpu_offload.py), the estimate's numbers
(test_ppo_memory_layouts.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from avrid.workers.outcome import free_port
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(5)

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_init
    from avrid.ppo.roles import fsdp
    from avrid.ppo.roles.policy import PolicyWorker
    from avrid.ppo.setup.config import PPOConfig
    from avrid.ppo.setup.overrides import with_overrides
    from avrid.workers import WorkerIdentity
    from avrid.workers.identity import Rendezvous

    port, offload, device = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    moves, units, sharded = [], [], []
    to, cuda = torch.nn.Module.to, torch.nn.Module.cuda

    def record(module, how):
        if not sharded:  # before FSDP2 shards the actor
            moves.append((id(module), sum(p.numel() for p in module.parameters()), how))

    def recording_to(self, *args, **kwargs):
        if kwargs.get("device") is not None or any(
                isinstance(a, (str, torch.device)) for a in args):  # a move, not a cast
            record(self, f"to{args}")
        return to(self, *args, **kwargs)

    def recording_cuda(self, *args, **kwargs):
        record(self, "cuda")
        return cuda(self, *args, **kwargs)

    torch.nn.Module.to, torch.nn.Module.cuda = recording_to, recording_cuda
    shard_model, move = fsdp.shard_model, _fsdp_init._move_states_to_device

    def recording_shard(model, *args, **kwargs):
        sharded.append((id(model), sum(p.numel() for p in model.parameters())))
        return shard_model(model, *args, **kwargs)

    def recording_move(params, buffers, dev):  # what one fully_shard call moves at once
        units.append(sum(p.numel() for p in params))
        return move(params, buffers, dev)

    fsdp.shard_model, _fsdp_init._move_states_to_device = recording_shard, recording_move
    cfg = with_overrides(PPOConfig(), [
        "placement.actor_dp=1", "placement.critic_dp=1", f"placement.device={device}",
        "model.tokenizer=char",
        f"memory.cpu_offload={offload}", "model.hidden_size=32", "model.num_layers=3",
        "algo.kl_coef=0.0"])
    ident = WorkerIdentity(role="policy", rank=0, world_size=1,
                           rendezvous=Rendezvous(master_addr="127.0.0.1", master_port=port))
    w = PolicyWorker(ident, config=cfg, vocab_size=40, eos_id=1, pad_id=0,
                     max_response_tokens=4)
    w.setup()
    actor, total = sharded[0]
    whole = [how for mid, n, how in moves if mid == actor]
    print(json.dumps({"total": total, "actor_moves": whole, "units": units}))
    w.close()
    from tests.helpers import leave_process_group
    leave_process_group()
""")


def setup_record(offload: bool, device: str = "cpu") -> dict:
    """Set up a 1-rank PolicyWorker in a subprocess; what moved before it was sharded."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port()), str(offload).lower(),
                           device], env=child_env(), capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_offload_never_moves_the_whole_model_before_sharding() -> None:
    got = setup_record(offload=True)
    assert got["actor_moves"] == [], (
        f"the offloaded actor ({got['total']} parameters) was moved whole to the device "
        f"before sharding: {got['actor_moves']}")
    # fully_shard moved it unit by unit instead: each decoder layer, then the root, and no
    # call moved the whole model.
    assert len(got["units"]) == 3 + 1 and sum(got["units"]) == got["total"]
    assert max(got["units"]) < got["total"]


def test_without_offload_the_whole_model_still_moves_first() -> None:
    # The unoffloaded path is unchanged (an fp32 model on one rank is never wrapped at all).
    got = setup_record(offload=False)
    assert got["actor_moves"] == ["to('cpu',)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_setup_holds_one_unit_on_the_gpu() -> None:
    got = setup_record(offload=True, device="cuda")
    assert got["actor_moves"] == [] and max(got["units"]) < got["total"]
