"""Benchmark — `avrid ppo --estimate-memory` checked: predicted vs measured peak, on CPU.

Issue 28 asks that the estimate be checked, not guessed. For three CPU-measurable configs (a
tiny Qwen2 with a 32k vocabulary, hidden 256-384, 4-6 layers; packed or right-padded;
activation checkpointing off or on) ONE child process per run does what a policy rank does:
a `PolicyWorker` (in-process identity, dp = 1, fp32 on CPU) is set up, its engine sleeps as
after a generation (`handoff.to_trainer`), one update makes AdamW's state (warm-up), then the
old-log-prob pass (`compute_logprobs`) and one update (`update`) are measured, and so is
`setup` itself (the estimate's "setup" phase: the whole fp32 model and the engine's copy;
measured about 25% above it on CPU, where building the model also leaves transformers'
initialisation temporaries in the resident set — a GPU holds only what is moved to it).
A phase's peak is the child's resident high-water mark during it (VmHWM, reset through
/proc/self/clear_refs when the phase starts; ``MALLOC_MMAP_THRESHOLD_=1048576`` so freed
tensors leave the resident set) minus the resident size before `setup`: the memory the
worker holds at that peak, model and optimizer included — what `memory_estimate.estimate`
predicts for a GPU.

The prediction is `estimate(config, vocab=32000, workload=<this batch>, runtime=0)`: the
batch's own sizes (rows, tokens computed, longest row, response positions) instead of the
config's worst case, and no CUDA allowance. Each config's batch is length-skewed (a few long
responses among short ones) and runs as one micro-batch. Printed: predicted, measured (median
of `--repeats` runs) and their ratio per phase; the target is within 20% everywhere. Also
"resident": what the worker holds between phases after its first update (fp32 weights and
AdamW's two moments predicted, 12 bytes a parameter; the engine asleep).

Run: ``.venv/bin/python benchmarks/memory_estimate.py [--repeats 3]``. CPU only, about a
minute on 2 cores. It always exits 0: a benchmark, not a test (tests/test_ppo_memory_estimate.py
checks one config).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

VOCAB, PAD, EOS, PROMPT = 32_000, 0, 1, 32
CONFIGS: dict[str, dict] = {
    "A packed, no ckpt": {"hidden": 256, "layers": 4, "heads": 4, "pack": True, "ckpt": False,
                          "responses": [32] * 12 + [448, 512]},
    "B packed, ckpt": {"hidden": 384, "layers": 6, "heads": 6, "pack": True, "ckpt": True,
                       "responses": [32] * 20 + [640, 1024]},
    "C padded, no ckpt": {"hidden": 256, "layers": 4, "heads": 4, "pack": False,
                          "ckpt": False, "responses": [24] * 10 + [224, 288]},
}
"""Name -> the model's shape, the layout and the batch's response lengths (prompts of
`PROMPT` tokens)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    print(f"peak resident memory of a PolicyWorker's phase above the process before setup, "
          f"MiB; measured: median of {args.repeats} runs; vocab {VOCAB}, fp32, dp=1, CPU")
    print(f"{'config':<20} {'tokens':>6} {'phase':>9} {'predicted':>10} {'measured':>9} "
          f"{'ratio':>6}")
    for name in CONFIGS:
        runs = [run_child(name) for _ in range(args.repeats)]
        for phase in ("setup", "resident", "logprobs", "update"):
            got = statistics.median(r[phase] for r in runs)
            want = runs[0]["predicted"][phase]
            print(f"{name:<20} {runs[0]['tokens']:>6} {phase:>9} {want / 2**20:>10.0f} "
                  f"{got / 2**20:>9.0f} {want / got:>6.2f}")


def run_child(name: str, env: dict[str, str] | None = None) -> dict:
    """One measurement of config `name` in a fresh process (returns `measure`'s dict)."""
    env = {**(env if env is not None else os.environ), "MALLOC_MMAP_THRESHOLD_": "1048576",
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", name], env=env,
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def config_of(name: str):  # noqa: ANN201 (PPOConfig; imported in the child only)
    """The run's config for `name`: GRPO (no critic, no reference), one in-process rank."""
    from avrid.ppo.setup.config import PPOConfig
    from avrid.ppo.setup.overrides import with_overrides

    c = CONFIGS[name]
    return with_overrides(PPOConfig(), [
        "algo.name=grpo", "algo.kl_coef=0.0", "placement.backend=inprocess",
        "placement.actor_dp=1", "placement.critic_dp=1", f"model.hidden_size={c['hidden']}",
        f"model.num_layers={c['layers']}", f"model.num_heads={c['heads']}",
        f"memory.pack_sequences={c['pack']}", f"train.gradient_checkpointing={c['ckpt']}",
        "memory.logprob_chunk=512", f"rollout.max_prompt_tokens={PROMPT}",
        f"rollout.max_response_tokens={max(c['responses'])}",
        f"train.micro_batch_tokens={sum(c['responses']) + PROMPT * len(c['responses'])}"])


def workload_of_batch(name: str):  # noqa: ANN201 (memory_estimate.Workload)
    """The estimate's `Workload` for config `name`'s batch, run as one micro-batch."""
    from avrid.ppo.setup.memory_estimate import Workload

    c = CONFIGS[name]
    rows, longest = len(c["responses"]), PROMPT + max(c["responses"])
    real = sum(c["responses"]) + PROMPT * rows
    return Workload(rows=rows, tokens=real if c["pack"] else rows * longest, longest=longest,
                    response_tokens=sum(c["responses"]), gen_rows=rows, gen_len=longest)


def measure(name: str) -> dict:
    """In the child: set up a PolicyWorker, then measure its log-prob pass and update."""
    import torch

    from avrid.dispatch import Batch, Shard
    from avrid.ppo.data.columns import Totals
    from avrid.ppo.roles import handoff
    from avrid.ppo.roles.policy import PolicyWorker
    from avrid.ppo.setup.memory_estimate import estimate
    from avrid.workers import WorkerIdentity

    torch.set_num_threads(1)
    c, config = CONFIGS[name], config_of(name)
    g = torch.Generator().manual_seed(0)
    responses = c["responses"]
    batch = Batch.from_rows(
        sample_ids=range(len(responses)), prompt_lens=[PROMPT] * len(responses),
        response_lens=responses,
        packed={"tokens": [torch.randint(2, VOCAB, (PROMPT + r,), generator=g)
                           for r in responses],
                "old_logp": [-torch.rand(r, generator=g) for r in responses],
                "advantages": [torch.randn(r, generator=g) for r in responses]})
    shard = Shard(index=0, batch=batch, micro_bounds=(0, len(batch)))
    totals = Totals.of(batch, max(responses))
    worker = PolicyWorker(WorkerIdentity(role="policy", rank=0, world_size=1), config=config,
                          vocab_size=VOCAB, eos_id=EOS, pad_id=PAD,
                          max_response_tokens=max(responses))
    base = _reset_peak()
    worker.setup()
    out = {"setup": _peak() - base}
    handoff.to_trainer(worker.engine)  # as after a generation: the engine's weights dropped
    worker.update(shard, totals=totals, step=0)  # AdamW's state exists from the first step
    out["resident"] = _reset_peak() - base
    worker.compute_logprobs(shard)
    out["logprobs"] = _peak() - base
    _reset_peak()
    worker.update(shard, totals=totals, step=1)
    out["update"] = _peak() - base
    worker.close()
    est = estimate(config, vocab=VOCAB, workload=workload_of_batch(name), runtime=0)
    by_name = {p.name: p.peak for p in est.phases}
    resident = next(p for p in est.phases if p.name == "old log-probs").parts
    out["predicted"] = {"logprobs": by_name["old log-probs"], "update": by_name["actor update"],
                        "resident": resident["optim"] + 4 * est.policy.params,
                        "setup": by_name["setup"]}
    out["tokens"] = est.workload.tokens
    return out


def _status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Reset the resident high-water mark to the current size (Linux: writing 5 to
    clear_refs); returns that size."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _peak() -> int:
    return _status("VmHWM")


if __name__ == "__main__":
    main()
