"""The library's shape, as a learner meets it: small files, no import cycles, every
sub-package of avrid.ppo with its reading order, one PPO step readable in nine files, and
docs that count and name the config's sections and the presets as the code has them.

These read the source (ast, grimp); nothing here imports torch or starts Ray.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]
PPO = ROOT / "avrid" / "ppo"
MAX_LINES = 400

STEP_FILES = [
    "driver/trainer.py", "data/prompts.py", "roles/policy.py", "driver/scoring.py",
    "roles/critic.py", "data/columns.py", "data/credit.py", "data/dynamic_sampling.py",
    "algo/losses.py",
]
"""The files of avrid/ppo a learner opens to follow one step from `train_step`, in the
order chapters/ch05_ppo/README.md gives them."""

OPTIONAL_STEP_FILES = ["driver/reference.py", "driver/concurrent.py"]
"""Files a step reaches only under an option, which the README names after `STEP_FILES`:
a KL term sends "ref_logp" where `placement.reference` says; `train.concurrent_phases` runs
the same phases by the step graph."""

STEP_FUNCTIONS = ("train_step", "generator", "step_prompts", "sampling", "updates_actor",
                  "learn", "score", "fill", "generate_round", "train_on", "_metrics",
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


READING_ENTRY = re.compile(r"^\s*(\d+)\.\s+(\S+\.py)\s", re.MULTILINE)
"""A numbered entry of a reading order: ``3. losses.py   what it holds``."""


def reading_order_problems(doc: str, files: list[str]) -> list[str]:
    """What is wrong with the reading order in a sub-package's docstring `doc`, for a package
    holding `files`: it must say "Read in this order" and number each file exactly once, by
    its exact name (a file named only inside a longer name, ``engine.py`` in
    ``vllm_engine.py``, is not listed), and name no file that is not there."""
    if "Read in this order" not in doc:
        return ["no 'Read in this order'"]
    entries = READING_ENTRY.findall(doc)
    listed = [name for _, name in entries]
    problems = []
    if [int(n) for n, _ in entries] != list(range(1, len(entries) + 1)):
        problems.append(f"not numbered 1..{len(entries)}: {[n for n, _ in entries]}")
    if missing := sorted(set(files) - set(listed)):
        problems.append(f"does not list {missing}")
    if extra := sorted(set(listed) - set(files)):
        problems.append(f"lists files that are not there: {extra}")
    if twice := sorted({f for f in listed if listed.count(f) > 1}):
        problems.append(f"lists {twice} more than once")
    return problems


@pytest.mark.parametrize("package", sorted(p.name for p in PPO.iterdir()
                                           if (p / "__init__.py").is_file()))
def test_each_sub_package_gives_its_reading_order_naming_every_file(package: str) -> None:
    doc = ast.get_docstring(ast.parse((PPO / package / "__init__.py").read_text())) or ""
    files = sorted(p.name for p in (PPO / package).glob("*.py") if p.name != "__init__.py")
    problems = reading_order_problems(doc, files)
    assert not problems, f"avrid/ppo/{package}/__init__.py: {problems}"


def test_a_reading_order_must_name_each_file_exactly() -> None:
    # engine.py appears only inside vllm_engine.py: a substring test would count it listed.
    doc = "Read in this order:\n\n1. vllm_engine.py  the engine\n2. gone.py  a removed file\n"
    assert "engine.py" in doc
    assert reading_order_problems(doc, ["engine.py", "vllm_engine.py"]) == [
        "does not list ['engine.py']", "lists files that are not there: ['gone.py']"]
    assert reading_order_problems("1. a.py  x\n3. b.py  y\n", ["a.py", "b.py"]) == [
        "no 'Read in this order'"]
    assert reading_order_problems("Read in this order:\n1. a.py  x\n3. b.py  y\n",
                                  ["a.py", "b.py"]) == ["not numbered 1..2: ['1', '3']"]


def names_outside_annotations(node: ast.AST) -> Iterator[str]:
    """The `ast.Name`s under `node`, except those inside an annotation (of a variable, an
    argument or a return value): those are types, not calls. A walk of its own, since
    `ast.walk` has queued a node's children before it yields the node."""
    if isinstance(node, ast.Name):
        yield node.id
    for field, value in ast.iter_fields(node):
        if field in ("annotation", "returns"):
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.AST):
                yield from names_outside_annotations(child)


def ppo_files_called_by_the_step(source: str) -> set[str]:
    """Files of avrid/ppo that define a name used in the bodies of `STEP_FUNCTIONS` in
    `source` (trainer.py's text), annotations left out."""
    tree = ast.parse(source)
    home = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("avrid.ppo."):
            path = node.module.removeprefix("avrid.ppo.").replace(".", "/") + ".py"
            home.update({a.asname or a.name: path for a in node.names})
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in STEP_FUNCTIONS]
    used = {name for fn in functions for stmt in fn.body
            for name in names_outside_annotations(stmt)}
    return {home[name] for name in used if name in home} | {"driver/trainer.py"}


def test_a_name_used_only_as_a_type_adds_no_file_to_the_step() -> None:
    source = (
        "from avrid.ppo.algo.losses import policy_loss\n"
        "from avrid.ppo.outputs.metrics import MetricsWriter\n"
        "from avrid.ppo.data.columns import Totals\n\n"
        "class Trainer:\n"
        "    def train_step(self, step):\n"
        "        writer: MetricsWriter = self.writer\n"
        "        def inner(totals: Totals) -> MetricsWriter:\n"
        "            return totals\n"
        "        return policy_loss(step)\n")
    assert ppo_files_called_by_the_step(source) == {"algo/losses.py", "driver/trainer.py"}


def test_one_step_reads_in_nine_files_which_the_chapter_readme_lists_in_order() -> None:
    assert ppo_files_called_by_the_step(
        (PPO / "driver" / "trainer.py").read_text()) == set(STEP_FILES + OPTIONAL_STEP_FILES)
    assert len(STEP_FILES) <= 9
    readme = (ROOT / "chapters" / "ch05_ppo" / "README.md").read_text()
    files = STEP_FILES + OPTIONAL_STEP_FILES
    positions = [readme.find(f"avrid/ppo/{f}") for f in files]
    assert -1 not in positions, [f for f, p in zip(files, positions, strict=True) if p < 0]
    assert positions == sorted(positions), "the README lists the step's files out of order"


def test_no_code_imports_the_old_flat_module_paths() -> None:
    # (`roles` and `data` are names of both an old module and a new sub-package: left out)
    old = re.compile(r"avrid\.ppo\.(trainer|run|config|tasks|rollout|batching|actor|presets|"
                     r"policy_worker|critic_worker|reward_worker|trained_worker|models)\b")
    hits = [str(p.relative_to(ROOT)) for folder in ("avrid", "tests", "chapters", "benchmarks")
            for p in (ROOT / folder).rglob("*.py")
            if p.name != "test_layout.py" and old.search(p.read_text())]
    assert not hits, hits


# ---- what the docs say the config is made of ---------------------------------------------------

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen")


def config_sections() -> list[str]:
    """The sections of `PPOConfig`, in order, read from config.py's class body."""
    tree = ast.parse((PPO / "setup" / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PPOConfig")
    return [n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def preset_names() -> list[str]:
    """The names `--preset` takes: the keys of presets.py's `PRESETS`."""
    tree = ast.parse((PPO / "setup" / "presets.py").read_text())
    table = next(n.value for n in tree.body if isinstance(n, ast.AnnAssign)
                 and isinstance(n.target, ast.Name) and n.target.id == "PRESETS")
    assert isinstance(table, ast.Dict)
    return [ast.literal_eval(k) for k in table.keys if k is not None]


SECTION_COUNTS = ("README.md", "chapters/ch05_ppo/README.md", "avrid/ppo/setup/config.py",
                  "avrid/ppo/setup/__init__.py")
"""Files that say how many sections `PPOConfig` has ("ten sections", "nine typed sections")."""

PRESET_LISTS = {
    "chapters/ch05_ppo/README.md": ("Nothing has to divide anything.", "On the command line"),
    "README.md": ("avrid/ppo/setup/presets.py ", "avrid/ppo/setup/field_help.py"),
    "avrid/ppo/setup/__init__.py": ("presets.py ", "11."),
    "avrid/ppo/setup/presets.py": ("``--set section.field=value``.", '"""'),
}
"""Where the docs list every preset: file -> the text from the first marker to the second
(whitespace runs read as one space)."""


def test_the_docs_count_the_config_sections_right() -> None:
    sections = config_sections()
    word = NUMBER_WORDS[len(sections)]
    for name in SECTION_COUNTS:
        text = " ".join((ROOT / name).read_text().split())
        counts = re.findall(r"\b(\w+) (?:small |frozen |typed )*sections\b", text)
        said = [c for c in counts if c in NUMBER_WORDS]
        assert said, f"{name} no longer says how many sections PPOConfig has"
        assert set(said) == {word}, f"{name} says {said} sections; PPOConfig has {word}"
    # chapter 5 names them, in order, between dashes
    readme = " ".join((ROOT / "chapters" / "ch05_ppo" / "README.md").read_text().split())
    listed = readme.split(f"with {word} sections — ", 1)[1].split(" — ", 1)[0]
    assert re.findall(r"`(\w+)`", listed) == sections


def test_the_docs_list_every_preset() -> None:
    presets = preset_names()
    for name, (start, end) in PRESET_LISTS.items():
        text = " ".join((ROOT / name).read_text().split())
        assert start in text, f"{name}: the list of presets (after {start!r}) is gone"
        part = text.split(start, 1)[1].split(end, 1)[0]
        # presets.py's docstring names the functions (tiny_ppo), the others the names (tiny-ppo)
        listed = [n.replace("_", "-") for n in re.findall(r"\b(?:tiny|small|pipeline|qwen)"
                                                         r"[-_][\w-]+", part)]
        assert sorted(set(listed)) == sorted(presets), (name, listed)
        count = re.search(r"\b(\w+) presets\b", part)
        if count and count.group(1) in NUMBER_WORDS:
            assert count.group(1) == NUMBER_WORDS[len(presets)], (name, count.group(1))
