"""The mutation check's list of sites still points at the code (`benchmarks/mutants.py`).

The script itself takes about twenty minutes and is run by hand; this only checks, on every
test run, that each site's anchor is found exactly once in its file (so a refactor that moves
a line fails here, naming the site, rather than leaving a site that mutates nothing), that
the list is as wide as issue 26 asks, and that a site whose anchor moved is refused. It runs
no mutation.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]


def load_mutants():  # noqa: ANN201 (the module)
    spec = importlib.util.spec_from_file_location("avrid_mutants", ROOT / "benchmarks/mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_every_site_still_finds_its_line_exactly_once_and_mutates_it() -> None:
    mutants = load_mutants()
    assert mutants.anchor_problems() == []
    names = [s.name for s in mutants.SITES]
    assert len(names) == len(set(names)) and len(names) >= 30
    # Every site changes its file, and the roles and the RL math are both covered.
    for s in mutants.SITES:
        text = (ROOT / s.file).read_text()
        mutated = s.apply(text)
        assert mutated != text, s.name
        # Still Python: a deleted line must not leave an empty block (a collection error
        # would "kill" the mutant without any test having looked at the formula).
        compile(mutated, s.file, "exec")
        assert s.tests, s.name
    files = {s.file for s in mutants.SITES}
    assert {"avrid/ppo/roles/policy.py", "avrid/ppo/roles/critic.py",
            "avrid/ppo/algo/losses.py", "avrid/ppo/algo/advantages.py",
            "avrid/ppo/algo/off_policy.py"} <= files


def test_a_site_whose_line_moved_is_refused(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    mutants = load_mutants()
    moved = mutants.Site(name="gone", file="avrid/ppo/roles/policy.py",
                         anchor="per_token = per_token * iw.weights_renamed", replace=None,
                         tests=("tests/test_off_policy_update.py",))
    twice = mutants.Site(name="twice", file="avrid/ppo/algo/losses.py", anchor="return m",
                         replace="return 0", tests=("tests/test_ppo_math.py",))
    problems = mutants.anchor_problems((moved, twice))
    assert len(problems) == 2
    assert "gone: anchor" in problems[0] and "found 0 times" in problems[0]
    assert "twice: anchor" in problems[1] and "expected exactly once" in problems[1]
    with pytest.raises(ValueError, match="found 0 times"):
        moved.apply((ROOT / moved.file).read_text())
    # The command refuses before copying or running anything.
    mutants.SITES = (moved,)
    assert mutants.main(["--only", "gone"]) == 2
    assert "refusing to run" in capsys.readouterr().err
