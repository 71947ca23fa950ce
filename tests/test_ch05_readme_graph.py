"""Chapter 5's README shows the step graph as `avrid ppo --print-graph` prints it today, for the
default config and for GRPO, and the figures it embeds are there: a change to the graph that
leaves the README behind fails here (rerun the two commands the README names and paste)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from avrid.cli import main

pytestmark = pytest.mark.chapter(5)

README = Path(__file__).resolve().parents[1] / "chapters" / "ch05_ppo" / "README.md"


def printed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    main(argv)
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [["ppo", "--print-graph"],
                                  ["ppo", "--algo", "grpo", "--print-graph"]],
                         ids=["ppo", "grpo"])
def test_the_readme_pastes_what_print_graph_prints(argv: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    text = printed(argv, capsys)
    # The README indents its code blocks by two spaces (they sit in a list item).
    shown = "  ```\n" + "".join(f"  {line}" if line.strip() else line
                                for line in text.splitlines(keepends=True)) + "  ```\n"
    assert shown in README.read_text(), (
        f"chapters/ch05_ppo/README.md does not show `avrid {' '.join(argv)}` as it prints "
        f"now:\n{text}")


def test_the_readme_embeds_the_step_graph_figures_it_names() -> None:
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", README.read_text())
    assert {"step_graph_ppo.png", "step_graph_grpo.png"} <= set(images)
    for image in images:
        assert (README.parent / image).is_file(), image
