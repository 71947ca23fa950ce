"""Activation checkpointing of the trained models (`train.gradient_checkpointing`): the same
gradients (fp32) for the tiny policy and critic, the layers really recompute while every
dropout stays off, the automatic default, and less activation memory on CPU (a subprocess's
peak RSS, a deeper model and a long batch; slow).

Not here: the update loop itself (`test_ppo_updates.py`), FSDP2 sharding (`test_ppo_fsdp*`)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from avrid.ppo.engines.models import TinyModelSpec, build_tiny_critic, build_tiny_policy
from avrid.ppo.roles.trained import checkpoint_activations
from avrid.ppo.setup.config import ModelConfig, PPOConfig, TrainConfig
from tests.helpers import child_env, leave_process_group

pytestmark = pytest.mark.chapter(5)

SPEC = TinyModelSpec(vocab_size=64, num_layers=3, num_kv_heads=2)


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two right-padded rows: ids, attention mask, position ids, and loss weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SPEC.vocab_size, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
            "weights": torch.rand(2, 24, generator=gen) * mask}


def loss_and_grads(model: torch.nn.Module, role: str) -> tuple[float, dict[str, torch.Tensor]]:
    b = batch()
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                position_ids=b["position_ids"], use_cache=False).logits  # as training does
    if role == "policy":  # a log-prob loss over the next tokens
        logp = torch.log_softmax(out[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None])
        loss = -(logp.squeeze(-1) * b["weights"][:, 1:]).sum()
    else:  # a squared value error
        loss = ((out.squeeze(-1) - 0.5) ** 2 * b["weights"]).sum()
    model.zero_grad()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def build(role: str) -> torch.nn.Module:
    if role == "policy":
        return build_tiny_policy(SPEC, seed=0)
    return build_tiny_critic(SPEC, seed=1, dtype=torch.float32)


@pytest.mark.parametrize("role", ["policy", "critic"])
def test_checkpointing_changes_no_gradient(role: str) -> None:
    plain = build(role).eval()
    checkpointed = copy.deepcopy(plain)
    checkpoint_activations(checkpointed)
    loss, grads = loss_and_grads(plain, role)
    loss_c, grads_c = loss_and_grads(checkpointed, role)
    assert loss_c == loss
    worst = max(float((grads_c[n] - g).norm() / g.norm().clamp(min=1e-30))
                for n, g in grads.items())
    assert worst <= 1e-6, worst  # measured: 0 (the same kernels on the same values)


def test_the_layers_recompute_and_dropout_stays_off() -> None:
    model = build("critic").eval()
    checkpoint_activations(model)
    assert all(not m.training for m in model.modules() if isinstance(m, torch.nn.Dropout))
    calls = []
    # a pre-hook: the recomputation stops as soon as it has what backward needs, which is
    # before the MLP returns
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    loss_and_grads(model, "critic")
    assert len(calls) == 2  # the forward, and its recomputation in the backward pass
    calls.clear()
    with torch.no_grad():  # no backward: nothing to checkpoint
        model(input_ids=batch()["input_ids"], use_cache=False)
    assert len(calls) == 1


def test_the_default_is_on_for_checkpoints_read_from_disk() -> None:
    assert not PPOConfig().checkpoints_activations  # the tiny models: off
    assert PPOConfig(model=ModelConfig(path="/models/qwen")).checkpoints_activations
    assert PPOConfig(model=ModelConfig(critic_path="/models/qwen")).checkpoints_activations
    assert PPOConfig(train=TrainConfig(gradient_checkpointing=True)).checkpoints_activations
    assert not PPOConfig(model=ModelConfig(path="/models/qwen"),
                         train=TrainConfig(gradient_checkpointing=False)
                         ).checkpoints_activations
    with pytest.raises(ValueError, match="'train.gradient_checkpointing': must be true, false"):
        TrainConfig(gradient_checkpointing="yes")  # type: ignore[arg-type]


def _sharded_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: the policy checkpointed, then sharded by FSDP2 (as `setup`
    does); the same batch on both ranks, so the averaged gradient is the batch's own."""
    import torch.distributed as dist

    from avrid.ppo.roles import fsdp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    model = build("policy").eval()
    checkpoint_activations(model)
    calls: list[int] = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    model = fsdp.shard_model(model, dist.group.WORLD, 2, "cpu")
    _, grads = loss_and_grads(model, "policy")
    full = {n: g.full_tensor() for n, g in grads.items()}  # a collective: both ranks
    torch.save({"grads": full, "calls": len(calls)}, f"{out}/rank{rank}.pt")
    leave_process_group()  # not a normal exit: gloo can abort in its teardown (see there)


@pytest.mark.slow
def test_checkpointing_under_fsdp2_on_two_ranks_changes_no_gradient(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from avrid.workers.outcome import free_port

    mp.spawn(_sharded_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    _, want = loss_and_grads(build("policy").eval(), "policy")  # whole, not checkpointed
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["calls"] == 2  # forward + recomputation under FSDP2's hooks too
        worst = max(float((got["grads"][n] - g).norm() / g.norm().clamp(min=1e-30))
                    for n, g in want.items())
        assert worst <= 1e-6, worst


MEASURE = """
import json, resource, sys, torch
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.roles.trained import checkpoint_activations
torch.set_num_threads(1)
spec = TinyModelSpec(vocab_size=512, hidden_size=128, intermediate_size=512, num_layers=8,
                     num_heads=4, num_kv_heads=2, max_positions=1024)
model = build_tiny_policy(spec, seed=0).eval()
if sys.argv[1] == "on":
    checkpoint_activations(model)
ids = torch.randint(1, 512, (4, 1024), generator=torch.Generator().manual_seed(0))
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = rss()
# Reset the process's peak (VmHWM) to now: what building and importing peaked at before
# must not count (ru_maxrss cannot be reset).
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1], -1)
(-logp.gather(-1, ids[:, 1:, None]).sum()).backward()
status = open("/proc/self/status").read().splitlines()
peak = next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) * 1024
print(json.dumps({"update_bytes": peak - before}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_checkpointing_lowers_the_peak_memory_of_a_backward_pass() -> None:
    # Each setting in a fresh process, the peak RSS above the RSS before the forward pass;
    # glibc returns every large tensor to the system (mmap above 1 MiB), so the peak is the
    # tensors' and not the allocator's caching.
    env = child_env(MALLOC_MMAP_THRESHOLD_="1048576")
    used = {}
    for setting in ("off", "on"):
        out = subprocess.run([sys.executable, "-c", MEASURE, setting], env=env, check=True,
                             capture_output=True, text=True, timeout=300)
        used[setting] = json.loads(out.stdout.strip().splitlines()[-1])["update_bytes"]
    print(f"update peak above the model: off {used['off'] / 2**20:.0f} MiB, "
          f"on {used['on'] / 2**20:.0f} MiB ({used['off'] / used['on']:.1f}x less)")
    assert used["on"] * 2 < used["off"], used
