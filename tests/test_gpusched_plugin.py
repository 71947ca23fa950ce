"""The GPU test scheduler as pytest runs it: ``--gpus fake:4`` end to end, on CPU.

A synthetic suite of sleeping tests (1, 2 and 4 GPUs, one failing, one hung, one failing once
with CUDA out of memory, some impossible on the inventory) is written into pytester's temp
folder — not under tests/, where this project's conftest would skip gpu tests without CUDA —
and run in a subprocess, as a user would run it. Each synthetic test logs its own start, end,
pid and ``CUDA_VISIBLE_DEVICES``, so over-commitment is checked from what really ran.

The first sections check the parts the plugin is made of (inventory, markers, the durations
cache, the process-group kill) directly; they are quick.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from avrid.gpusched import Durations, GpuNeeds, InventoryError, MarkerError, needs_of
from avrid.gpusched.durations import load_durations, save_durations
from avrid.gpusched.inventory import parse_gpus
from avrid.gpusched.runner import Child, ChildSpec, retry_reason
from tests.helpers import child_env

pytestmark = pytest.mark.project

pytest_plugins = ["pytester"]

# The hypothesis and anyio plugins take ~0.8 s of each test process's ~1.1 s start-up here;
# the synthetic suite needs neither. Set through the environment so every process inherits it.
FAST_START = "-p no:hypothesispytest -p no:anyio -p no:cacheprovider"
HANG_TIMEOUT_S = 5.0
"""The hung tests' timeout. It counts from the test process's start, so it must leave room for
that start-up (~1.1 s idle, over 2 s on a busy machine: at 2 s the timeout once fired during
the test's setup, before it could hang) and the test's own first lines."""


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether process `pid` has ended (a zombie waiting to be reaped counts as ended)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


# --- the parts ---


def test_inventory_spellings_and_the_outer_visible_devices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"  # a stand-in nvidia-smi: two GPUs, MiB free
    smi.write_text("#!/bin/sh\nprintf '0, 81920\\n1, 40960\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    every = parse_gpus("all")
    assert [(g.id, g.device, g.memory_gb) for g in every.gpus] == [("0", "0", 80.0),
                                                                  ("1", "1", 40.0)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # only physical GPU 1, as CUDA's 0
    (only,) = parse_gpus("all").gpus
    assert (only.id, only.device, only.memory_gb) == ("0", "1", 40.0)
    assert parse_gpus("0").devices(("0",)) == "1"
    with pytest.raises(InventoryError, match="id 1 is out of range: CUDA_VISIBLE_DEVICES=1"):
        parse_gpus("0,1")
    fake = parse_gpus("fake:3x24")
    assert fake.fake and fake.devices(("fake2", "fake0")) == "fake2,fake0"
    assert {g.memory_gb for g in fake.gpus} == {24.0}


@pytest.mark.parametrize(("spec", "message"), [
    ("", "--gpus is empty"), ("zero", "'zero' is not a GPU id"), ("0,0", "names a GPU twice"),
    ("fake:0", "1 <= N <= 1024"), ("fake:2x0", "M > 0 GiB"), ("fake:two", "fake:N or fake:NxM"),
])
def test_bad_inventories_say_what_is_allowed(spec: str, message: str) -> None:
    with pytest.raises(InventoryError, match=re.escape(message)):
        parse_gpus(spec, environ={}, query=None)


def test_all_without_nvidia_smi_is_refused_with_the_alternatives() -> None:
    with pytest.raises(InventoryError, match=r"needs nvidia-smi on PATH.*--gpus fake:8"):
        parse_gpus("all", environ={}, query=lambda: None)


class Item:
    """What `needs_of` reads from a pytest item (its marks all on the test itself)."""

    def __init__(self, *marks: pytest.MarkDecorator) -> None:
        self.nodeid, self.marks = "t.py::test", [m.mark for m in marks]

    def get_closest_marker(self, name: str):  # noqa: ANN201 - a pytest Mark or None
        return next((m for m in self.marks if m.name == name), None)

    def iter_markers_with_node(self, name: str):  # noqa: ANN201 - (node, Mark) pairs
        return ((self, m) for m in self.marks if m.name == name)


def test_needs_come_from_the_markers_and_bad_ones_name_the_test() -> None:
    assert needs_of(Item()) is None  # unmarked: runs in the pytest process
    assert needs_of(Item(pytest.mark.vllm)) == GpuNeeds(gpus=1)
    assert needs_of(Item(pytest.mark.gpu(2))) == GpuNeeds(gpus=2)
    assert needs_of(Item(pytest.mark.gpu(count=4, memory_gb=40, duration_s=90, timeout_s=600),
                         pytest.mark.vllm)) == GpuNeeds(gpus=4, memory_gb=40, duration_s=90,
                                                        timeout_s=600)
    for mark, message in [(pytest.mark.gpu(memory=4), "unknown keyword 'memory'"),
                          (pytest.mark.gpu(count=0), "count must be a whole number"),
                          (pytest.mark.gpu(count=True), "count must be a whole number"),
                          (pytest.mark.gpu(duration_s=-1), "duration_s must be a number > 0"),
                          (pytest.mark.gpu(1, 2), "at most one positional")]:
        with pytest.raises(MarkerError, match=f"t.py::test: gpu marker: .*{message}"):
            needs_of(Item(mark))
    with pytest.raises(MarkerError, match=r"t.py::test: gpu marker: given 2 times on the test"):
        needs_of(Item(pytest.mark.gpu(2), pytest.mark.gpu))  # stacked: which one was meant?


def test_the_durations_cache_round_trips_atomically_and_survives_garbage(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    assert load_durations(path) == (Durations(), "")
    save_durations(path, Durations(seconds={"a": 1.5}, overhead_s=0.25))
    save_durations(path, load_durations(path)[0].updated({"b": 2.0}))
    assert load_durations(path) == (Durations(seconds={"a": 1.5, "b": 2.0}, overhead_s=0.25), "")
    assert [p.name for p in tmp_path.iterdir()] == ["cache.json"]  # no temp file left
    path.write_text('{"version": 1, "tests": {"a": "soon"}}')
    cache, warning = load_durations(path)
    assert cache == Durations() and "ignored the durations cache" in warning


def test_only_start_up_failures_of_other_processes_are_retried() -> None:
    assert retry_reason("torch.OutOfMemoryError: CUDA out of memory.") == "CUDA out of memory"
    assert retry_reason("OSError: [Errno 98] Address already in use") == "address already in use"
    assert retry_reason("AssertionError: loss is nan") is None


def test_a_timed_out_test_loses_its_whole_process_group_even_if_it_ignores_sigterm(
        tmp_path: Path) -> None:
    # The test and its grandchild both ignore SIGTERM: SIGKILL after the grace must take both.
    (tmp_path / "test_stubborn.py").write_text(
        "import signal, subprocess, sys, time\nfrom pathlib import Path\n\n"
        "def test_stubborn():\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "time.sleep(1000)'\n"
        "    p = subprocess.Popen([sys.executable, '-c', code])\n"
        "    Path('pids').write_text(f'{p.pid} {__import__(\"os\").getpid()}')\n"
        "    time.sleep(1000)\n")
    spec = ChildSpec(nodeid="test_stubborn.py::test_stubborn", devices="fake0", omp_threads=1,
                     timeout_s=HANG_TIMEOUT_S, rootdir=tmp_path, inifile=None,
                     workdir=tmp_path / "run")
    child = Child(spec, environ=child_env(PYTEST_ADDOPTS=FAST_START), grace_s=0.5)
    started = time.monotonic()
    while (exit := child.poll()) is None:
        assert time.monotonic() - started < 30, "the stubborn test was never killed"
        time.sleep(0.05)
    assert exit.timed_out and exit.returncode == -signal.SIGKILL
    assert HANG_TIMEOUT_S + 0.4 <= exit.wall_s < HANG_TIMEOUT_S + 10
    grandchild, test_process = map(int, (tmp_path / "pids").read_text().split())
    assert test_process == exit.pgid
    assert gone(grandchild) and gone(test_process)


# --- the plugin, end to end ---


CONFTEST = '''
import json, os, time
from pathlib import Path
import pytest

@pytest.fixture(autouse=True)
def _log(request):
    start = time.time()
    yield
    with open(Path(__file__).parent / "log.jsonl", "a") as f:
        f.write(json.dumps({"test": request.node.name, "start": start, "end": time.time(),
                            "pid": os.getpid(),
                            "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                            "omp": os.environ.get("OMP_NUM_THREADS")}) + "\\n")
'''

SUITE = '''
import os, subprocess, time
from pathlib import Path
import pytest

HERE = Path(__file__).parent

@pytest.mark.gpu(count=4, duration_s=1.2)
def test_four():
    time.sleep(1.2)

@pytest.mark.gpu(count=2, duration_s=1.0)
def test_two_a():
    time.sleep(1.0)

@pytest.mark.gpu(2, duration_s=0.6)
def test_two_b():
    time.sleep(0.6)

@pytest.mark.gpu(duration_s=1.5)
def test_one_a():
    time.sleep(1.5)

@pytest.mark.gpu(count=1, duration_s=0.8)
def test_one_b():
    time.sleep(0.8)

@pytest.mark.gpu(count=1)
def test_one_c():
    time.sleep(0.5)

@pytest.mark.vllm
def test_vllm():
    time.sleep(0.3)

@pytest.mark.gpu(count=1, duration_s=0.3)
def test_fails():
    time.sleep(0.3)
    assert 1 == 2, "boom"

@pytest.mark.gpu(count=1, timeout_s=5.0)
def test_hangs():
    child = subprocess.Popen(["sleep", "1000"])
    (HERE / "hung.pids").write_text(f"{child.pid} {os.getpid()}")
    time.sleep(1000)

@pytest.mark.gpu(count=1, duration_s=0.3)
def test_oom_once():
    flag = HERE / "oom.flag"
    if not flag.exists():
        flag.write_text("once")
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    time.sleep(0.3)

@pytest.mark.gpu(count=8)
def test_eight():
    pass

@pytest.mark.gpu(count=1, memory_gb=100)
def test_big_memory():
    pass

@pytest.mark.gpu
def test_skips_itself():
    pytest.skip("not on this machine")

def test_plain():
    time.sleep(0.2)
'''
assert f"timeout_s={HANG_TIMEOUT_S}" in SUITE  # the synthetic hung test's own timeout
SLEEPS = {"test_four": 1.2, "test_two_a": 1.0, "test_two_b": 0.6, "test_one_a": 1.5,
          "test_one_b": 0.8, "test_one_c": 0.5, "test_vllm": 0.3, "test_fails": 0.3,
          "test_oom_once": 0.3, "test_plain": 0.2}
WIDTH = {"test_four": 4, "test_two_a": 2, "test_two_b": 2}


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTEST_ADDOPTS", FAST_START)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pytester.makeini("[pytest]\naddopts = --strict-markers\n")  # gpu/vllm: the plugin's
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_synthetic=SUITE)
    return pytester


def summary(result: pytest.RunResult) -> dict[str, float]:
    text = result.stdout.str()
    figures = {}
    for key, pattern in [("wall", r"wall ([\d.]+) s"), ("planned", r"planned makespan ([\d.]+) s"),
                         ("replayed", r"replayed makespan ([\d.]+) s"),
                         ("utilisation", r"utilisation ([\d.]+)%"),
                         ("speedup", r"speed-up ([\d.]+)x"),
                         ("serial", r"serial sum ([\d.]+) s"),
                         ("cache", r"expected durations: .*?(\d+) cache")]:
        found = re.search(pattern, text)
        if found:
            figures[key] = float(found.group(1))
    return figures


def log(pytester: pytest.Pytester) -> list[dict]:
    path = pytester.path / "log.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    return rows


def test_scheduled_run_end_to_end(suite: pytest.Pytester) -> None:
    first = suite.runpytest_subprocess("--gpus", "fake:4x80", "-rA", timeout=120)
    out = first.stdout.str()
    first.assert_outcomes(passed=9, failed=2, skipped=3)
    # the failure is the test's own traceback; the hung test's says what was done to it
    assert "AssertionError: boom" in out
    assert re.search(rf"timed out after {HANG_TIMEOUT_S:g} s in its call: its process group \d+ "
                     r"was killed", out)
    grandchild, test_process = map(int, (suite.path / "hung.pids").read_text().split())
    assert gone(grandchild) and gone(test_process)
    assert "needs 8 GPUs, the inventory has 4" in out
    assert "needs 1 GPU(s) with 100 GiB free" in out and "not on this machine" in out
    assert "attempt 2: retried after CUDA out of memory" in out
    figures = summary(first)
    assert {"wall", "planned", "utilisation", "speedup", "serial"} <= set(figures), out
    assert figures["speedup"] > 1.2 and 0 < figures["utilisation"] <= 100
    # what really ran: concurrent tests never shared a GPU; each got as many as it asked
    rows = log(suite)
    scheduled = [r for r in rows if r["test"] != "test_plain"]
    assert all(r["pid"] != os.getpid() and r["omp"] for r in scheduled)
    plain = [r for r in rows if r["test"] == "test_plain"]
    assert plain and plain[0]["devices"] is None  # unmarked: in the pytest process, untouched
    for r in scheduled:
        assert len(r["devices"].split(",")) == WIDTH.get(r["test"], 1), r
    overlapping = 0
    for i, a in enumerate(scheduled):
        for b in scheduled[i + 1:]:
            if a["start"] < b["end"] and b["start"] < a["end"]:
                overlapping += 1
                assert not set(a["devices"].split(",")) & set(b["devices"].split(",")), (a, b)
    assert overlapping >= 3
    cache = json.loads((suite.path / ".pytest-gpu-durations.json").read_text())
    assert cache["tests"]["test_synthetic.py::test_one_c"] >= 0.5
    assert 0 < cache["overhead_s"] < 5

    # Second run: the durations learnt above drive the plan, and the run keeps to it.
    second = suite.runpytest_subprocess("--gpus", "fake:4x80", timeout=120)
    second.assert_outcomes(passed=9, failed=2, skipped=3)
    figures = summary(second)
    # test_one_c, test_vllm, test_hangs, test_skips_itself: learnt, not declared
    assert figures["cache"] == 4
    # The figures describe this run: the replayed makespan (the policy played over what each
    # test really took) and the plan are of the wall time's size. Not a tight bound: the gap
    # is the scheduler's lag and the durations' error, both set by the machine's load (under
    # two busy loops the wall time ran 0.0-1.0 s past the replay, 6.93 s against a 6.16 s
    # plan in CI); timings belong in benchmarks/, not in a test.
    for figure in ("replayed", "planned"):
        assert 0.5 * figures["wall"] <= figures[figure] <= 2 * figures["wall"], (
            figure, second.stdout.str())
    assert gone(int((suite.path / "hung.pids").read_text().split()[0]))


def test_without_gpus_the_suite_runs_serially_as_plain_pytest(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("-k", "not hangs", timeout=120)
    # gpu(count=8) and memory_gb=100 just run here; the out-of-memory test is not retried
    result.assert_outcomes(passed=10, failed=2, skipped=1)
    assert "gpu schedule" not in result.stdout.str() and "gpusched" not in result.stdout.str()
    rows = sorted(log(suite), key=lambda r: r["start"])
    assert {r["pid"] for r in rows} == {rows[0]["pid"]}  # one process
    assert all(r["devices"] is None for r in rows)
    assert all(a["end"] <= b["start"] for a, b in zip(rows, rows[1:], strict=False))
    slept = sum(v for k, v in SLEEPS.items() if k != "test_oom_once")  # it failed at once
    assert rows[-1]["end"] - rows[0]["start"] >= slept


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus=bogus"], "--gpus 'bogus': 'bogus' is not a GPU id; give comma-separated ids"),
    (["--gpus=fake:0"], "0 simulated GPUs; allowed: 1 <= N <= 1024"),
    (["--gpus=all"], "--gpus all needs nvidia-smi on PATH"),
    (["--gpus=fake:2", "--gpu-timeout=0"], "--gpu-timeout '0': give a number of seconds > 0"),
    (["--gpus=fake:2", "--gpu-retries=-1"], "--gpu-retries '-1': give a whole number >= 0"),
])
def test_bad_options_are_usage_errors_saying_what_is_allowed(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str],
        message: str) -> None:
    monkeypatch.setenv("PATH", str(pytester.path))  # no nvidia-smi
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_inprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_a_bad_marker_is_a_usage_error_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("import pytest\n\n@pytest.mark.gpu(memory=4)\ndef test_x():\n"
                        "    pass\n")
    result = pytester.runpytest_inprocess("--gpus=fake:2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "test_a_bad_marker_is_a_usage_error_naming_the_test.py::test_x: gpu marker: " \
           "unknown keyword 'memory'" in result.stderr.str()


def test_the_plugin_is_an_installed_entry_point() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="pytest11") if e.name == "avrid-gpusched"]
    assert ep.value == "avrid.gpusched.plugin"
    assert sys.modules.get("avrid.gpusched.plugin") is not None  # loaded in this very run
