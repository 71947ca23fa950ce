"""Chapter 5 — sharded checkpoints (`fsdp.save_shards`, `outputs/shards.py`) on two gloo
ranks, each a subprocess: a save/restore round trip of an FSDP2 model and its AdamW state is
bit-exact, and a save raises a rank's peak resident memory by less than one full fp32 copy of
the model (the gather-everything save it replaced, measured the same way, raises it by more);
a checkpoint written before sharding (whole weights, format 2) still resumes exactly; and
shards inside a checkpoint are atomic and checksummed like its other files.

Not here: the checkpoint directory around the shards (test_ppo_checkpoint.py), a resumed run
(test_pipeline_resume.py, test_ppo_trainer.py), the export (test_ppo_export.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from avrid.ppo.outputs.shards import read_model_weights
from avrid.workers.outcome import free_port
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(5)

RANKS_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from avrid.ppo.roles import fsdp
    from avrid.ppo.roles.fsdp import load_shards, save_shards

    mode, rank, port, directory, layers, width = sys.argv[1], *sys.argv[2:]
    rank, port, layers, width = int(rank), int(port), int(layers), int(width)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)

    class Trunk(torch.nn.Module):  # the shape `fsdp.shard_model` expects: model.layers
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Trunk()
            self.head = torch.nn.Linear(width, 3)

        def forward(self, x):
            for layer in self.model.layers:
                x = torch.tanh(layer(x))
            return self.head(x)

    def status(field):  # bytes, from /proc/self/status (kB there)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    def build(seed):
        torch.manual_seed(seed)
        model = fsdp.shard_model(Model(), dist.group.WORLD, 2, "cpu")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))

    def step(model, opt, seed):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(seed))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def full(model, opt):  # every tensor whole, as bytes: equal bytes is bit-equal
        out = {n: v.full_tensor() for n, v in model.state_dict().items()}
        for i, s in opt.state.items():
            for k, v in s.items():
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[f"opt.{i}.{k}"] = v
        return {n: t.detach().contiguous().reshape(-1).view(torch.uint8) for n, t in out.items()}

    model, opt = build(0)
    step(model, opt, 1)
    if mode == "roundtrip":
        save_shards(model, opt, directory)
        saved = full(model, opt)
        other, other_opt = build(1)  # other weights, no optimizer state yet
        load_shards(other, other_opt, directory)
        restored = full(other, other_opt)
        same = sorted(saved) == sorted(restored) and all(
            torch.equal(saved[n], restored[n]) for n in saved)
        step(model, opt, 2)  # and the next step from either is the same step
        step(other, other_opt, 2)
        again = full(model, opt), full(other, other_opt)
        same_after = all(torch.equal(again[0][n], again[1][n]) for n in again[0])
        print(json.dumps({"same": same, "same_after": same_after, "keys": len(saved)}))
    else:  # "new" or "old": how much a save raises this rank's peak resident memory
        dist.barrier()
        # Reset the peak (VmHWM) to the present resident size, so that what the step
        # before needed (gradients) does not hide what the save needs.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS")
        if mode == "new":
            save_shards(model, opt, directory)
        else:  # what TrainedWorker.state did before sharded checkpoints
            kept = fsdp.full_state_dict(model), fsdp.optimizer_state(opt)
        print(json.dumps({"grew": status("VmHWM") - before}))
    from tests.helpers import leave_process_group
    leave_process_group()  # not a normal exit: gloo can abort in its teardown (see there)
""")


def run_ranks(tmp_path: Path, mode: str, layers: int, width: int) -> list[dict]:
    """Run the script on two gloo ranks; each prints one JSON line."""
    port = free_port()
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    # Every allocation of 1 MiB or more gets its own mapping, returned when freed, so that
    # the peak counts live memory, not glibc's cache (as in test_hybrid_handoff.py).
    env = child_env(MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    procs = [subprocess.Popen([sys.executable, str(script), mode, str(r), str(port),
                               str(tmp_path / "ckpt"), str(layers), str(width)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=170) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_a_sharded_round_trip_on_two_gloo_ranks_is_bit_exact(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, "roundtrip", layers=3, width=16)
    assert all(r["same"] and r["same_after"] for r in results), results
    ckpt = tmp_path / "ckpt"
    # One file per rank and DCP's index, for the weights and the optimizer alike.
    for part in ("model", "optim"):
        assert sorted(p.name for p in (ckpt / part).iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp"]
    # The export's reader puts the shards together in one process, no process group.
    whole = read_model_weights(ckpt)
    assert sorted(whole) == sorted([f"model.layers.{i}.weight" for i in range(3)]
                                   + ["head.weight", "head.bias"])
    assert whole["model.layers.0.weight"].shape == (16, 16)
    assert all(t.dtype == torch.float32 for t in whole.values())


@pytest.mark.slow
def test_a_sharded_save_stays_under_one_full_fp32_copy_per_rank(tmp_path: Path) -> None:
    layers, width = 32, 1024  # 32 x 4 MiB: a 128 MiB fp32 model, 64 MiB of it per rank
    full_copy = layers * width * width * 4
    new = [r["grew"] for r in run_ranks(tmp_path, "new", layers, width)]
    old = [r["grew"] for r in run_ranks(tmp_path, "old", layers, width)]
    print("peak growth per rank during a save, sharded:",
          [f"{g / 2**20:.1f} MiB" for g in new], "gathered (before):",
          [f"{g / 2**20:.1f} MiB" for g in old], f"one full copy: {full_copy / 2**20:.0f} MiB")
    assert max(new) < full_copy / 2, new
    assert min(old) >= full_copy, old  # the measure sees a full copy where there is one


def test_a_checkpoint_written_before_sharding_still_resumes_exactly(tmp_path: Path) -> None:
    from avrid.ppo.driver.run import train
    from avrid.ppo.driver.saving import resume_weights
    from avrid.ppo.driver.trainer import Trainer
    from avrid.ppo.outputs.checkpoint import load_checkpoint, save_checkpoint
    from tests.test_ppo_trainer import algorithmic, tiny

    full = train(tiny(tmp_path / "full", "train.steps=4"))
    out = tmp_path / "old"
    train(tiny(out, "train.steps=2"))
    # Rewrite its step-2 checkpoint as avrid wrote them before sharding: whole weights (the
    # gathered `Trainer.state`), per-rank optimizer states, a format-2 manifest.
    ck = load_checkpoint(out / "checkpoints")
    with Trainer(tiny(out, "train.steps=2")) as trainer:
        trainer.start(*resume_weights(ck), step=ck.step)
        whole = trainer.state()
    step_dir = save_checkpoint(out / "checkpoints", ck.step, weights=whole.weights,
                               optimizers=whole.optimizers, state=ck.state, extra=ck.extra)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest.pop("sharded") == [] and not (step_dir / "actor").exists()
    (step_dir / "manifest.json").write_text(json.dumps({**manifest, "format": 2}))
    resumed = train(tiny(out, "train.steps=4", "train.resume=true"))
    assert algorithmic(resumed.rows)[3:] == algorithmic(full.rows)[3:]


def test_shards_ride_in_the_atomic_checkpoint_with_a_checksum_each(tmp_path: Path) -> None:
    from avrid.ppo.outputs.checkpoint import load_checkpoint, save_checkpoint
    from avrid.ppo.outputs.manifest import verify_checkpoint
    from avrid.ppo.roles.fsdp import load_shards, save_shards

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)  # one process, no process group: DCP's single-process path
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    def write(tmp: Path) -> list[str]:
        save_shards(model, opt, tmp / "actor")
        return ["actor"]

    path = save_checkpoint(tmp_path, 5, state={"step": 5}, write_shards=write)
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert {"actor/model/.metadata", "actor/model/__0_0.distcp", "actor/optim/.metadata",
            "actor/optim/__0_0.distcp", "state.json"} == set(files)
    ck = load_checkpoint(tmp_path)
    assert ck.sharded == {"actor": path / "actor"} and ck.weights == {}
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.AdamW(other.parameters())
    load_shards(other, other_opt, ck.sharded["actor"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values(), strict=True))
    assert torch.equal(other_opt.state[other.weight]["exp_avg_sq"],
                       opt.state[model.weight]["exp_avg_sq"])

    def broken(tmp: Path) -> list[str]:  # a rank failed midway: nothing may be left
        save_shards(model, opt, tmp / "actor")
        raise RuntimeError("rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        save_checkpoint(tmp_path, 6, state={"step": 6}, write_shards=broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000005"]

    shard = path / "actor" / "optim" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated
    with pytest.raises(ValueError, match="actor/optim/__0_0.distcp"):
        verify_checkpoint(path)
    with pytest.raises(ValueError, match="actor/optim/__0_0.distcp"):
        load_checkpoint(path)
    load_checkpoint(path, training_state=False)  # an export reads the weights only
