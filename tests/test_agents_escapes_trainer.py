"""Chapter 7: misbehaving environments and hostile tools through the whole trainer.

Each test runs ``avrid ppo --preset tiny-agent`` (two steps, in process) with a task from
`tests/agent_misbehaviour.py`:

- an environment bug ends the run at once with ONE line naming the task, the prompt and
  what was wrong: a step that never returns (after `EpisodeLimits.step_wall_s`), a step
  that raises while others are still running (without waiting for them), an observation
  that is not text, ids outside the vocabulary;
- what is not a bug leaves the run going: a two-million-character observation (the
  episode ends, truncated, without tokenizing it), and tool code that attacks the trainer
  (kills it, re-limits it, renices it, reads its environment and a secret file, lies on
  standard error, opens thousands of files, leaves a 1,200-deep tree and a setsid daemon):
  every call is an observation, the run finishes its steps, and no secret is in anything
  the run wrote.

After every run: the process exited by itself (no hang at exit), no sandbox process is
left, and the run's temporary directory is empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.agent_misbehaviour import ATTACKS, STEP_WALL_S
from tests.helpers import ROOT, child_env
from tests.test_agents_sandbox import in_namespace, namespaces_or_skip

pytestmark = [pytest.mark.chapter(7), pytest.mark.slow]

SMALL = ["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
         "train.prompts_per_step=4", "algo.responses_per_prompt=4", "train.mini_batch_size=16",
         "train.val_prompts=4", "train.progress=false"]


def run(tmp_path: Path, kind: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """``avrid ppo --preset tiny-agent`` for 2 steps on the misbehaving task `kind`."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    args = ["ppo", "--preset", "tiny-agent", "--steps", "2", "--out", str(tmp_path / "run"),
            "--set", "task.name=tests.agent_misbehaviour:make_task",
            "--set", f"task.options=kind:{kind},hint:true,call_weight:0.5"]
    for setting in SMALL:
        args += ["--set", setting]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "avrid.cli", *args], cwd=ROOT,
                          env=child_env(TMPDIR=str(temp), **env), capture_output=True,
                          text=True, timeout=170)
    took = time.monotonic() - start
    assert not list(temp.iterdir()), list(temp.iterdir())  # nothing left in its temp dir
    assert not sandbox_processes(), sandbox_processes()
    return done, took


def sandbox_processes() -> list[str]:
    """Live bubblewrap processes on this machine (none of this suite's may outlive a run)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and os.path.basename(cmd[0]) == b"bwrap":
            found.append(pid)
    return found


def steps(tmp_path: Path) -> list[dict[str, float]]:
    """The run's training steps' metrics (metrics.jsonl also holds step 0's validation)."""
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    return [m for m in lines if "agent/turns" in m]


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("avrid ppo:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(("kind", "says"), [
    ("hang", ["did not return from step()", f"step_wall_s={STEP_WALL_S}", "prompt 0"]),
    ("raise-while-others-run", ["the environment's own bug", "prompt 0"]),
    ("not-text", ["123", "prompt", "misbehaving"]),
    ("ids-out-of-range", ["1000000", "prompt", "misbehaving"]),
])
def test_an_environment_bug_ends_the_run_at_once_in_one_line(tmp_path: Path, kind: str,
                                                             says: list[str]) -> None:
    done, took = run(tmp_path, kind)
    line = one_line(done)
    assert all(s in line for s in says), line
    # The other environments' 30 s sleeps are not waited for; a hung step only its limit.
    assert took < 25 + STEP_WALL_S, took


def test_a_huge_observation_truncates_its_episode_and_the_run_goes_on(tmp_path: Path) -> None:
    done, took = run(tmp_path, "huge-observation")
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = steps(tmp_path)
    assert len(metrics) == 2 and all(m["agent/truncated"] > 0 for m in metrics), metrics
    assert took < 60, took  # 2,000,000 characters a step were never tokenized


def test_hostile_tools_leave_the_trainer_running_and_learn_nothing(tmp_path: Path) -> None:
    namespaces_or_skip()
    secret = f"avrid-trainer-secret-{uuid.uuid4().hex}"
    secret_file = tmp_path / "answers.txt"
    secret_file.write_text(secret)
    log = tmp_path / "tools.jsonl"
    done, _ = run(tmp_path, "tool-attacks", MISBEHAVIOUR_LOG=str(log),
                  MISBEHAVIOUR_SECRET_FILE=str(secret_file), MY_API_TOKEN=secret)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(steps(tmp_path)) == 2
    calls = [json.loads(line) for line in log.open()]
    status = {c["attack"]: c["status"] for c in calls}
    assert set(status) == set(ATTACKS) and status["stderr-lies"] == "ok", status
    assert all(status[a] != "ok" for a in ("kill-driver", "prlimit-driver", "renice-driver",
                                           "driver-environ", "secret-file")), status
    for c in calls:
        assert not in_namespace(c["namespace"]), c
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert not [p for p in [log, *written] if secret.encode() in p.read_bytes()]


def test_an_unreachable_remote_sandbox_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    from tests.test_agents_sandbox_remote import free_port

    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "avrid.cli", "ppo", "--preset", "tiny-agent", "--steps", "1",
         "--out", str(tmp_path / "run"), "--set", "tools.sandbox=remote",
         "--set", f"tools.remote_url={url}", "--set", "tools.remote_retries=0",
         *[a for s in SMALL for a in ("--set", s)]],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=170)
    line = one_line(done)
    assert f"{url}/run_code" in line and "tools.sandbox='remote'" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
