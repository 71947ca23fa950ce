"""`avrid ppo` the way a batch scheduler and a shell expect (issue 25, items 5, 6 and 10).

- SIGTERM, what SLURM and Kubernetes send, stops a run like Ctrl-C: exit 143, the resume line,
  and none of the run's processes left behind (Ray's included);
- a second Ctrl-C during the cleanup is ignored: no traceback, every process gone;
- ``--resume`` of a run that has reached ``--steps`` says so in one line, exit 0, and starts
  nothing (no Ray, no workers), writing the export only if it is missing;
- ``avrid ppo --help`` lists every preset of `PRESETS`, and listing them is left to ``ppo``.

The signal tests run the command in a session of its own (``start_new_session``): every
process it starts (Ray's GCS, raylet, agents, workers) inherits that session id, so "none of its
processes is left" is "no live process has that session id", whatever else runs here.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from avrid.ppo.driver.run import train
from avrid.ppo.driver.stopping import STOP_SIGNALS, StopSignals, keep_own_sigterm
from avrid.ppo.outputs.outdir import LOCK_FILE
from avrid.ppo.setup.presets import PRESETS
from tests.helpers import child_env
from tests.test_cli_config import run_main
from tests.test_ppo_trainer import tiny

pytestmark = pytest.mark.chapter(5)

ROOT = Path(__file__).resolve().parents[1]
ENV = child_env()


# ---- stopping: SIGTERM and a second Ctrl-C --------------------------------------------------

def session_processes(sid: int) -> list[str]:
    """The command lines of the live processes in session `sid` (zombies are dead already:
    only their exit status waits to be collected)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rfind(")") + 2:].split()  # the name (in parentheses) may hold spaces
            if fields[0] != "Z" and int(fields[3]) == sid:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):  # it ended while we looked
            continue
    return found


def start_training(out: Path, *extra: str) -> subprocess.Popen:
    """`avrid ppo` in a session of its own, returned once its first step is logged (so a
    checkpoint exists: one every step)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "avrid.cli", "ppo", "--out", str(out), "--steps", "50",
         "--set", "train.checkpoint_every=1", "--set", "train.progress=false",
         "--set", "train.prompts_per_step=4", "--set", "algo.responses_per_prompt=4",
         "--set", "train.mini_batch_size=16", "--set", "train.val_prompts=4", *extra],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    seen = []
    for line in proc.stdout:  # ends if the command dies before its first step
        seen.append(line)
        if line.startswith("step 1 "):
            return proc
    proc.kill()
    raise AssertionError(f"the run never reached step 1: {''.join(seen)}{proc.stderr.read()}")


def stop(proc: subprocess.Popen, *signals: int) -> tuple[int, str, list[str]]:
    """Send `signals` (0.3 s apart, like a second Ctrl-C), then wait for the command; returns
    its exit status, its stderr and what of its session is still alive shortly after."""
    try:
        for i, number in enumerate(signals):
            if i:
                time.sleep(0.3)  # the second signal must land in the cleanup, as a user's would
            proc.send_signal(number)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    # Processes that got their kill signal may take a moment to go: a short, bounded wait.
    deadline = time.monotonic() + 15
    while (left := session_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc.returncode, err, left


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["ray", "inprocess"])
def test_sigterm_stops_a_run_like_ctrl_c(tmp_path: Path, backend: str) -> None:
    out = tmp_path / "run"
    proc = start_training(out, "--backend", backend)
    code, err, left = stop(proc, signal.SIGTERM)
    assert code == 143, err
    assert (f"avrid ppo: interrupted by SIGTERM; the last checkpoint is {out}/checkpoints/"
            f"step_0000") in err, err
    assert f"continue with `avrid ppo --resume --out {out}`" in err, err
    assert "Traceback" not in err and "SIGTERM received" not in err, err  # Ray's stack dump
    assert not [c for c in left if c.startswith("ray::")], left
    assert not left, f"processes of the run still alive after it exited: {left}"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_second_ctrl_c_does_not_cut_the_cleanup_short(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start_training(out)  # on Ray (the preset's backend): Ray's own processes too
    code, err, left = stop(proc, signal.SIGINT, signal.SIGINT)
    assert code == 130, err
    assert "avrid ppo: interrupted; the last checkpoint is" in err, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not left, f"processes of the run still alive after it exited: {left}"


def test_stop_signals_stop_once_then_wait_and_are_put_back_after() -> None:
    before = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    with StopSignals() as stop:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        signal.raise_signal(signal.SIGTERM)  # a second one: ignored, the cleanup goes on
    assert {number: signal.getsignal(number) for number in STOP_SIGNALS} == before


def test_ray_start_keeps_the_sigterm_handler_the_process_set() -> None:
    def own(number: int, frame: object) -> None: ...
    def rays(number: int, frame: object) -> None: ...

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with keep_own_sigterm():
            signal.signal(signal.SIGTERM, rays)  # what ray.init does
        assert signal.getsignal(signal.SIGTERM) is own
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a process without a handler of its own
        with keep_own_sigterm():
            signal.signal(signal.SIGTERM, rays)
        assert signal.getsignal(signal.SIGTERM) is rays  # keeps Ray's
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- resuming a run that is already complete ------------------------------------------------

SMALL = ["--backend", "inprocess", "--steps", "2", "--set", "train.prompts_per_step=4",
         "--set", "algo.responses_per_prompt=4", "--set", "train.mini_batch_size=16",
         "--set", "train.val_prompts=4", "--set", "train.progress=false"]


def files(out: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of a run (but the lock file): its modification time and bytes."""
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def test_resuming_a_complete_run_says_so_in_one_line_and_starts_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, _, err = run_main(capsys, "ppo", "--out", str(out), *SMALL)
    assert code == 0, err
    before = files(out)
    code, printed, err = run_main(capsys, "ppo", "--out", str(out), "--resume", *SMALL)
    assert code == 0 and not err, err
    assert printed.splitlines() == [
        f"{out} is already complete: its checkpoint step_000002 has reached "
        f"train.steps=2, so there is nothing to train (outputs in {out}/; raise --steps to "
        f"train further)"], printed
    assert files(out) == before, "a complete run's outputs must not change"

    # A run stopped between its last checkpoint and its export: the export is written now.
    export = {name: data for name, data in before.items() if name.startswith("export/")}
    for name in export:
        (out / name).unlink()
    (out / "export").rmdir()
    code, printed, err = run_main(capsys, "ppo", "--out", str(out), "--resume", *SMALL)
    assert code == 0 and len(printed.splitlines()) == 1 and not err, (printed, err)
    assert {name: data for name, (_, data) in files(out).items() if name.startswith("export/")} \
        == {name: data for name, (_, data) in export.items()}


def test_a_complete_run_builds_no_trainer(tmp_path: Path) -> None:
    train(tiny(tmp_path, "train.steps=1"))

    def no_trainer(config: object) -> None:
        raise AssertionError("the resume of a complete run built a trainer")

    summary = train(tiny(tmp_path, "train.steps=1", "train.resume=true"),
                    make_trainer=no_trainer)
    assert summary.already_complete and summary.rows[-1]["step"] == 1


# ---- --help ---------------------------------------------------------------------------------

def test_help_lists_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    code, printed, _ = run_main(capsys, "ppo", "--help")
    assert code == 0
    text = " ".join(printed.split())  # argparse wraps the help text
    for name in PRESETS:
        assert name in text, f"--preset's help misses {name}"


def test_other_commands_do_not_import_torch_for_the_presets() -> None:
    code = ("import sys\nfrom avrid.cli import main\nmain(['chapters'])\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False"
