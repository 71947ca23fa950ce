"""`make test CH=N`: a learner runs one chapter's tests (`tests/conftest.py`, ``--chapter``).

Each test file says which chapter's layer it tests (``pytestmark = pytest.mark.chapter(N)``)
or that it checks the project itself (``pytest.mark.project``); a docstring example in
``avrid/`` belongs to the chapter its module's docstring opens with. These tests check the
selection against what the files say, and that a file which says nothing is refused.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]
DECLARED = re.compile(r"^pytestmark = .*pytest\.mark\.(chapter\((\d+)\)|project)", re.M)


def collect(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p",
                           "no:cacheprovider", *args], cwd=cwd, env=child_env(),
                          capture_output=True,
                          text=True, timeout=300)


def declared_chapter(test_file: Path) -> str:
    """What a test file's own `pytestmark` line says: "2", or "project"."""
    found = DECLARED.search(test_file.read_text())
    assert found, f"{test_file.name} declares no chapter"
    return found.group(2) or "project"


def test_every_test_file_says_its_chapter_or_that_it_tests_the_project() -> None:
    files = sorted(ROOT.glob("tests/test_*.py"))
    said = {f.name: declared_chapter(f) for f in files}
    assert set(said.values()) <= {"project", *map(str, range(1, 8))}
    # Each chapter has tests of its own.
    assert set(map(str, range(1, 8))) <= set(said.values())


@pytest.mark.parametrize("chapter", [2, 6])
def test_chapter_n_collects_its_own_tests_and_only_them(chapter: int) -> None:
    run = collect("--chapter", str(chapter))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    assert len(ids) > 20
    files = {nid.split("::")[0] for nid in ids}
    for path in files:
        if path.startswith("tests/test_chapters.py"):
            continue  # its demos and notebooks carry their chapter per parameter
        if path.startswith("tests/"):
            assert declared_chapter(ROOT / path) == str(chapter), path
        else:  # a docstring example: its module opens with "Chapter N"
            assert (ROOT / path).read_text().lstrip('"').startswith(f"Chapter {chapter} "), path
    demos = [nid for nid in ids if nid.startswith("tests/test_chapters.py")]
    assert demos and all(f"ch0{chapter}_" in nid or f"[0{chapter}_" in nid for nid in demos)
    # Every file of the chapter is there, none of another.
    want = {f"tests/{f.name}" for f in ROOT.glob("tests/test_*.py")
            if declared_chapter(f) == str(chapter)}
    assert want <= files


def test_an_unknown_chapter_and_an_unmarked_test_are_refused(tmp_path: Path) -> None:
    run = collect("--chapter", "9")
    assert run.returncode == 4 and "--chapter 9: the chapters are 1..7" in run.stderr
    # A suite of its own, with this project's conftest as a plugin: a test file that says
    # nothing about its chapter fails collection, naming the file and the line to add.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_said.py").write_text(
        "import pytest\npytestmark = pytest.mark.chapter(3)\ndef test_a():\n    pass\n")
    (tmp_path / "test_silent.py").write_text("def test_b():\n    pass\n")
    run = collect("-p", "tests.conftest", "test_said.py", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    run = collect("-p", "tests.conftest", cwd=tmp_path)
    assert run.returncode == 4
    assert ("test_silent.py::test_b says neither which chapter it tests" in run.stderr
            and "pytestmark = pytest.mark.chapter(N)" in run.stderr), run.stderr
