"""Chapter 5 demo — PPO on a CPU: every phase of the single-controller loop, timed, checked.

Run it with ``python -m chapters.ch05_ppo`` (CPU only; 38 s on a busy 2-core machine, half
of it starting Ray and the workers). It reads top to bottom:

1. the config: the `tiny-ppo` preset (a 2-layer random Qwen2, the digit-reversal task, two
   data-parallel ranks per role on Ray) with a short schedule and a small KL term, so that the
   reference model runs too and a step shows all nine phases;
2. the placement: which role runs on which bundle (actor + reference + rollout share one
   process per rank, the critic shares their bundles, the reward worker sits beside them);
3. the loop, driven by hand the way `avrid.ppo.driver.run.train` drives it: validate, then
   `Trainer.train_step` once per step, one line of metrics each;
4. the last step taken apart: seconds per phase and its share of the step, then chapter 3's
   timeline of that step (who was busy, who waited), written under ``outputs/ch05/``;
5. validation again and a checkpoint, then the checks: rollout and trainer log-probs agree,
   every phase ran, the validation reward went up, the checkpoint is complete.

It exits 0 when every check passes and 1 otherwise. For a full run with metrics.jsonl,
samples, plots and resume, use ``avrid ppo`` instead; this file defines no library code.
"""

from __future__ import annotations

import time
from pathlib import Path

from avrid.ppo.driver.run import save
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.outputs.plots import PHASES
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.results import Timeline

STEPS = 20
OUT = Path("outputs/ch05")
MAX_GAP = 1e-4  # rollout vs trainer log-probs: same weights, same math, so rounding only


def demo_config() -> PPOConfig:
    """`tiny-ppo`, shortened. kl_coef > 0 adds the reference model (the ref_logp phase)."""
    return with_overrides(preset("tiny-ppo"), [
        f"train.steps={STEPS}", f"train.out_dir={OUT}", "train.progress=false",
        "algo.kl_coef=0.001"])


def check(label: str, ok: bool) -> bool:
    """Print one verified claim; the demo's exit status is the AND of all of them."""
    print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    return ok


def step_line(step: int, m: dict[str, float]) -> str:
    """One line per step: what the policy earned and what the update did."""
    return (f"  step {step:>2}  reward {m['train/reward']:.3f}  "
            f"entropy {m['actor/entropy']:.3f}  ref_kl {m.get('actor/ref_kl', 0):+.4f}  "
            f"vf_error {m['critic/vf_error']:.3f}  gap {m['rollout/logprob_gap']:.1e}  "
            f"{m['time/step']:.2f} s")


def show_phases(m: dict[str, float]) -> None:
    """The last step's seconds per phase (time/<phase>) and their share of the step."""
    total = m["time/step"]
    for p in PHASES:
        if f"time/{p}" in m:
            s = m[f"time/{p}"]
            print(f"  {p:<14} {s:>6.3f} s {s / total:>6.1%}  {'#' * round(40 * s / total)}")
    print(f"  {'whole step':<14} {total:>6.3f} s; the busiest worker of each call computed "
          f"for {m['time/compute']:.3f} s of it,\n  the other {m['time/overhead']:.0%} is "
          f"the driver, dispatch, transport and waiting")


def phase_order(timeline: Timeline) -> list[str]:
    """The phases on the timeline's driver lane, in the order they started."""
    spans = [s for lane in timeline.lanes if lane.group == "driver" for s in lane.spans
             if s.name in PHASES]
    return [s.name for s in sorted(spans, key=lambda s: s.start)]


def main() -> int:
    """Config, placement, the loop, the last step's phases and timeline, checks."""
    start = time.perf_counter()
    config = demo_config()
    a, t, p = config.algo, config.train, config.placement
    print(f"== 1. {a.name.upper()} on the digit task: {t.prompts_per_step} prompts x "
          f"{a.responses_per_prompt} responses per step, mini-batches of {t.mini_batch_size}, "
          f"{t.steps} steps ==")
    print(f"  model: {config.model.num_layers} layers, hidden {config.model.hidden_size}, "
          f"random init; task: {dict(config.task.options)}; kl_coef {a.kl_coef} ({a.kl_kind} "
          f"in the {a.kl_in})")

    import ray

    ok = True
    try:
        with Trainer(config) as trainer:
            print(f"\n== 2. placement: actor_dp={p.actor_dp}, critic_dp={p.critic_dp}, "
                  f"backend {p.backend} ==")
            for line in trainer.placement().describe().splitlines():
                print("  " + line)
            t0 = time.perf_counter()
            trainer.start()  # Ray, the workers, their process groups, the models
            print(f"  started in {time.perf_counter() - t0:.1f} s")

            print("\n== 3. the loop ==")
            before = trainer.validate()["val/reward"]
            print(f"  validation before training: reward {before:.3f} "
                  f"({len(trainer.val_set)} held-out prompts, greedy)")
            rows = []
            for step in range(STEPS):
                metrics, batch = trainer.train_step(step)
                rows.append(metrics)
                print(step_line(step + 1, metrics))
            after = trainer.validate()["val/reward"]
            print(f"  validation after {STEPS} steps: reward {after:.3f}")

            last = rows[-1]
            print(f"\n== 4. the last step, phase by phase ({len(batch)} sequences, "
                  f"{int(batch.total_lens.sum())} tokens) ==")
            show_phases(last)
            timeline = trainer.timeline
            assert timeline is not None
            print()
            for line in timeline.describe().splitlines():
                print("  " + line)
            gantt = timeline.gantt(OUT / "timeline.png", title=f"PPO step {STEPS}")
            trace = timeline.to_chrome_trace(OUT / "timeline.json")
            print(f"  Gantt chart: {gantt}; Perfetto trace: {trace} (ui.perfetto.dev)")

            print("\n== 5. checkpoint and checks ==")
            ckpt = save(trainer, OUT / "checkpoints", STEPS)
            print(f"  checkpoint: {ckpt} ({', '.join(sorted(f.name for f in ckpt.iterdir()))})")
        gap = max(r["rollout/logprob_gap_max"] for r in rows)
        ok &= check(f"rollout and trainer log-probs agree: largest gap {gap:.1e} < {MAX_GAP}",
                    gap < MAX_GAP)
        step = [p for p in PHASES if p != "reward_model"]  # the demo has no reward model
        ok &= check(f"the timeline shows all {len(step)} phases, once each, in order: "
                    + " -> ".join(phase_order(timeline)), phase_order(timeline) == step)
        ok &= check(f"validation reward went up: {before:.3f} -> {after:.3f}", after > before)
        ok &= check("the weight sync moved bytes every step",
                    all(r["sync/bytes_per_rank"] > 0 for r in rows))
        ok &= check("the checkpoint holds actor and critic shards (weights and optimizers)",
                    all((ckpt / f).is_file() for f in (
                        "manifest.json", "state.json", "actor/model/.metadata",
                        "actor/optim/.metadata", "critic/model/.metadata",
                        "critic/optim/.metadata")))
    finally:
        ray.shutdown()  # the Trainer started Ray in this process; stop it even on error
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} in "
          f"{time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
