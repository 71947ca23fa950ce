"""Chapter 3's figure of a concurrent step (drawn by chapters/ch05_ppo/concurrent_step.py): the
two timelines it stacks are of the same step, serially the critic's values wait for the
policy's log-probs, concurrently they run beside them, and the figure is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from avrid.results import Span, Timeline, stacked_gantt
from chapters.ch05_ppo import concurrent_step

pytestmark = pytest.mark.chapter(5)


def phase(tl: Timeline, name: str) -> Span:
    """The driver's span of the phase `name`, on whichever driver lane it was drawn."""
    (found,) = [s for ln in tl.lanes if ln.group == "driver" for s in ln.spans
                if s.name == name]
    return found


def overlap(a: Span, b: Span) -> bool:
    return a.start < b.end and b.start < a.end


def test_the_concurrent_step_runs_the_critic_beside_the_policy_and_the_serial_one_does_not(
        tmp_path: Path) -> None:
    tls = concurrent_step.step_timelines(steps=1)  # raises if the two computed different steps
    assert list(tls) == ["serial", "concurrent"]
    for mode, beside in (("serial", False), ("concurrent", True)):
        tl = tls[mode]
        assert overlap(phase(tl, "values"), phase(tl, "old_logp")) is beside, mode
        assert overlap(phase(tl, "critic_update"), phase(tl, "actor_update")) is beside, mode
    # The concurrent step's phases that ran at once sit on driver lanes of their own.
    assert {"driver:critic", "driver:policy"} <= {ln.label for ln in tls["concurrent"].lanes}
    png = stacked_gantt({concurrent_step.title(m, tl): tl for m, tl in tls.items()},
                        tmp_path / "both.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert concurrent_step.title("serial", tls["serial"]).startswith("serial: step ")


def test_stacking_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one timeline"):
        stacked_gantt({}, tmp_path / "none.png")
