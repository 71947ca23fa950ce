"""Chapter 5 — one PPO step run phase after phase and with its ready phases at once: both timelines.

The critic on a pool of its own (``placement.colocate_critic=false``), one rank per role, in
process (each rank a thread), the `tiny-ppo` preset; ``train.concurrent_phases`` off, then on.
Serially the critic's rank waits while the policy computes its log-probs and its update, and
the policy's rank waits while the critic computes; concurrently (`avrid/ppo/driver/
concurrent.py`) the values run beside old_logp and the critic's update beside the actor's, so
those bubbles close. Both runs compute the same step: their metrics are compared, and a
difference is an error.

`step_timelines` returns the two timelines (each the last step's, after a first step that warms
up); `main` writes them, stacked on one time scale (`avrid.results.stacked_gantt`), to
``chapters/ch03_results/serial_vs_concurrent.png``: chapter 3's README and notebook show where
its timeline leads. Run it with ``python -m chapters.ch05_ppo.concurrent_step [FILE.png]``.

Here the ranks are threads of one process on whatever cores the machine has: the phases
overlap, but they share those cores, so each may take longer beside the other. On devices of
their own (Ray, a core or a GPU per pool) the step itself shortens:
``benchmarks/bench_concurrent_phases.py`` measures that.
"""

from __future__ import annotations

import sys
from pathlib import Path

from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.results import Timeline, stacked_gantt

ROOT = Path(__file__).resolve().parents[2]
FIGURE = ROOT / "chapters" / "ch03_results" / "serial_vs_concurrent.png"
"""Where `main` writes the figure (chapter 3's README shows it)."""
SETTINGS = ("placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
            "placement.colocate_critic=false", "train.progress=false",
            "train.out_dir=outputs/ch05_concurrent_step")
"""The run: tiny-ppo with the critic on a pool of its own, one rank per role, in process."""
MODES = {"serial": "train.concurrent_phases=false",
         "concurrent": "train.concurrent_phases=true"}
MACHINE = ("time/", "perf/", "sync/")
"""Metrics that measure the machine, not the step: the only ones the two modes may differ in."""


def step_timelines(steps: int = 2) -> dict[str, Timeline]:
    """Run `steps` steps of each mode (`MODES`) from the same seed; the last step's timeline
    of each, by mode. Raises RuntimeError if the modes' metrics differ."""
    timelines: dict[str, Timeline] = {}
    computed: dict[str, dict[str, float]] = {}
    for mode, setting in MODES.items():
        with Trainer(with_overrides(preset("tiny-ppo"), [*SETTINGS, setting])) as trainer:
            trainer.start()
            for step in range(steps):
                metrics, _ = trainer.train_step(step)
            timelines[mode] = trainer.timeline
            computed[mode] = {k: v for k, v in metrics.items() if not k.startswith(MACHINE)}
    if computed["serial"] != computed["concurrent"]:
        differ = sorted(k for k in computed["serial"]
                        if computed["serial"][k] != computed["concurrent"].get(k))
        raise RuntimeError(f"the serial and the concurrent step computed different metrics: "
                           f"{', '.join(differ)}")
    return timelines


def title(mode: str, timeline: Timeline) -> str:
    """``serial: step 0.145 s, critic[0] busy 31%, policy[0] busy 53%``."""
    util = timeline.utilization()
    busy = ", ".join(f"{label} busy {util[label].share:.0%}"
                     for label in ("critic[0]", "policy[0]") if label in util)
    return f"{mode}: step {timeline.end - timeline.start:.3f} s, {busy}"


def main(path: Path = FIGURE) -> Path:
    """Run both modes, print each step's timeline table, write the stacked figure to `path`."""
    timelines = step_timelines()
    for mode, tl in timelines.items():
        print(f"== {title(mode, tl)} ==\n{tl.describe()}\n")
    out = stacked_gantt({title(m, tl): tl for m, tl in timelines.items()}, path)
    print(f"figure: {out}")
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else FIGURE)
