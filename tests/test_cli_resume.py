"""``avrid ppo --resume --out DIR`` resumes with the run's own config (issue 42, item 6).

A run records its config in every checkpoint's ``state.json``; without --preset or --config,
``--resume --out DIR`` starts from that config (`avrid.ppo.driver.saving.saved_config`), so
the user does not type the run's command again. Flags and --set on top may change what a
resume may change (``train.steps``, ...); anything else, or a preset that differs from the
run's config, is still refused in one line.

The runs are one- to four-step runs of tiny-ppo in this process (`SMALL`), a few seconds each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from avrid.cli import main
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.outputs.metrics import read_metrics
from tests.test_cli_config import run_main
from tests.test_ppo_trainer import algorithmic

pytestmark = pytest.mark.chapter(5)

SMALL = ["--backend", "inprocess", "--set", "train.prompts_per_step=4",
         "--set", "algo.responses_per_prompt=4", "--set", "train.mini_batch_size=16",
         "--set", "train.val_prompts=4", "--set", "train.val_every=2",
         "--set", "train.checkpoint_every=2", "--set", "train.progress=false"]
"""Settings that differ from the tiny-ppo preset: a resume that ignored the run's own config
(and fell back to the preset) would be refused or train something else."""


def interrupt_at(monkeypatch: pytest.MonkeyPatch, stop_step: int) -> None:
    """Make step `stop_step` + 1 stop the run as Ctrl-C would (a KeyboardInterrupt in the
    driver), after the checkpoint of step `stop_step` is written."""
    original = Trainer.train_step

    def train_step(self: Trainer, step: int):  # noqa: ANN202
        if step == stop_step:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_resume_with_out_alone_continues_an_interrupted_run_exactly(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    code, _, err = run_main(capsys, "ppo", "--out", str(full), "--steps", "4", *SMALL)
    assert code == 0, err
    with monkeypatch.context() as patch:
        interrupt_at(patch, 2)
        code, _, err = run_main(capsys, "ppo", "--out", str(split), "--steps", "4", *SMALL)
    assert code == 130, err
    assert f"continue with `avrid ppo --resume --out {split}`" in err, err

    code, printed, err = run_main(capsys, "ppo", "--resume", "--out", str(split))
    assert code == 0, err
    assert f"resuming from {split / 'checkpoints' / 'step_000002'} (step 2)" in printed, printed
    rows = read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert algorithmic(rows) == algorithmic(read_metrics(full / "metrics.jsonl"))


def test_resume_takes_the_runs_config_and_changes_only_what_may_change(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, _, err = run_main(capsys, "ppo", "--out", str(out), "--steps", "1", *SMALL)
    assert code == 0, err
    # What the resume would run: the recorded config, the new step count on top.
    code, printed, err = run_main(capsys, "ppo", "--resume", "--out", str(out), "--steps", "2",
                                  "--set", "train.val_every=1", "--print-config", "json")
    assert code == 0, err
    config = json.loads(printed)
    assert config["train"]["prompts_per_step"] == 4 and config["algo"]["responses_per_prompt"] \
        == 4 and config["placement"]["backend"] == "inprocess"
    assert (config["train"]["steps"], config["train"]["val_every"]) == (2, 1)
    assert config["train"]["resume"] is True and config["train"]["out_dir"] == str(out)

    code, printed, err = run_main(capsys, "ppo", "--resume", "--out", str(out), "--steps", "2")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    assert "ppo finished" in printed


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-step run, shared by tests that only read it (a refused resume changes
    nothing)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    main(["ppo", "--out", str(out), "--steps", "1", *SMALL])  # returns: it succeeded
    return out


@pytest.mark.parametrize("extra, names", [
    (["--set", "algo.clip_low=0.1"], "algo.clip_low: 0.2 -> 0.1"),
    (["--preset", "tiny-ppo"], "train.prompts_per_step: 4 -> 16"),
])
def test_resume_still_refuses_a_change_it_may_not_make(
        capsys: pytest.CaptureFixture[str], one_step_run: Path, extra: list[str],
        names: str) -> None:
    code, _, err = run_main(capsys, "ppo", "--resume", "--out", str(one_step_run), "--steps",
                            "2", *extra)
    assert code == 2, err
    assert err.startswith("avrid ppo: cannot resume: the config differs") and names in err, err
    assert "resumes with the run's own config" in err and len(err.strip().splitlines()) == 1
