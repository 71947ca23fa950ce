"""Golden metrics: `avrid ppo --steps 20` (PPO and GRPO, the default presets on Ray, dp = 2)
gives bit-identical algorithmic metrics to the ones recorded in `tests/golden/`.

What it guards: a refactoring of the loop (issue 12 reorganises chapter 5) must not change a
single number a run computes. Timings and other machine measurements are left out. The
numbers depend on the exact torch and transformers builds too, so the files record those
versions, and the test skips, saying so, on other versions; after a deliberate change of the
numbers (or a version bump), record again:

    python -m tests.test_ppo_golden      # rewrites tests/golden/*.json (takes ~1 min)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from avrid.ppo.driver.run import train
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

pytestmark = pytest.mark.chapter(5)

GOLDEN = Path(__file__).resolve().parent / "golden"
RUNS = {"ppo": "tiny-ppo", "grpo": "tiny-grpo"}
"""Golden file stem -> preset: the two runs `avrid ppo` and `avrid ppo --algo grpo` make."""
MACHINE = ("time/", "perf/", "sync/seconds")
"""Metric prefixes that measure the machine, not the algorithm: not compared."""


def versions() -> dict[str, str]:
    """The builds the numbers depend on."""
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def run_metrics(name: str, out: Path) -> list[dict[str, Any]]:
    """The algorithmic metric rows of a 20-step run of `name`'s preset into `out`."""
    config = with_overrides(preset(RUNS[name]), [
        "train.steps=20", "train.progress=false", f"train.out_dir={out}"])
    rows = train(config).rows
    return [{k: v for k, v in row.items() if not k.startswith(MACHINE)} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_twenty_steps_give_the_recorded_metrics(name: str, tmp_path: Path,
                                                ray_cluster: None) -> None:
    golden = json.loads((GOLDEN / f"{name}_steps20.json").read_text())
    if golden["versions"] != versions():
        pytest.skip(f"golden metrics were recorded with {golden['versions']}, this is "
                    f"{versions()}: record again (python -m tests.test_ppo_golden)")
    rows = run_metrics(name, tmp_path)
    assert [r["step"] for r in rows] == [r["step"] for r in golden["rows"]]
    for got, want in zip(rows, golden["rows"], strict=True):
        assert got == want, f"step {want['step']}: " + ", ".join(
            f"{k}: {want.get(k)!r} -> {got.get(k)!r}" for k in sorted({*got, *want})
            if got.get(k) != want.get(k))


def record() -> None:
    """Run both presets and write their golden files (atomically: write, then rename)."""
    import tempfile

    from avrid.workers import start_ray

    start_ray()
    GOLDEN.mkdir(exist_ok=True)
    for name in sorted(RUNS):
        with tempfile.TemporaryDirectory() as tmp:
            rows = run_metrics(name, Path(tmp) / "run")
        path = GOLDEN / f"{name}_steps20.json"
        part = path.with_suffix(".json.tmp")
        part.write_text(json.dumps({"versions": versions(), "rows": rows}, indent=1) + "\n")
        part.replace(path)
        print(f"wrote {path} ({len(rows)} rows)", file=sys.stderr)


if __name__ == "__main__":
    record()
