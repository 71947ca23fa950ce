"""What a run shows and writes besides its numbers: a clean screen (no escape codes, no stray
warnings, a progress bar that starts with the first step and that printed lines do not land
on), a clear error for a missing TensorBoard that creates nothing, one W&B run per training
run (named, offline on request, continued on resume), and a sample dump that covers several
prompts.

One test runs the command on Ray in a subprocess (its own local Ray, two short steps, a task
whose reward function prints); the others run in process or need no run at all.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from avrid.ppo.driver.run import metrics_logger, spread_rows, train
from avrid.ppo.outputs.metrics import MetricsLogger, read_metrics
from avrid.ppo.outputs.progress import Progress, _bar_class
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.task import Prompt
from tests.helpers import child_env
from tests.test_ppo_trainer import tiny as trainer_tiny

pytestmark = pytest.mark.chapter(5)

ROOT = Path(__file__).resolve().parents[1]


def tiny(out: Path, *extra: str) -> PPOConfig:
    """test_ppo_trainer's in-process run cut to one step of 4 prompts x 4 responses."""
    return trainer_tiny(out, "train.steps=1", "train.prompts_per_step=4",
                        "train.val_prompts=4", "train.val_every=100", *extra)


# ---- the screen --------------------------------------------------------------------------------

class ChattyDigits:
    """The default run's task, with a reward function that prints once, as a user's might:
    Ray relays the line to the driver, where it must arrive whole, on its own line, prefixed
    "(RewardWorker pid=...)" and without colour codes."""

    def __init__(self) -> None:
        self._digits = load_task("digits", op="reverse", length=2, num_val=30)
        self.name, self.alphabet = "chatty-digits", self._digits.alphabet
        self.max_response_tokens = self._digits.max_response_tokens
        self.calls = 0

    def train_prompts(self) -> Sequence[Prompt]:
        return self._digits.train_prompts()

    def val_prompts(self) -> Sequence[Prompt]:
        return self._digits.val_prompts()

    def reward(self, prompt: Prompt, response: str) -> float:
        self.calls += 1
        if self.calls == 6:  # the 4 validation prompts come first: this is in step 1
            print(f"scoring {prompt.text}{response}", flush=True)
        return self._digits.reward(prompt, response)


def make_chatty_task() -> ChattyDigits:
    return ChattyDigits()


@pytest.mark.slow
def test_the_command_on_ray_prints_no_escape_codes_or_warnings_and_starts_the_bar_late(
        tmp_path: Path) -> None:
    env = {k: v for k, v in child_env().items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(
        [sys.executable, "-m", "avrid.cli", "ppo", "--steps", "2", "--address", "local",
         "--task", "tests.test_ppo_output_clean:make_chatty_task",
         "--out", str(tmp_path / "run"), "--set", "train.prompts_per_step=4",
         "--set", "train.val_every=100", "--set", "train.val_prompts=4"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=180)
    text = done.stdout  # stdout and stderr in the order they were written
    assert done.returncode == 0, text
    assert "\x1b[" not in text, repr(text)  # no colour codes: not from Ray, not at exit
    warnings = [line for line in re.split(r"[\r\n]", text) if "warning" in line.lower()]
    assert not warnings, text
    # The plain line first, then the untrained validation, then the progress (its clock
    # starts with the first step, so its rate is the steps', not Ray's start-up). Not a
    # terminal here (a pipe, like a CI log): plain progress lines, no bar redrawn with "\r".
    starting = text.index("starting 5 workers on Ray ...")
    step0 = text.index("step 0 | val/reward")
    progress = text.index("step 2/2 (100%) |")
    assert starting < step0 < progress, text
    assert "\r" not in text, repr(text)
    # The worker's line: whole, alone on its line.
    relayed = [line for line in text.split("\n") if "scoring " in line]
    assert len(relayed) == 1 and relayed[0].startswith("(RewardWorker pid="), text
    assert "finished" in text.splitlines()[-1], text


NUMA_LINE = re.compile(r"^\(PolicyWorker pid=\d+\) \[rank\d+\]:\[W[^]]* utils\.cpp:\d+\] "
                       r"Warning: NUMA binding: ")
"""The one line of vLLM's that avrid cannot keep off the screen (see `engines/vllm_logs.py`):
its CPU build's C++ code warns through torch's C++ logger, whose level a process fixes when
it starts."""


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_vllm_command_shows_avrids_own_lines_only(tmp_path: Path) -> None:
    """`avrid ppo --preset tiny-ppo-vllm --steps 2` printed 71 lines, most of them vLLM's
    warnings, a harmless "Chat template warmup failed" traceback among them."""
    env = {k: v for k, v in child_env().items()
           if k not in ("PYTHONWARNINGS", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH")}
    done = subprocess.run(
        [sys.executable, "-m", "avrid.cli", "ppo", "--preset", "tiny-ppo-vllm", "--steps", "2",
         "--address", "local", "--out", str(tmp_path / "run")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1100)
    text = done.stdout.decode()  # bytes: a "\r" (the bar redrawn in place) stays a "\r"
    assert done.returncode == 0, text
    assert "Traceback" not in text and "\x1b[" not in text, text
    lines = [line for line in text.split("\n") if line.strip()]
    assert len(lines) <= 15, text
    # Each line as a terminal shows it (what follows its last "\r"): avrid's own lines, the
    # progress bar, and nothing of vLLM's but the C++ line it cannot hold back.
    shown = [line.rsplit("\r", 1)[-1] for line in lines]
    own = ("starting ", "step ", "avrid ppo: ")
    foreign = [line for line in shown if not line.startswith(own)
               and not re.match(r"\s*\d+%\|", line) and not NUMA_LINE.match(line)]
    assert foreign == [], text
    assert text.count("NUMA binding") <= 2, text  # once per policy rank's engine


class Terminal(io.StringIO):
    """A stream that says it is a terminal: the bar is drawn (and redrawn in place) there."""

    def isatty(self) -> bool:
        return True


def test_lines_printed_while_the_bar_is_shown_go_above_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    screen = Terminal()  # one terminal for the bar, stdout and stderr
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    bar = Progress(3, file=screen)
    print("before")
    assert screen.getvalue() == "before\n"  # nothing drawn yet: the clock has not started
    bar.start()
    assert "0/3" in screen.getvalue()
    assert sys.stdout is not screen  # redirected through the bar while it is shown
    print("step 0 | val/reward 0.5")
    bar.update(1, {"train/reward": 0.25})
    relay = threading.Thread(target=print, args=("(PolicyWorker pid=1) hello",),
                             kwargs={"file": sys.stderr})
    relay.start()  # like Ray's thread that relays the workers' output
    relay.join()
    print("part", end="")  # a part line waits for the rest
    print(" and the rest")
    bar.update(2)
    bar.close()
    bar.close()
    assert sys.stdout is screen and sys.stderr is screen  # put back
    # A line that ended in "\n" shows what follows its last "\r": the printed text alone.
    shown = [line.rsplit("\r", 1)[-1] for line in screen.getvalue().split("\n")]
    for printed in ("step 0 | val/reward 0.5", "(PolicyWorker pid=1) hello",
                    "part and the rest"):
        assert printed in shown, shown
    assert "2/3" in screen.getvalue()


def test_where_stderr_is_not_a_terminal_a_plain_line_every_ten_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A CI log or a batch job's file: no bar redrawn with "\r" (300 updates in one line of
    # `make demo`'s log), a plain line every 10 steps instead, at the last step too.
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    stdout, redirected = sys.stdout, set()
    with Progress(30) as bar:
        for step in range(1, 31):
            val = {"val/reward": 0.5} if step == 25 else {}
            bar.update(step, {"train/reward": step / 30, "time/step": 0.5, **val})
            redirected.add(sys.stdout is not stdout)
    text = log.getvalue()
    assert "\r" not in text and "\x1b[" not in text, repr(text[:300])
    assert redirected == {False}  # nothing is redrawn: printed lines go as they are
    lines = text.splitlines()
    assert [line.split(" |")[0] for line in lines] == [
        "step 10/30 (33%)", "step 20/30 (66%)", "step 30/30 (100%)"]
    assert "reward=0.333" in lines[0] and "val=0.5" in lines[2]  # the latest of each number
    # A resumed run that stops early: its last line says where; every M seconds (here 0)
    # a line all the same.
    log.truncate(0)
    log.seek(0)
    with Progress(30, initial=20) as bar:
        bar.update(25)
    assert log.getvalue().startswith("step 25/30 (83%) |")
    log.truncate(0)
    log.seek(0)
    with Progress(30, every_s=0.0) as bar:
        for step in (1, 2, 3):
            bar.update(step)
    assert len(log.getvalue().splitlines()) == 3


def test_a_disabled_bar_leaves_the_streams_alone(capsys: pytest.CaptureFixture[str]) -> None:
    stdout = sys.stdout
    with Progress(2, enabled=False) as bar:
        bar.start()
        assert sys.stdout is stdout
        print("plain")
        bar.update(1)
    assert capsys.readouterr().out == "plain\n"


def test_notebooks_without_ipywidgets_get_the_text_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    import tqdm.auto
    import tqdm.std

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ipywidgets" else real(name, *a))
    assert _bar_class() is tqdm.std.tqdm  # tqdm.auto would warn "IProgress not found"
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "ipywidgets" else real(name, *a))
    assert _bar_class() is tqdm.auto.tqdm


# ---- optional loggers --------------------------------------------------------------------------

def test_a_missing_tensorboard_names_the_field_and_creates_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # missing, installed or not
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    out = tmp_path / "run"
    with pytest.raises(ImportError) as err:
        train(tiny(out, "train.tensorboard=true"))
    assert "train.tensorboard=true" in str(err.value)
    assert "pip install tensorboard" in str(err.value)
    assert "tensorboard_dir" not in str(err.value)  # not a field the user knows
    assert not out.exists()


class FakeWandb:
    """Stands in for the wandb module: records the arguments of every `init`."""

    def __init__(self) -> None:
        self.inits: list[dict[str, Any]] = []

    def init(self, **kw: Any) -> types.SimpleNamespace:
        self.inits.append(kw)
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)


@pytest.fixture
def wandb(monkeypatch: pytest.MonkeyPatch) -> FakeWandb:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def test_a_wandb_run_is_named_offline_on_request_and_continued_on_resume(
        tmp_path: Path, wandb: FakeWandb, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "my_run"
    monkeypatch.setenv("WANDB_MODE", "offline")
    train(tiny(out, "train.wandb_project=avrid"))
    train(tiny(out, "train.wandb_project=avrid", "train.steps=2", "train.resume=true"))
    first, resumed = wandb.inits
    run_id = (out / "wandb_id.txt").read_text().strip()
    for init in (first, resumed):
        assert init["project"] == "avrid" and init["name"] == "my_run"
        assert init["mode"] == "offline" and init["dir"] == str(out.resolve())
        assert init["id"] == run_id and init["resume"] == "allow"  # the same W&B run
    assert first["config"]["train"]["steps"] == 1 and resumed["config"]["train"]["steps"] == 2
    # Without WANDB_MODE the mode is W&B's own default; a fresh run gets a new W&B run.
    monkeypatch.delenv("WANDB_MODE")
    config = tiny(tmp_path / "other", "train.wandb_project=avrid")
    metrics_logger(config, resume_step=None).close()
    assert "mode" not in wandb.inits[-1] and wandb.inits[-1]["id"] != run_id
    assert wandb.inits[-1]["name"] == "other"


def test_a_wandb_name_and_mode_can_be_given(tmp_path: Path, wandb: FakeWandb) -> None:
    with MetricsLogger(tmp_path / "m.jsonl", wandb_project="p", wandb_name="baseline",
                       wandb_mode="disabled") as log:
        log.log(1, {"x": 1.0})
    assert wandb.inits[0]["name"] == "baseline" and wandb.inits[0]["mode"] == "disabled"


# ---- the sample dump ---------------------------------------------------------------------------

def test_spread_rows_takes_one_response_per_prompt_first() -> None:
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert spread_rows(groups, 2) == [0, 3]
    assert spread_rows(groups, 5) == [0, 3, 6, 1, 4]
    assert spread_rows(groups, 20) == [0, 3, 6, 1, 4, 7, 2, 5, 8]
    assert spread_rows([], 4) == []


@pytest.mark.parametrize("count", [3, 6])
def test_the_sample_dump_covers_several_prompts(tmp_path: Path, count: int) -> None:
    train(tiny(tmp_path, f"train.samples_per_step={count}"))
    rows = read_metrics(tmp_path / "samples.jsonl")
    assert len(rows) == count and {r["step"] for r in rows} == {1}
    assert len({r["prompt"] for r in rows}) == min(count, 4), json.dumps(rows, indent=1)
