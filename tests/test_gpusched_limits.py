"""The GPU test scheduler's edges (issue 25): what ``--gpus`` refuses, and what it never makes.

- The inventory is bounded: ``fake:10000000`` (a typo) is refused at once, naming the allowed
  range, instead of building ten million GPUs and planning over them for minutes; the largest
  allowed inventory plans, and prints its plan in a line, not a thousand ids.
- Two ``gpu`` markers at one level are refused, naming the test: pytest would silently use one
  of them. A function's marker over its module's is still the usual override.
- ``--gpu-durations`` in a folder that does not exist is refused before anything runs, and no
  folder is made, there or by `save_durations`.

Each plugin case runs pytest in this process on a one-file suite in pytester's folder (outside
tests/, whose conftest would skip gpu tests without CUDA).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from avrid.gpusched import Durations, InventoryError, inventory, parse_gpus, save_durations

pytestmark = pytest.mark.project

pytest_plugins = ["pytester"]

MAX_GPUS = 1024
"""The bound the README states (`inventory.MAX_GPUS`)."""


@pytest.fixture
def tester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester with no outer CUDA_VISIBLE_DEVICES and the plugin's markers declared strict."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    pytester.makeini("[pytest]\naddopts = --strict-markers\n")
    return pytester


# --- a bounded inventory ---


@pytest.mark.parametrize("spec", ["fake:1025", "fake:10000000", "fake:" + "9" * 5000,
                                  "fake:10000000x80"])
def test_an_absurd_fake_gpu_count_is_refused_naming_the_allowed_range(spec: str) -> None:
    with pytest.raises(InventoryError, match=re.escape(f"allowed: 1 <= N <= {MAX_GPUS}")):
        parse_gpus(spec, environ={}, query=None)


def test_every_spelling_is_bounded_and_the_bound_itself_is_allowed() -> None:
    assert getattr(inventory, "MAX_GPUS", None) == MAX_GPUS
    assert len(parse_gpus(f"fake:{MAX_GPUS}x80").gpus) == MAX_GPUS
    listed = ",".join(map(str, range(MAX_GPUS + 1)))
    with pytest.raises(InventoryError, match=f"names {MAX_GPUS + 1} GPUs; an inventory has 1 "
                                             f"to {MAX_GPUS}"):
        parse_gpus(listed, environ={}, query=None)
    for spec in ("fake:2xinf", "²"):  # no infinite memory; int("²") is no GPU id
        with pytest.raises(InventoryError, match="fake:N or fake:NxM|is not a GPU id"):
            parse_gpus(spec, environ={}, query=None)


def test_an_absurd_count_is_a_usage_error_and_the_largest_allowed_plans_in_a_line(
        tester: pytest.Pytester) -> None:
    tester.makepyfile("import pytest\n\n"
                      "@pytest.mark.gpu(2, duration_s=5)\ndef test_two():\n    pass\n\n"
                      "@pytest.mark.gpu(duration_s=3)\ndef test_one():\n    pass\n")
    refused = tester.runpytest_inprocess("--gpus=fake:10000000", "--collect-only", "-q")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    assert f"'fake:10000000': 10000000 simulated GPUs; allowed: 1 <= N <= {MAX_GPUS}" in \
        refused.stderr.str()
    planned = tester.runpytest_inprocess(f"--gpus=fake:{MAX_GPUS}", "--collect-only", "-q")
    assert planned.ret == pytest.ExitCode.OK
    [head] = [ln for ln in planned.outlines if ln.startswith("gpusched plan on")]
    assert head.startswith(f"gpusched plan on fake0,...,fake{MAX_GPUS - 1} ({MAX_GPUS} GPUs), "
                           f"simulated: planned makespan "), head
    assert len(head) < 200  # the ends of the inventory, not 1,024 ids
    assert sum(" GPUs fake" in ln for ln in planned.outlines) == 2  # both tests at 0 s


# --- one gpu marker per level ---


@pytest.mark.parametrize(("source", "where", "marks"), [
    ("@pytest.mark.gpu(2)\n@pytest.mark.gpu\ndef test_x():\n    pass\n",
     "test_x: gpu marker: given 2 times on the test", {"gpu(2)", "gpu()"}),
    ("pytestmark = [pytest.mark.gpu(count=1), pytest.mark.gpu(count=4)]\n\n"
     "def test_x():\n    pass\n",
     "test_x: gpu marker: given 2 times on ", {"gpu(count=1)", "gpu(count=4)"}),
    ("@pytest.mark.gpu(1)\n@pytest.mark.gpu(memory_gb=8)\nclass TestX:\n"
     "    def test_x(self):\n        pass\n",
     "TestX::test_x: gpu marker: given 2 times on ", {"gpu(1)", "gpu(memory_gb=8)"}),
])
def test_two_gpu_markers_at_one_level_are_refused_naming_the_test(
        tester: pytest.Pytester, source: str, where: str, marks: set[str]) -> None:
    tester.makepyfile(f"import pytest\n\n{source}")
    result = tester.runpytest_inprocess("--gpus=fake:4", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    named = re.search(r"\((.*) and (.*)\); keep one$", err.strip())
    assert where in err and named and set(named.groups()) == marks, err


def test_a_functions_marker_still_overrides_its_modules(tester: pytest.Pytester) -> None:
    tester.makepyfile("import pytest\n\npytestmark = pytest.mark.gpu(1)\n\n"
                      "@pytest.mark.gpu(2)\ndef test_wide():\n    pass\n\n"
                      "def test_narrow():\n    pass\n")
    result = tester.runpytest_inprocess("--gpus=fake:4", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK, result.stderr.str()
    plan = {ln.split()[-1].split("::")[-1]: ln for ln in result.outlines if " GPUs fake" in ln}
    assert "GPUs fake0,fake1 " in plan["test_wide"] and "fake0,fake1" not in plan["test_narrow"]


# --- nothing made that was not asked for ---


def test_a_durations_path_in_a_missing_folder_is_refused_and_no_folder_made(
        tester: pytest.Pytester, tmp_path: Path) -> None:
    tester.makepyfile("import pytest\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    missing = tmp_path / "no" / "such"
    result = tester.runpytest_inprocess("--gpus=fake:1", f"--gpu-durations={missing}/d.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (f"--gpu-durations '{missing}/d.json': its folder {missing} does not exist, and the "
            f"plugin makes none; give a file in an existing folder") in result.stderr.str()
    assert not (tmp_path / "no").exists()
    result = tester.runpytest_inprocess("--gpus=fake:1", f"--gpu-durations={tmp_path}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "is a folder" in result.stderr.str()


def test_save_durations_makes_no_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        save_durations(tmp_path / "no" / "such" / "d.json", Durations(seconds={"t": 1.0}))
    assert list(tmp_path.iterdir()) == []
