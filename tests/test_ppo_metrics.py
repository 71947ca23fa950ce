"""Chapter 5 — what a run writes down: JSONL metrics with resume semantics, sample dumps, the
progress bar, the one-line summary, the plots, and clear errors for missing optional
backends and for failed writes; the policy loss and the overlong penalty in the metrics and
in the line a run ends with."""

from __future__ import annotations

import errno
import io
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from avrid.ppo.data.credit import shaping_metrics
from avrid.ppo.driver.run import RunSummary
from avrid.ppo.outputs.metrics import MetricsLogger, Progress, SampleDump, format_step, read_metrics
from avrid.ppo.outputs.outdir import WriteError
from avrid.ppo.outputs.plots import phase_figure, reward_figure, write_plots
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.results.result import RESULT_VERSION, Span, WorkerResult
from avrid.results.timeline import Timeline
from avrid.workers import WorkerIdentity
from tests.test_cli_config import run_main
from tests.test_ppo_algo_registry import kl_batch

pytestmark = pytest.mark.chapter(5)


def run(path: Path, steps: range, resume_step: int | None = None) -> None:
    with MetricsLogger(path, resume_step=resume_step) as log:
        for s in steps:
            log.log(s, {"train/reward": s / 10, "time/step": 1.5, "n": s})


def test_logger_writes_one_flushed_line_per_step(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLogger(path)
    log.log(1, {"train/reward": 0.25, "count": 3, "ok": True,
                "loss": float("nan"), "kl": float("inf"), "t": torch.tensor(2.5)})
    # Flushed: readable while the logger is still open.
    assert read_metrics(path) == [{"step": 1, "train/reward": 0.25, "count": 3, "ok": 1,
                                   "loss": None, "kl": None, "t": 2.5}]
    log.log(2, {"train/reward": 0.5})
    log.close()
    log.close()  # idempotent
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["step"] for line in lines)
    assert "NaN" not in path.read_text()  # strict JSON
    with pytest.raises(ValueError, match="closed"):
        log.log(3, {})


def test_logger_rejects_bad_metrics(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path / "m.jsonl") as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log(1, {"step": 2})
        with pytest.raises(TypeError, match="'name'"):
            log.log(1, {"name": "text"})  # type: ignore[dict-item]
    assert read_metrics(tmp_path / "m.jsonl") == []


def test_fresh_logger_truncates(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    run(path, range(1, 6))
    run(path, range(1, 3))
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run(straight, range(1, 9))
    run(resumed, range(1, 7))            # crashed after step 6, last checkpoint at step 4
    run(resumed, range(5, 9), resume_step=4)
    assert resumed.read_text() == straight.read_text()
    # Resuming with no file yet starts one.
    run(tmp_path / "new.jsonl", range(3, 4), resume_step=2)
    assert read_metrics(tmp_path / "new.jsonl") == [
        {"step": 3, "train/reward": 0.3, "time/step": 1.5, "n": 3}]


def test_a_full_disk_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class FullDisk(io.StringIO):
        """What an append-mode file does on a full disk: the buffered bytes fail to land."""

        def flush(self) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    opened = Path.open
    monkeypatch.setattr(Path, "open", lambda self, mode="r", **kw: FullDisk() if mode == "a"
                        else opened(self, mode, **kw))
    for path, write in ((tmp_path / "metrics.jsonl", lambda p: run(p, range(1, 3))),
                        (tmp_path / "samples.jsonl",
                         lambda p: SampleDump(p).write(1, [{"response": "x"}]))):
        with pytest.raises(WriteError, match=rf"could not write {path}: No space left on "
                                             r"device"):
            write(path)


def test_read_metrics_skips_only_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x"')
    assert read_metrics(path) == [{"step": 1, "x": 1}]
    # Resume after the crash: the torn line is gone and appending yields whole lines.
    run(path, range(2, 3), resume_step=1)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(ValueError, match="m.jsonl:2"):
        read_metrics(path)


def test_sample_dump_lines_and_resume(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    with SampleDump(path) as dump:
        for step in (1, 2, 3):
            dump.write(step, [{"prompt": "2+2=", "response": "4", "reward": 1.0,
                               "tokens": torch.tensor([5, 6])},
                              {"prompt": "1+1=", "response": "3", "reward": float("nan")}])
    rows = read_metrics(path)
    assert len(rows) == 6 and [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3]
    assert rows[0] == {"step": 1, "prompt": "2+2=", "response": "4", "reward": 1.0,
                       "tokens": [5, 6]}
    assert rows[1]["reward"] is None
    with SampleDump(path, resume_step=2) as dump:
        dump.write(3, [{"prompt": "p", "response": "r", "reward": 0.0}])
    assert [(r["step"], r["prompt"]) for r in read_metrics(path)] == [
        (1, "2+2="), (1, "1+1="), (2, "2+2="), (2, "1+1="), (3, "p")]


def test_progress_disabled_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(10, enabled=False) as bar:
        for s in range(1, 11):
            bar.update(s, {"train/reward": 0.5, "time/step": 2.0})
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_progress_enabled_shows_headline_numbers() -> None:
    buf = io.StringIO()
    bar = Progress(4, initial=1, file=buf)
    bar.update(2, {"train/reward": 0.25, "val/reward": 0.5, "time/step": 3.0})
    bar.update(2)  # same step again: no move
    bar.close()
    text = buf.getvalue()
    assert "2/4" in text and "reward=0.25" in text and "val=0.5" in text
    assert "s/step=3" in text


def test_format_step() -> None:
    metrics = {"train/reward": 0.123456, "val/reward": 0.5, "time/step": 12, "other": 1.0}
    assert format_step(3, metrics) == \
        "step 3 | train/reward 0.1235 | val/reward 0.5 | time/step 12"
    assert format_step(3, metrics, keys=["other", "missing"]) == "step 3 | other 1"


def test_missing_tensorboard_is_a_clear_error(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Force the import to fail whether or not tensorboard happens to be installed.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    with pytest.raises(ImportError, match="pip install tensorboard"):
        MetricsLogger(path, tensorboard_dir=str(tmp_path / "tb"))
    assert path.read_text() == '{"step": 1}\n'  # failed before touching the file


def test_missing_wandb_is_a_clear_error(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path / "m.jsonl", wandb_project="avrid")



class FakeBackend:
    """Stands in for SummaryWriter and a wandb run: records every call."""

    def __init__(self, **kw: object) -> None:
        self.init, self.calls = kw, []

    def __getattr__(self, name: str):  # add_scalar, add_text, log, close, finish
        return lambda *a, **kw: self.calls.append((name, a, kw))


def test_backends_get_finite_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[FakeBackend] = []

    def make(**kw: object) -> FakeBackend:
        made.append(FakeBackend(**kw))
        return made[-1]

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=make))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=make))
    with MetricsLogger(tmp_path / "m.jsonl", resume_step=4, tensorboard_dir=str(tmp_path),
                       wandb_project="avrid", run_config={"lr": 1e-6}) as log:
        log.log(5, {"train/reward": 0.5, "loss": float("nan")})
    tb, wb = made
    assert tb.init == {"log_dir": str(tmp_path), "purge_step": 5}  # hides steps > 4
    assert wb.init["project"] == "avrid" and wb.init["config"] == {"lr": 1e-6}
    assert ("add_scalar", ("train/reward", 0.5, 5), {}) in tb.calls
    assert not any(c[0] == "add_scalar" and c[1][0] == "loss" for c in tb.calls)
    assert ("log", ({"train/reward": 0.5},), {"step": 5}) in wb.calls
    assert tb.calls[-1][0] == "close" and wb.calls[-1][0] == "finish"

PHASES = {"generate": 2.0, "reward": 0.2, "old_logp": 0.3, "ref_logp": 0.3, "values": 0.3,
          "advantages": 0.01, "critic_update": 0.8, "actor_update": 1.0, "weight_sync": 0.1}


def synthetic_rows(n: int = 12) -> list[dict]:
    rows = []
    for s in range(1, n + 1):
        times = {f"time/{p}": t * (1 + 0.05 * s) for p, t in PHASES.items()}
        row: dict = {"step": s, "train/reward": s / n, **times,
                     "time/step": sum(times.values()) + 0.2}  # 0.2 s of driver overhead
        if s % 4 == 0:
            row["val/reward"] = s / n - 0.1
        rows.append(row)
    return rows


def tiny_timeline() -> Timeline:
    t0 = 1_700_000_000.0

    def result(role: str, rank: int, *spans: tuple[str, float, float]) -> WorkerResult:
        return WorkerResult(
            version=RESULT_VERSION, identity=WorkerIdentity(role=role, rank=rank, world_size=2),
            sample_ids=torch.tensor([rank]), outputs=None, metrics=(),
            spans=tuple(Span(name=n, start=t0 + a, end=t0 + b) for n, a, b in spans))

    return Timeline.from_results(
        [result("actor", 0, ("actor_update", 1.0, 3.0)),
         result("actor", 1, ("actor_update", 1.0, 2.5))],
        driver_spans=[Span(name="step", start=t0, end=t0 + 4.0)])


def test_write_plots_creates_pngs(tmp_path: Path) -> None:
    rows = synthetic_rows()
    paths = write_plots(rows, tmp_path / "plots")
    assert [p.name for p in paths] == ["reward.png", "phases.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    paths = write_plots(rows, tmp_path / "with_tl", timeline=tiny_timeline())
    assert [p.name for p in paths] == ["reward.png", "phases.png", "timeline.png",
                                       "timeline.json"]
    assert paths[2].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(paths[3].read_text())["traceEvents"]
    # Atomic writes leave no temporary files behind.
    assert sorted(p.name for p in (tmp_path / "with_tl").iterdir()) == sorted(
        p.name for p in paths)


def test_figures_contents_and_empty_rows(tmp_path: Path) -> None:
    rows = synthetic_rows(8)
    lines = reward_figure(rows).axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["train/reward", "val/reward"]
    assert list(lines[1].get_xdata()) == [4, 8]  # val only where it was logged
    legend = [t.get_text() for t in phase_figure(rows).legends[0].get_texts()]
    assert legend[0].startswith("generate ") and legend[-1] == "time/step"
    assert len(legend) == len(PHASES) + 1
    # Nothing logged yet: figures still draw (with a note) instead of failing.
    assert [p.name for p in write_plots([], tmp_path)] == ["reward.png", "phases.png"]


# ---- the overlong penalty and the policy loss: in the metrics and the run's last line ---------

def test_shaping_metrics_report_the_mean_overlong_penalty() -> None:
    # Lengths 3, 1, 2, 4, budget 4, buffer 2, factor 0.5: penalties -0.25, 0, 0, -0.5.
    on = with_overrides(PPOConfig(), ["algo.overlong_buffer=2", "algo.overlong_penalty=0.5"])
    assert shaping_metrics(kl_batch(), on, max_response=4) == {
        "reward/overlong_penalty": pytest.approx(-0.1875)}
    assert shaping_metrics(kl_batch(), PPOConfig(), max_response=4) == {}  # off: no key


def test_finished_line_shows_the_last_policy_loss_and_overlong_penalty(tmp_path: Path) -> None:
    rows = [{"step": 0, "val/reward": 0.1},
            {"step": 1, "actor/pg_loss": -0.5, "reward/overlong_penalty": -0.25},
            {"step": 2, "reward/overlong_penalty": -0.125, "val/reward": 0.4}]  # no update
    summary = RunSummary(out_dir=tmp_path, rows=rows, initial_val_reward=0.1,
                         final_val_reward=0.4, seconds=3.0)
    assert summary.finished_line("ppo") == (
        f"ppo finished in 3 s; validation reward 0.100 -> 0.400; last step: policy loss -0.5, "
        f"overlong penalty -0.125; outputs in {tmp_path}/ (the policy in Hugging Face format: "
        f"{tmp_path}/export/)")
    summary = RunSummary(out_dir=tmp_path, rows=rows[:1], initial_val_reward=0.1,
                         final_val_reward=0.1, seconds=3.0)
    assert "last step" not in summary.finished_line("ppo")


def test_a_run_logs_its_policy_loss_and_overlong_penalty_and_ends_with_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, printed, err = run_main(
        capsys, "ppo", "--backend", "inprocess", "--steps", "2", "--out", str(tmp_path),
        "--set", "train.prompts_per_step=4", "--set", "algo.responses_per_prompt=4",
        "--set", "train.mini_batch_size=16", "--set", "train.val_prompts=4",
        "--set", "train.progress=false", "--set", "algo.overlong_buffer=2")
    assert code == 0, err
    steps = read_metrics(tmp_path / "metrics.jsonl")[1:]
    for row in steps:
        assert row["reward/overlong_penalty"] <= 0.0
        # No KL and no entropy term in tiny-ppo: the policy loss is the whole actor loss.
        assert row["actor/pg_loss"] == row["actor/loss"]
    last = steps[-1]
    assert (f"; last step: policy loss {last['actor/pg_loss']:.4g}, overlong penalty "
            f"{last['reward/overlong_penalty']:.4g}; outputs in") in printed.splitlines()[-1]
