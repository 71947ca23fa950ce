"""Chapter demos and notebooks run end to end on CPU, as a learner would run them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from avrid.cli import CHAPTERS
from tests.helpers import child_env

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]
DEMO_SAYS = {"ch01_workers": "same all-reduce results: true",
             "ch02_dispatch": "all checks passed",
             "ch03_results": "all checks passed",
             "ch04_resharding": "all checks passed",
             "ch05_ppo": "all checks passed",
             "ch06_async": "all checks passed",
             "ch07_agents": "all checks passed"}
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Each demo and notebook belongs to its chapter (`make test CH=N` runs chapter N's).
DEMOS = [pytest.param(pkg, marks=pytest.mark.chapter(int(pkg[2:4])), id=pkg)
         for pkg, _ in CHAPTERS]
BOOKS = [pytest.param(p, marks=pytest.mark.chapter(int(p.stem[:2])), id=p.stem)
         for p in NOTEBOOKS]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("chapter", DEMOS)
def test_chapter_demo_runs_on_cpu(chapter: str) -> None:
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", f"chapters.{chapter}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=200, env=child_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert time.monotonic() - start < 200
    # each demo ends by checking its own results and saying so
    assert DEMO_SAYS[chapter] in run.stdout.lower()


@pytest.mark.parametrize("path", BOOKS)
def test_notebook_cells_fit_on_video(path: Path) -> None:
    nb = json.loads(path.read_text())
    wide = [line for cell in nb["cells"] if cell["cell_type"] == "code"
            for line in "".join(cell["source"]).splitlines() if len(line) > 80]
    assert not wide, f"{path.name}: code lines wider than 80 characters: {wide}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", BOOKS)
def test_notebook_executes(path: Path) -> None:

    nb = execute(path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    # What a reader sees: no warnings or other stderr text in any cell's output.
    stderr = ["".join(o.get("text", "")) for c in nb.cells if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("name") == "stderr"]
    assert not stderr, stderr


@pytest.mark.parametrize("path", BOOKS)
def test_notebook_is_committed_with_its_outputs_and_figures(path: Path) -> None:
    # On the web (GitHub, nbviewer) a notebook shows only what was saved in it: every code
    # cell that prints or draws must carry its output, figures included. Refresh them with
    # `python -m tests.test_chapters` after changing a notebook or what it calls.
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in cells), f"{path.name}: cells never executed"
    # Every chapter draws (chapter 1: its placement layouts), so every notebook has a figure.
    images = [o for c in cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{path.name}: no figure saved in the notebook"


def execute(path: Path):  # noqa: ANN201 - nbformat.NotebookNode
    """Run every cell of the notebook at `path` from the repository root, in a fresh kernel;
    returns the notebook with its outputs (the file itself is not changed)."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     record_timing=False,  # no timestamps: stable diffs
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    return nb


def write_outputs() -> None:
    """Execute every notebook and save it with its outputs (atomically: write, then rename)."""
    import nbformat

    for path in NOTEBOOKS:
        nb = execute(path)
        part = path.with_suffix(".ipynb.tmp")
        nbformat.write(nb, part)
        part.replace(path)
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)


def test_there_is_one_notebook_per_chapter() -> None:
    chapters = sorted(p.name for p in (ROOT / "chapters").iterdir()
                      if p.is_dir() and p.name.startswith("ch"))
    numbers = {p.stem[:2] for p in NOTEBOOKS}
    assert chapters, "no chapters found"
    assert {c[2:4] for c in chapters} <= numbers, (chapters, NOTEBOOKS)


if __name__ == "__main__":
    write_outputs()
