"""Chapter 6 demo — where the bubbles go: the same workload synchronous and one-step-off.

Run it with ``python -m chapters.ch06_async`` (CPU only; under a minute on a 2-core machine,
a third of it starting Ray and the workers). It reads top to bottom:

1. the workload: the `pipeline-cpu` preset, one rank per role, a step whose generation and
   training take about the same time;
2. the synchronous loop (chapter 5) for a few steps: generation, then training, then the
   weight sync — each device idle while the other works;
3. the same steps with ``pipeline.mode=one_step_off`` (chapter 6): a rollout worker in its
   own bundle generates step k+1 while the trainer trains on step k; weights are pushed
   between the two pools after every step;
4. the numbers side by side (step time, generation and training time, overlap, staleness)
   and both timelines drawn one above the other in ``outputs/ch06/timelines.png``;
5. the checks: one-step-off is stale by exactly one version after its first batch, its
   steps overlap generation with training and are shorter than the synchronous ones.

It exits 0 when every check passes and 1 otherwise. The first step of each run is a warm-up
(first calls, connections) and is left out of the times and the picture.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from avrid.pipeline import make_trainer
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.results import Timeline
from chapters.ch06_async.figure import save_timelines_figure

STEPS = 5
OUT = Path("outputs/ch06")


def run(mode: str) -> tuple[list[dict[str, float]], Timeline, float]:
    """`STEPS` steps of the workload in `mode`: each step's metrics, the timeline of the steps
    after the first, and the seconds the cluster took to start."""
    config = with_overrides(preset("pipeline-cpu"), [
        f"pipeline.mode={mode}", f"train.steps={STEPS}", f"train.out_dir={OUT / mode}"])
    rows, timelines = [], []
    with make_trainer(config) as trainer:
        started = time.time()
        trainer.start()
        startup = time.time() - started
        for step in range(STEPS):
            metrics, _ = trainer.train_step(step)
            rows.append(metrics)
            timelines.append(trainer.timeline)
            print(f"  {mode:<12} step {step}  {metrics['time/step']:.2f} s  reward "
                  f"{metrics['train/reward']:.3f}  staleness "
                  f"{metrics.get('pipeline/staleness_max', 0):.0f}  overlap "
                  f"{metrics.get('pipeline/overlap', 0):.2f}")
    return rows, Timeline.merge(*timelines[1:]), startup


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows[1:])


def check(label: str, ok: bool) -> bool:
    """Print one verified claim; the demo's exit status is the AND of all of them."""
    print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    return ok


def main() -> int:
    print("1. the workload: preset pipeline-cpu (GRPO, one rank per role, 64-token responses)")
    print("\n2. synchronous (chapter 5): generate, then train, then sync")
    sync, sync_tl, sync_start = run("sync")
    print("\n3. one-step-off (chapter 6): generate step k+1 while training step k")
    off, off_tl, off_start = run("one_step_off")

    step_sync, gen = median(sync, "time/step"), median(sync, "time/generate")
    train = step_sync - gen
    step_off = median(off, "time/step")
    print(f"\n4. medians over steps 1-{STEPS - 1} (start-up: sync {sync_start:.1f} s, "
          f"one-step-off {off_start:.1f} s)")
    print(f"  sync step {step_sync:.2f} s = generate {gen:.2f} s + the rest {train:.2f} s")
    print(f"  one-step-off step {step_off:.2f} s ({step_off / step_sync:.2f} x sync; "
          f"{step_off / max(gen, train):.2f} x max(generate, rest)); generation overlapped "
          f"{median(off, 'pipeline/overlap'):.0%} of its step")
    path = save_timelines_figure(
        {f"sync: {step_sync:.2f} s per step": sync_tl,
         f"one_step_off: {step_off:.2f} s per step": off_tl},
        OUT / "timelines.png", title="the same steps, synchronous and one-step-off")
    print(f"  both timelines: {path}")

    print("\n5. checks")
    stale = [r["pipeline/staleness_max"] for r in off]
    ok = check(f"one-step-off staleness per step {stale}: 0, then exactly 1",
               stale == [0.0] + [1.0] * (STEPS - 1))
    ok &= check("generation overlapped training in one-step-off (overlap > 0.2)",
                median(off, "pipeline/overlap") > 0.2)
    ok &= check("one-step-off steps are shorter than synchronous ones", step_off < step_sync)
    ok &= check("the picture was written", path.stat().st_size > 0)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
