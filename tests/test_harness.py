"""The project's own rules: the layer import contract, hardware markers, the CLI entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import hardware_skip_reason

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]


def test_import_contract_layers_only_import_downward() -> None:
    # lint-imports sits next to the interpreter running the tests (the project's venv).
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: " in run.stdout and " broken" in run.stdout
    assert "0 broken" in run.stdout


@pytest.mark.parametrize(("gpus", "vllm", "cuda", "installed", "expected"), [
    (1, False, 0, False, "needs 1 CUDA GPU(s), found 0"),
    (2, False, 1, False, "needs 2 CUDA GPU(s), found 1"),
    (2, False, 2, False, ""),
    (0, True, 1, False, "needs the vllm package"),
    (0, True, 0, True, ""),  # vllm alone: the CPU build runs without CUDA
    (1, True, 0, True, "needs 1 CUDA GPU(s), found 0"),  # gpu + vllm: both needed
    (1, True, 1, True, ""),
])
def test_hardware_skip_reasons(gpus: int, vllm: bool, cuda: int, installed: bool,
                               expected: str) -> None:
    reason = hardware_skip_reason(needs_gpus=gpus, needs_vllm=vllm, cuda_devices=cuda,
                                  vllm_installed=installed)
    assert reason.startswith(expected) if expected else reason == ""


def test_markers_are_registered_strictly() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert "--strict-markers" in text
    for marker in ("gpu(count=1)", "vllm:", "slow:"):
        assert marker in text


def test_avrid_command_lists_chapters() -> None:
    run = subprocess.run([sys.executable, "-m", "avrid.cli", "chapters"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "ch01_workers" in run.stdout


def test_avrid_command_rejects_unknown_chapter() -> None:
    run = subprocess.run([sys.executable, "-m", "avrid.cli", "demo", "ch99"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "unknown chapter 'ch99'" in run.stderr and "ch01_workers" in run.stderr


def test_readme_first_taste_runs() -> None:
    text = (ROOT / "README.md").read_text()
    code = text.split("## A first taste", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "hello you from greeter[1], dp=1" in run.stdout


def test_readme_file_tree_lists_every_tracked_file() -> None:
    run = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    if run.returncode != 0:
        pytest.skip("not a git checkout, so there is no list of tracked files to compare")
    tracked = {f for f in run.stdout.split() if f not in {".gitignore", "README.md"}}
    tree = (ROOT / "README.md").read_text().split("## Files", 1)[1].split("```")[1]
    listed = {line.split()[0] for line in tree.splitlines() if line.strip()}
    assert tracked - listed == set(), "files missing from the README tree"
    assert listed - tracked == set(), "README tree names files that do not exist"
