"""Golden metrics: `avrid ppo --steps 20` (PPO and GRPO on Ray, dp = 2, with a KL term and
four PPO updates per rollout) gives the algorithmic metrics recorded in `tests/golden/`.

What it guards: a refactoring of the loop (issue 12 reorganises chapter 5) must not change a
number a run computes, and a change of behaviour (a clip range, a learning rate, a loss term
dropped) must not hide behind a version bump. Timings and other machine measurements are left
out. Two checks on the same run:

- **within tolerance, everywhere** (any torch, transformers, CPU or CUDA build): every metric
  within `RTOL` (relative) + `ATOL` (absolute) of the recorded one, step by step. The
  numbers and why they are safe on both sides are at `RTOL`.
- **bit-identical** where the torch and transformers builds are the ones the files record
  (skipped, saying so, elsewhere).

The runs are the default presets with three settings that make more of the algorithm count
(`RUNS`): in the presets as they ship, one update per rollout keeps every ratio at 1 (the
clip never binds) and kl_coef = 0 (no KL term), so neither could be guarded. After a
deliberate change of the numbers (or a new torch), record again:

    python -m tests.test_ppo_golden      # rewrites tests/golden/*.json (takes ~2 min)
"""

from __future__ import annotations

import hashlib
import json
import math
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
RUNS = {
    "ppo": ("tiny-ppo", ["train.mini_batch_size=64", "algo.kl_coef=0.05",
                         "algo.entropy_coef=0.001"]),
    "grpo": ("tiny-grpo", ["train.mini_batch_size=64", "algo.kl_coef=0.05",
                           "algo.kl_in=reward"]),
}
"""Golden file stem -> (preset, settings on top of it): 4 mini-batches of 64 per rollout of
256 (so ratios leave 1 and the clip binds), the KL term in the loss (PPO) and in the reward
(GRPO), an entropy bonus (PPO)."""
MACHINE = ("time/", "perf/", "sync/seconds")
"""Metric prefixes that measure the machine, not the algorithm: not compared."""
RTOL, ATOL = 1e-2, 1e-3
"""The tolerance: |got - recorded| <= ATOL + RTOL * |recorded| for every metric of every step
(the clip fractions: `CLIPFRAC_ATOL`).

Measured here, against these files: transformers 5.19.0 (.venv-vllm) instead of 5.24.0 gives
bit-identical runs; torch's and MKL's SSE kernels instead of AVX-512 (ATEN_CPU_CAPABILITY=
default, MKL_ENABLE_INSTRUCTIONS=SSE4_2, a stand-in for another CPU or build) move metrics by
up to 4e-4 relative by step 16 (1e-6 at step 1: rounding grows as the runs go on), 0.7 % of
this tolerance. Its margin is for builds not run here (CUDA torch, ARM) and for one token's
clip decision falling the other side of 1 +- clip on such a build (one token of the ~180 in
a mini-batch: a 0.5 % change to one of the run's 80 updates). A change of behaviour is
caught from step 1 or 2: the clip range 0.28 -> 0.2, a learning rate 10 % higher, the KL
term (in the loss or the reward) or the entropy bonus dropped each put 96 to 198 metric
values outside it (96 to 189 counting only metrics both runs have). A sampled token that
flips on some build would diverge the run (a reward moves by 1/256 at once); that needs a
uniform draw within rounding (~1e-7) of a boundary: about one run in a thousand, for the
~15k tokens a run samples."""
CLIPFRAC_ATOL = 0.05
"""The clip fractions count tokens on one side of a threshold, so one token's rounding can
move them. They get an absolute tolerance of 5 % of tokens. (critic/vf_clipfrac used to be
rounding alone: the value clip computed old + clamp(v - old), which is not always v, and
flagged 6.7 % and 11 % of in-range tokens at steps 1-2 here, 0.060 with the SSE kernels. It
clips v itself since issue 42 and reads 0 at every step of this run; recorded again then,
every other metric within 2.3e-4 relative of the earlier record, from the loss's last bits
at the tokens that were mis-flagged.)"""
LOSS_ATOL = 5e-3
"""GRPO's actor/loss late in the run is a small difference of large terms (advantages are
normalised by each group's std, and a group whose rewards nearly agree amplifies rounding),
so the order of a float summation moves it by far more than rounding: step 19 went -0.0120
-> -0.0166 -> -0.0148 with packing and per-sequence SDPA (same CPU), and two AVX-512 Xeons
of these machines, with identical builds, gave -0.0148 and -0.0129 (every other metric
within 1e-3 relative). It gets an absolute tolerance of 5e-3; a change of behaviour is still
caught from step 1 by the other metrics, and by this one (at 0.02-0.03 early in the run)."""
LOOSER = {"actor/pg_clipfrac": CLIPFRAC_ATOL, "critic/vf_clipfrac": CLIPFRAC_ATOL,
          "actor/loss": LOSS_ATOL}


def versions() -> dict[str, str]:
    """The builds and the CPU the numbers depend on (the same builds on two CPU models, both
    AVX-512, differed from step 1 in the 8th digit: bit-identity needs the same CPU too)."""
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "cpu": f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"}


def cpu_model() -> str:
    """The CPU, as precisely as /proc/cpuinfo says it (a VM's model name can be a generic
    "Intel(R) Xeon(R) Processor": family, model, stepping and a digest of the feature flags
    tell two of them apart), else the platform's processor string."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:8]
        return (f"{fields['model name']}, family {fields.get('cpu family')} model "
                f"{fields.get('model')} stepping {fields.get('stepping')}, flags {flags}")
    except (OSError, KeyError):
        import platform

        return platform.processor() or platform.machine()


def run_metrics(name: str, out: Path) -> list[dict[str, Any]]:
    """The algorithmic metric rows of a 20-step run of `name` (`RUNS`) into `out`."""
    preset_name, settings = RUNS[name]
    config = with_overrides(preset(preset_name), [
        "train.steps=20", "train.progress=false", f"train.out_dir={out}", *settings])
    rows = train(config).rows
    return [{k: v for k, v in row.items() if not k.startswith(MACHINE)} for row in rows]


def differences(got: list[dict[str, Any]], want: list[dict[str, Any]], *, rtol: float,
                atol: float, looser: dict[str, float] | None = None) -> list[str]:
    """One line per metric of a step that is missing, extra, or further from the recorded
    value than atol + rtol * |recorded| (rtol = atol = 0: any difference at all); `looser`:
    metric -> its own atol instead."""
    looser = looser or {}
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return [f"steps {[r['step'] for r in got]} != recorded {[r['step'] for r in want]}"]
    lines = []
    for g, w in zip(got, want, strict=True):
        for key in sorted({*g, *w}):
            if key not in g or key not in w:
                lines.append(f"step {w['step']} {key}: {w.get(key)!r} -> {g.get(key)!r}")
            elif not math.isclose(g[key], w[key], rel_tol=rtol,
                                  abs_tol=looser.get(key, atol)):
                lines.append(f"step {w['step']} {key}: {w[key]!r} -> {g[key]!r}")
    return lines


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request: pytest.FixtureRequest, ray_session: None,
        tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict]]:
    """(golden file, this machine's rows) for one of `RUNS`: run once, checked twice."""
    golden = json.loads((GOLDEN / f"{request.param}_steps20.json").read_text())
    return golden, run_metrics(request.param, tmp_path_factory.mktemp(request.param) / "run")


@pytest.mark.slow
def test_twenty_steps_give_the_recorded_metrics_within_tolerance(
        run: tuple[dict[str, Any], list[dict]]) -> None:
    golden, rows = run
    bad = differences(rows, golden["rows"], rtol=RTOL, atol=ATOL, looser=LOOSER)
    assert not bad, (f"{len(bad)} metrics moved beyond rtol={RTOL}, atol={ATOL} (recorded "
                     f"on {golden['versions']}, this is {versions()}):\n" + "\n".join(bad[:40]))


@pytest.mark.slow
def test_twenty_steps_give_bit_identical_metrics_on_the_recorded_builds(
        run: tuple[dict[str, Any], list[dict]]) -> None:
    golden, rows = run
    if golden["versions"] != versions():
        pytest.skip(f"bit-identical only on {golden['versions']}, this is {versions()} (the "
                    f"tolerance test still ran); to record here: python -m tests.test_ppo_golden")
    bad = differences(rows, golden["rows"], rtol=0.0, atol=0.0)
    assert not bad, "\n".join(bad[:40])


@pytest.mark.parametrize("change, caught", [
    (0.0, False), (4e-3, False), (3e-2, True), (float("nan"), True)])
def test_the_tolerance_catches_what_it_should(change: float, caught: bool) -> None:
    want = [{"step": 1, "actor/loss": 0.5, "actor/pg_clipfrac": 0.10}]
    got = [{"step": 1, "actor/loss": 0.5 * (1 + change), "actor/pg_clipfrac": 0.14}]
    assert bool(differences(got, want, rtol=RTOL, atol=ATOL, looser=LOOSER)) == caught
    assert differences(got[:0], want, rtol=RTOL, atol=ATOL)  # a step missing
    assert differences([{"step": 1, "actor/loss": 0.5}], want, rtol=RTOL, atol=ATOL)  # a metric
    assert differences([{**want[0], "actor/pg_clipfrac": 0.16}], want, rtol=RTOL, atol=ATOL,
                       looser=LOOSER)  # beyond the clip fractions' own tolerance too
    assert differences(want, [{**want[0], "actor/loss": 0.5 + 1e-12}], rtol=0, atol=0)


def record() -> None:
    """Run every entry of `RUNS` and write its golden file (atomically: write, then rename)."""
    import tempfile

    from avrid.workers import start_ray

    start_ray(address="local")
    GOLDEN.mkdir(exist_ok=True)
    for name in sorted(RUNS):
        with tempfile.TemporaryDirectory() as tmp:
            rows = run_metrics(name, Path(tmp) / "run")
        path = GOLDEN / f"{name}_steps20.json"
        part = path.with_suffix(".json.tmp")
        part.write_text(json.dumps({"versions": versions(), "preset": RUNS[name][0],
                                    "settings": RUNS[name][1], "rows": rows}, indent=1) + "\n")
        part.replace(path)
        print(f"wrote {path} ({len(rows)} rows)", file=sys.stderr)


if __name__ == "__main__":
    record()
