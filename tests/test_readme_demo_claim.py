"""The README's sentence about `make demo`'s learning curve says what runs give.

`make demo` (``avrid ppo``, the default preset, 300 steps) takes minutes, too long for every
test run, so its validation curve is recorded in ``tests/golden/demo_val_reward.json`` (fresh
runs, with the commit and torch build that gave them; record it again when the preset or the
trainer's numbers change: ``avrid ppo --out DIR`` and DIR/metrics.jsonl's val/reward rows).
This checks that the README quotes that record (each number to the two decimals it shows)
and that the record is of the run the preset makes now (its steps and validation interval).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from avrid.ppo.setup.presets import preset

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]
CLAIM = re.compile(
    r"climbs from (?P<start>[\d.]+) at step (?P<s0>\d+)\s+to (?P<mid>[\d.]+) at step "
    r"(?P<s1>\d+) and (?P<reach>[\d.]+) at step (?P<s2>\d+), then stays between "
    r"(?P<low>[\d.]+) and (?P<high>[\d.]+) to step (?P<end>\d+)")


def test_the_readme_quotes_the_recorded_demo_curve() -> None:
    text = " ".join((ROOT / "README.md").read_text().split())  # one line: no wrapping
    claim = CLAIM.search(text)
    assert claim, "the README's `make demo` sentence has changed shape: update CLAIM"
    record = json.loads((ROOT / "tests/golden/demo_val_reward.json").read_text())
    curve = {int(step): value for step, value in record["val/reward"].items()}
    train = preset("tiny-ppo").train
    assert sorted(curve) == list(range(0, train.steps + 1, train.val_every)), \
        "the record is not of the preset's run: record the demo again"

    def shown(claimed: str, value: float) -> bool:  # as the README rounds it
        return float(claimed) == round(value, 2)

    for number, step in (("start", "s0"), ("mid", "s1"), ("reach", "s2")):
        at = int(claim[step])
        assert shown(claim[number], curve[at]), (f"README: {claim[number]} at step {at}; "
                                                 f"the runs give {curve[at]:.3f}")
    after = [v for s, v in curve.items() if s > int(claim["s2"])]
    assert int(claim["end"]) == train.steps
    assert shown(claim["low"], min(after)) and shown(claim["high"], max(after)), \
        f"README: between {claim['low']} and {claim['high']}; the runs give " \
        f"{min(after):.3f} to {max(after):.3f}"
