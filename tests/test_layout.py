"""The library's shape, as a learner meets it: small files, no import cycles, every
sub-package of avrid.ppo with its reading order, and one PPO step readable in eight files.

These read the source (ast, grimp); nothing here imports torch or starts Ray.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp
import pytest

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]
PPO = ROOT / "avrid" / "ppo"
MAX_LINES = 400

STEP_FILES = [
    "driver/trainer.py", "data/prompts.py", "roles/policy.py", "roles/reward.py",
    "roles/critic.py", "data/columns.py", "algo/advantages.py", "algo/losses.py",
]
"""The files of avrid/ppo a learner opens to follow one step from `train_step`, in the
order chapters/ch05_ppo/README.md gives them."""

STEP_FUNCTIONS = ("train_step", "generator", "step_prompts", "sampling", "updates_actor",
                  "learn", "_update", "_metrics", "compute_advantages", "_truncated",
                  "step_seed")
"""`train_step` and the helpers of trainer.py it calls."""


def test_no_file_of_the_library_is_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "avrid").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_library_has_no_import_cycle() -> None:
    # Imports under `if TYPE_CHECKING:` are annotations only and never run, so they cannot
    # form a cycle at import time (config.py runs validate.py's rules; validate.py names
    # PPOConfig in its annotations).
    graph = grimp.build_graph("avrid", exclude_type_checking_imports=True, cache_dir=None)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.chain_exists(importer=imported, imported=module):
                cycles.append(f"{module} -> {imported} -> ... -> {module}")
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("package", sorted(p.name for p in PPO.iterdir()
                                           if (p / "__init__.py").is_file()))
def test_each_sub_package_gives_its_reading_order_naming_every_file(package: str) -> None:
    doc = ast.get_docstring(ast.parse((PPO / package / "__init__.py").read_text())) or ""
    assert "Read in this order" in doc, f"avrid/ppo/{package}/__init__.py"
    files = sorted(p.name for p in (PPO / package).glob("*.py") if p.name != "__init__.py")
    missing = [f for f in files if f not in doc]
    assert not missing, f"avrid/ppo/{package}/__init__.py does not list {missing}"


def _ppo_files_called_by_the_step() -> set[str]:
    """Files of avrid/ppo that define a name used in the bodies of `STEP_FUNCTIONS`
    (annotations left out: they are types, not calls)."""
    tree = ast.parse((PPO / "driver" / "trainer.py").read_text())
    home = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("avrid.ppo."):
            path = node.module.removeprefix("avrid.ppo.").replace(".", "/") + ".py"
            home.update({a.asname or a.name: path for a in node.names})
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in STEP_FUNCTIONS]
    used = set()
    for fn in functions:
        for stmt in fn.body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.AnnAssign):
                    node.annotation = ast.Constant(None)  # a type, not a call
                if isinstance(node, ast.Name) and node.id in home:
                    used.add(home[node.id])
    return used | {"driver/trainer.py"}


def test_one_step_reads_in_eight_files_which_the_chapter_readme_lists_in_order() -> None:
    assert _ppo_files_called_by_the_step() == set(STEP_FILES)
    assert len(STEP_FILES) <= 8
    readme = (ROOT / "chapters" / "ch05_ppo" / "README.md").read_text()
    positions = [readme.find(f"avrid/ppo/{f}") for f in STEP_FILES]
    assert -1 not in positions, [f for f, p in zip(STEP_FILES, positions, strict=True) if p < 0]
    assert positions == sorted(positions), "the README lists the step's files out of order"


def test_no_code_imports_the_old_flat_module_paths() -> None:
    # (`roles` and `data` are names of both an old module and a new sub-package: left out)
    old = re.compile(r"avrid\.ppo\.(trainer|run|config|tasks|rollout|batching|actor|presets|"
                     r"policy_worker|critic_worker|reward_worker|trained_worker|models)\b")
    hits = [str(p.relative_to(ROOT)) for folder in ("avrid", "tests", "chapters", "benchmarks")
            for p in (ROOT / folder).rglob("*.py")
            if p.name != "test_layout.py" and old.search(p.read_text())]
    assert not hits, hits
