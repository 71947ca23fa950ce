"""Chapter 5 — a run never loses a user's data (issue 11): one run per output directory, a
resume that refuses rather than starts over, a fresh run that refuses to overwrite an earlier
one, output paths checked at start, periodic checkpoints by default, a damaged latest
checkpoint that points at the intact one, and the driver's RNGs restored on resume.

Runs are tiny and in-process (see `tests.test_ppo_trainer.tiny`), each in a fresh tmp dir.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from avrid.ppo.driver import run as run_module
from avrid.ppo.driver.run import NoCheckpointError, train
from avrid.ppo.driver.saving import restore_rng_states, rng_states
from avrid.ppo.outputs.checkpoint import CorruptCheckpointError, latest_checkpoint, load_checkpoint
from avrid.ppo.outputs.outdir import OutDirBusyError, OutDirError, OutDirLock, WriteError
from avrid.ppo.setup.config import TrainConfig
from avrid.ppo.setup.presets import PRESETS
from tests.helpers import child_env, snapshot
from tests.test_ppo_trainer import ROOT, EchoFirstTask, algorithmic, tiny

pytestmark = pytest.mark.chapter(5)


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a run gets as far as building its trainer."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run went on to build its trainer")

    monkeypatch.setattr(run_module, "Trainer", refuse)


# ---- resume without a checkpoint; a fresh run over an earlier one ------------------------------

def test_resume_without_a_checkpoint_refuses_and_truncates_nothing(tmp_path: Path,
                                                                   no_workers: None) -> None:
    out = tmp_path / "run"
    out.mkdir()  # a run that died before its first checkpoint
    (out / "metrics.jsonl").write_text('{"step": 0, "val/reward": 0.1}\n')
    (out / "samples.jsonl").write_text('{"step": 1, "response": "47"}\n')
    before = snapshot(out)
    with pytest.raises(NoCheckpointError, match=rf"cannot resume: {out / 'checkpoints'} holds "
                                                r"no checkpoint.*--out"):
        train(tiny(out, "train.resume=true"))
    assert snapshot(out) == before
    with pytest.raises(NoCheckpointError, match="there is no directory"):  # nothing at all
        train(tiny(tmp_path / "empty", "train.resume=true"))
    assert not (tmp_path / "empty").exists()
    assert isinstance(NoCheckpointError("x"), ValueError)  # `avrid ppo`: one line, exit 2


def test_a_fresh_run_refuses_a_directory_holding_an_earlier_run(tmp_path: Path) -> None:
    train(tiny(tmp_path, "train.steps=1"))
    before = snapshot(tmp_path)
    with pytest.raises(OutDirError, match=rf"{tmp_path} already holds an earlier run "
                                          r"\(metrics.jsonl, samples.jsonl, 1 checkpoint.*"
                                          r"--resume.*--out"):
        train(tiny(tmp_path, "train.steps=1"))
    assert snapshot(tmp_path) == before
    # The two ways out work: resume it, or use another directory.
    assert [r["step"] for r in train(tiny(tmp_path, "train.steps=2",
                                          "train.resume=true")).rows] == [0, 1, 2]
    assert train(tiny(tmp_path / "other", "train.steps=1")).rows


# ---- one run per output directory --------------------------------------------------------------

def test_a_second_run_on_a_busy_directory_is_refused_until_the_holder_dies(
        tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from avrid.ppo.outputs.outdir import OutDirLock; "
         "OutDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)",
         str(tmp_path)], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(OutDirBusyError, match=rf"output directory {tmp_path} is in use by "
                                                  rf"another run \(pid {holder.pid} on "):
            train(tiny(tmp_path))
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()  # SIGKILL: no clean-up runs, yet the kernel drops the lock
        holder.wait()
    with OutDirLock(tmp_path):  # a crashed holder leaves no stale lock
        pass
    with OutDirLock(tmp_path), pytest.raises(OutDirBusyError, match=f"pid {os.getpid()}"):
        OutDirLock(tmp_path).acquire()  # a second lock in one process is refused too


# ---- output paths checked at start -------------------------------------------------------------

def test_an_unwritable_checkpoint_directory_fails_at_start(tmp_path: Path,
                                                          no_workers: None) -> None:
    (tmp_path / "checkpoints").write_text("a file where the directory should be")
    with pytest.raises(WriteError, match=rf"could not write {tmp_path / 'checkpoints'}: "
                                         r".*not a directory"):
        train(tiny(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes through permission bits")
def test_a_read_only_checkpoint_directory_fails_at_start(tmp_path: Path,
                                                         no_workers: None) -> None:
    (tmp_path / "checkpoints").mkdir(mode=0o555)
    try:
        with pytest.raises(WriteError, match=rf"could not write {tmp_path / 'checkpoints'}: "
                                             r"Permission denied"):
            train(tiny(tmp_path))
    finally:
        (tmp_path / "checkpoints").chmod(0o755)


# ---- periodic checkpoints by default -----------------------------------------------------------

def test_runs_checkpoint_periodically_by_default() -> None:
    assert TrainConfig().checkpoint_every > 0
    for name, make in PRESETS.items():
        t = make().train
        assert 0 < t.checkpoint_every, f"preset {name} checkpoints only at its end"
        assert 1 <= t.keep_checkpoints <= 5, f"preset {name} keeps unbounded checkpoints"
    assert tiny(Path("x")).train.checkpoint_every == TrainConfig().checkpoint_every


# ---- a damaged latest checkpoint; leftovers of a killed save -----------------------------------

def test_a_damaged_latest_checkpoint_is_refused_and_the_intact_one_resumes(
        tmp_path: Path) -> None:
    train(tiny(tmp_path, "train.steps=2", "train.checkpoint_every=1"))
    ckpts = tmp_path / "checkpoints"
    shard = ckpts / "step_000002" / "actor" / "model" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the weights changed in place
    shard.write_bytes(bytes(data))
    (ckpts / ".tmp-step_000003-killed").mkdir()  # a save killed midway
    with pytest.raises(CorruptCheckpointError) as err:
        train(tiny(tmp_path, "train.steps=3", "train.resume=true"))
    message = str(err.value)
    assert "step_000002/actor/model/__0_0.distcp" in message
    assert f"train.resume_from={ckpts / 'step_000001'}" in message
    summary = train(tiny(tmp_path, "train.steps=3", "train.resume=true",
                         "train.resume_from=step_000001", "train.checkpoint_every=1"))
    assert [r["step"] for r in summary.rows] == [0, 1, 2, 3]
    assert not (ckpts / ".tmp-step_000003-killed").exists()
    assert load_checkpoint(latest_checkpoint(ckpts)).step == 3
    load_checkpoint(ckpts / "step_000002")  # re-saved by the resumed run: intact again


# ---- the driver's RNGs are restored on resume --------------------------------------------------

def test_rng_states_round_trip() -> None:
    saved = rng_states()
    drawn = (torch.rand(3), random.random(), np.random.rand())
    restore_rng_states(saved)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(drawn[0], again[0]) and drawn[1:] == again[1:]


class NoisyTask(EchoFirstTask):
    """A plug-in task whose reward draws from Python's global RNG (seeded when made)."""

    def reward(self, prompt, response: str) -> float:  # noqa: ANN001
        return super().reward(prompt, response) + random.random()


def make_noisy_task() -> NoisyTask:
    random.seed(0)
    return NoisyTask()


def test_a_task_drawing_from_the_global_rng_resumes_exactly(tmp_path: Path) -> None:
    task = ["task.name=tests.test_ppo_run_safety:make_noisy_task", "task.options="]
    full = train(tiny(tmp_path / "full", "train.steps=4", *task))
    out = tmp_path / "split"
    train(tiny(out, "train.steps=2", *task))
    resumed = train(tiny(out, "train.steps=4", "train.resume=true", *task))
    assert algorithmic(resumed.rows)[3:] == algorithmic(full.rows)[3:]
