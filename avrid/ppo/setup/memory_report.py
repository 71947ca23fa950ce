"""Chapter 5 — `avrid ppo --estimate-memory`'s table, its verdict and a layout that fits.

`report(config, gpu_bytes, gpus=N)` prints `memory_estimate.estimate`'s phases as one table
per GPU kind (the policy's GPU: actor, reference, engine, and a colocated critic; a separate
critic's GPU; in the pipeline modes a rollout GPU; a reward model's own GPU), in GiB per
component, then the verdict:
"fits with X% headroom", or "does NOT fit" and the first layout of `suggest`'s ladder that
does (cheapest first: checkpointing and smaller micro-batches, LoRA, cpu_offload, then more
GPUs, up to the ``--gpus`` there are), as ``--set`` assignments.

`parse_gpu_memory` reads ``--gpu-memory``: "80GB", "80GiB", "80G" or "80" are 80 GiB (GPU
makers' GB are binary: an "80 GB" H100 has 80 GiB of HBM), "40000MB"/"40000MiB" MiB.

Not here: the bytes (`memory_estimate.py`), the shapes (`memory_shapes.py`), the command line.
"""

from __future__ import annotations

import math
import re

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.memory_estimate import COMPONENTS, Estimate, GiB, estimate, layout_gpus
from avrid.ppo.setup.overrides import with_overrides

MAX_DP = 8
"""The most actor ranks `suggest` proposes without ``--gpus`` (one node of 8 GPUs)."""
SUGGESTED_LORA_RANK = 16
"""The LoRA rank `suggest` proposes (a common choice: ~0.5% of a 7B model's parameters)."""
GPU_KINDS = ("policy", "critic", "rollout", "reward_model", "reference")
"""The tables' order: `Phase.gpu`'s kinds."""
_UNITS = {"": GiB, "g": GiB, "gb": GiB, "gib": GiB, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_gpu_memory(text: str) -> int:
    """Bytes of one GPU from ``--gpu-memory`` (see the module docstring).

    Example:
        >>> parse_gpu_memory("80GB") == parse_gpu_memory("80") == 80 * 2**30
        True
        >>> parse_gpu_memory("40000MiB") == 40000 * 2**20
        True
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--gpu-memory: {text!r} is not a size; allowed: a positive number "
                         f"with GB, GiB, G, MB, MiB or TB (GB = GiB), e.g. 80GB, 80GiB or 80")
    return int(float(match.group(1)) * _UNITS[unit])


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def table(est: Estimate, gpu: str) -> list[str]:
    """The rows of one GPU kind: a phase per row, a component per column, in GiB (MiB where
    every phase's peak is under 1 GiB: a CPU run's tiny model would read all 0.00)."""
    cols = [c for c in COMPONENTS if any(p.parts[c] for p in est.phases if p.gpu == gpu)]
    width = max(len(p.name) for p in est.phases) + 2
    small = max(p.peak for p in est.phases if p.gpu == gpu) < GiB
    unit, scale = ("MiB", 1 << 20) if small else ("GiB", GiB)
    head = (f"{f'phase ({unit})':<{width}}" + "".join(f"{c:>9}" for c in cols)
            + f"{'PEAK':>9}")
    lines = [head]
    for p in est.phases:
        if p.gpu == gpu:
            lines.append(f"{p.name:<{width}}"
                         + "".join(f"{p.parts[c] / scale:>9.2f}" for c in cols)
                         + f"{p.peak / scale:>9.2f}")
    return lines


def verdict(est: Estimate, gpu_bytes: int, gpus: int | None = None) -> tuple[bool, str]:
    """(fits, one line) for the worst phase of every GPU kind, and (with `gpus`) whether the
    layout's GPUs are there at all."""
    needed = sum(est.gpus.values())
    if gpus is not None and needed > gpus:
        return False, (f"does NOT fit: the layout takes {needed} GPUs "
                       f"({_count(est)}), --gpus gives {gpus}")
    peak = est.peak()
    worst = max(est.phases, key=lambda p: p.peak)
    if peak <= gpu_bytes:
        return True, (f"fits with {100 * (1 - peak / gpu_bytes):.0f}% headroom (peak "
                      f"{_gib(peak)} GiB of {_gib(gpu_bytes)} GiB, in {worst.gpu} "
                      f"{worst.name})")
    return False, (f"does NOT fit: {worst.gpu} {worst.name} needs {_gib(peak)} GiB of "
                   f"{_gib(gpu_bytes)} GiB")


def _ladder(config: PPOConfig, gpus: int | None) -> list[list[str]]:
    """Layouts to try, in order of what they cost (the first that fits is suggested):

    1. activation checkpointing, then smaller micro-batches: the same run, with some
       recompute and smaller kernels (a few % to ~30% slower steps);
    2. LoRA (`SUGGESTED_LORA_RANK`; not for a run already on it): faster steps and far less
       state, but it trains adapters, not the whole policy: a different run, so after 1;
    3. cpu_offload: the same result, but every step moves the state over PCIe and AdamW
       steps on the CPU (several times slower);
    4. more GPUs (actor_dp doubled, up to `gpus` in all, or `MAX_DP` ranks without it):
       hardware, the dearest knob, and only where there are GPUs to spare.
    """
    p, t = config.placement, config.train
    limit = MAX_DP if gpus is None else gpus
    dps = [d for d in (1, 2, 4, 8, 16, 32, 64) if d == p.actor_dp or (
        d > p.actor_dp and (d <= limit if gpus is None else _needed(config, d) <= gpus))]
    seq = config.rollout.max_prompt_tokens + (config.rollout.max_response_tokens or 256)
    mbts = [m for m in (t.micro_batch_tokens, t.micro_batch_tokens // 2,
                        t.micro_batch_tokens // 4) if m >= seq] or [t.micro_batch_tokens]
    loras = [False] if config.lora.enabled else [False, True]
    knobs = [(lora, False) for lora in loras] + [(lora, True) for lora in loras]
    out = []
    for dp in dps:
        for lora, offload in knobs:
            for mbt in mbts:
                sets = [] if config.checkpoints_activations else [
                    "train.gradient_checkpointing=true"]
                if mbt != t.micro_batch_tokens:
                    sets.append(f"train.micro_batch_tokens={mbt}")
                if lora:
                    sets.append(f"lora.rank={SUGGESTED_LORA_RANK}")
                if offload:
                    sets.append("memory.cpu_offload=true")
                if dp != p.actor_dp:
                    sets.append(f"placement.actor_dp={dp}")
                    if config.algo.uses_critic:  # its own ranks, sharded alike
                        sets.append(f"placement.critic_dp={dp}")
                out.append(sets)
    return out


def _needed(config: PPOConfig, actor_dp: int) -> float:
    """GPUs the layout takes with `actor_dp` actor ranks (a critic's ranks alike; a rollout
    pool as configured, or as many as the actor's)."""
    sets = [f"placement.actor_dp={actor_dp}"]
    if config.algo.uses_critic:
        sets.append(f"placement.critic_dp={actor_dp}")
    try:
        return sum(layout_gpus(with_overrides(config, sets)).values())
    except ValueError:  # a layout the config refuses: never proposed
        return math.inf


def suggest(config: PPOConfig, gpu_bytes: int, gpus: int | None = None, *,
            lora: bool | None = None) -> tuple[list[str], Estimate] | None:
    """The first layout of the ladder whose estimate fits `gpu_bytes` on at most `gpus` GPUs
    (its ``--set`` assignments and estimate), or None. `lora`: only layouts that add LoRA
    (True) or only those that do not (False: the same run as configured)."""
    for sets in _ladder(config, gpus):
        adds_lora = any(s.startswith("lora.rank=") for s in sets)
        if lora is not None and adds_lora != lora:
            continue
        try:
            candidate = with_overrides(config, sets)
        except ValueError:  # a combination the config refuses (e.g. vLLM's TP rules)
            continue
        est = estimate(candidate, gpu_bytes=gpu_bytes)
        if verdict(est, gpu_bytes, gpus)[0]:
            return sets, est
    return None


def _suggestions(config: PPOConfig, gpu_bytes: int, gpus: int | None
                 ) -> list[tuple[str, list[str], Estimate]]:
    """What `report` proposes when a layout does not fit: the cheapest layout that trains
    the same run (no LoRA added), and, for a full fine-tune, the cheapest with LoRA (a
    different run: a user choosing between offload's slower steps and adapters wants both),
    the same run first."""
    found = []
    for lora, label in ((False, ""), (True, ", trains LoRA adapters instead: a different run")):
        if lora and config.lora.enabled:
            continue
        hit = suggest(config, gpu_bytes, gpus, lora=lora)
        if hit is not None:
            found.append((label, *hit))
    return found


def report(config: PPOConfig, gpu_bytes: int, *, label: str = "",
           gpus: int | None = None) -> str:
    """The whole `--estimate-memory` output for `config` on GPUs of `gpu_bytes` each, and
    (``--gpus``) `gpus` of them."""
    est = estimate(config, gpu_bytes=gpu_bytes)
    lines = [_describe(config, est, gpu_bytes, label, gpus)]
    for gpu in GPU_KINDS:
        if any(p.gpu == gpu for p in est.phases):
            where = ("GPU" if config.placement.device == "cuda"
                     else "rank (placement.device=cpu: host memory)")
            lines += ["", f"per {where}: {gpu} rank (one of {est.gpus.get(gpu, 1)})"]
            lines += table(est, gpu)
    lines += [f"note: {n}" for n in est.notes]
    fits, line = verdict(est, gpu_bytes, gpus)
    lines += ["", line]
    if not fits:
        found = _suggestions(config, gpu_bytes, gpus)
        if not found:
            most = f"{gpus} GPUs" if gpus is not None else f"actor_dp={MAX_DP}"
            lines.append(f"  no layout up to {most} with checkpointing, smaller micro-batches, "
                         f"LoRA and cpu_offload fits: try more or larger GPUs")
        for label, sets, better in found:
            _, ok = verdict(better, gpu_bytes, gpus)
            lines.append(f"  try ({_count(better)}{label}): "
                         + " ".join(f"--set {s}" for s in sets) + f"  -> {ok}")
    return "\n".join(lines) + "\n"


def _count(est: Estimate) -> str:
    """"4 policy + 4 rollout GPUs"-style count of the layout's GPUs."""
    plural = "s" if sum(est.gpus.values()) > 1 else ""
    return " + ".join(f"{n} {kind}" for kind, n in est.gpus.items()) + f" GPU{plural}"


def _describe(config: PPOConfig, est: Estimate, gpu_bytes: int, label: str,
              gpus: int | None) -> str:
    s, w, m, t = est.policy, est.workload, config.model, config.train
    layout = "packed" if config.memory.pack_sequences else "padded"
    total = sum(est.gpus.values())
    given = "" if gpus is None else f" (--gpus {gpus})"
    lora = config.lora
    return "\n".join([
        f"memory estimate{' of ' + label if label else ''}: {s.params / 1e6:.1f}M parameters "
        f"(hidden {s.hidden}, {s.layers} layers, {s.heads}/{s.kv_heads} heads, vocab "
        f"{s.vocab}{', tied head' if s.tied else ''}; shape from {s.source})",
        f"  {total} {'GPU' if config.placement.device == 'cuda' else 'CPU rank'}(s) of "
        f"{_gib(gpu_bytes)} GiB{given}: {_count(est)}; pipeline {config.pipeline.mode}; "
        f"actor_dp={config.placement.actor_dp}, {m.dtype} compute (fp32 masters + AdamW), "
        f"attention {est.attention}, checkpointing "
        f"{'on' if config.checkpoints_activations else 'off'}, "
        f"cpu_offload {'on' if config.memory.cpu_offload else 'off'}, "
        f"LoRA {f'rank {lora.rank} ({lora.target_modules})' if lora.enabled else 'off'}",
        f"  micro-batch: {layout}, {w.tokens} tokens computed in {w.rows} rows "
        f"(micro_batch_tokens {t.micro_batch_tokens}), {w.response_tokens} response "
        f"positions, log-prob chunk {config.memory.logprob_chunk}; engine "
        f"{config.rollout.engine}, {w.gen_rows} sequences of <= {w.gen_len} tokens per rank",
    ])


def headroom(est: Estimate, gpu_bytes: int) -> float:
    """The fraction of a GPU left at the worst phase (negative: over)."""
    return 1.0 - est.peak() / gpu_bytes if gpu_bytes > 0 else -math.inf
