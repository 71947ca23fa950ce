"""Issue 30: a LoRA weight sync into vLLM, adapters only (`lora.sync=adapter`) vs the merged
weights (`lora.sync=merged`), side by side in one run.

Both syncs run the code a policy rank runs (one rank here, so nothing crosses a wire): the
adapter sync is `AdapterSync.run` (cast, serve from memory under a new id, read the LoRA
kernels back, fingerprint); the merged sync is `lora.merged_local_shards` (W + (alpha / r) B A
for every adapted weight) then `WeightSync.run` (stream group by group into vLLM's reload,
read the CPU kernels back, fingerprint). Each sync follows a change of B, as after an update.
The model is a Qwen2-shaped decoder whose rank-8 adapters on every linear layer are about
1 % of the weights. vLLM allows one engine per process, so the two kinds alternate in rounds:
a LoRA engine (base loaded once, then adapter syncs), then a plain one (merged syncs).

Prints bytes loaded into the engine per sync and wall time per sync (medians over rounds x
repeats) and their ratios. Needs vLLM (`make vllm-setup`):

    .venv-vllm/bin/python benchmarks/lora_sync.py [--hidden 1024 --layers 4 --vocab 8192
        --rank 8 --rounds 3 --repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy  # noqa: E402
from avrid.ppo.roles import fsdp, lora  # noqa: E402
from avrid.ppo.roles.adapter_sync import AdapterSync  # noqa: E402
from avrid.ppo.roles.weight_sync import WeightSync  # noqa: E402
from avrid.ppo.setup.lora import LoraConfig  # noqa: E402

F32 = torch.float32


def touch_adapters(model: torch.nn.Module, gen: torch.Generator) -> None:
    """A stand-in for an optimizer step: every B moves a little."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


def adapter_round(path: Path, adapted: torch.nn.Module, rank: int, repeats: int,
                  gen: torch.Generator) -> tuple[list[float], int, float]:
    """(seconds per adapter sync, engine bytes per sync, seconds of the one base load)."""
    from avrid.ppo.engines.vllm_engine import VllmEngine

    engine = VllmEngine(str(path), max_model_len=256, dtype="float32", lora_rank=rank)
    try:
        shards = fsdp.local_shards(adapted)
        base = WeightSync(lora.base_local_shards(shards), lora.served_shapes(adapted), rank=0,
                          world_size=1, engine_dtype=F32)
        t = time.perf_counter()
        base.run(lora.base_local_shards(shards), engine.sink, None)
        base_s = time.perf_counter() - t
        sync = AdapterSync(adapted, rank=0, engine_dtype=F32)
        times, size = [], 0
        for version in range(repeats):
            touch_adapters(adapted, gen)
            t = time.perf_counter()
            report = sync.run(adapted, engine, version=version)
            times.append(time.perf_counter() - t)
            size = report.engine_bytes
        return times, size, base_s
    finally:
        engine.close()


def merged_round(path: Path, adapted: torch.nn.Module, repeats: int,
                 gen: torch.Generator) -> tuple[list[float], int]:
    """(seconds per merged sync, merge included; engine bytes per sync)."""
    from avrid.ppo.engines.vllm_engine import VllmEngine

    engine = VllmEngine(str(path), max_model_len=256, dtype="float32")
    try:
        sync = WeightSync(lora.merged_local_shards(adapted, fsdp.local_shards(adapted)),
                          lora.served_shapes(adapted), rank=0, world_size=1, engine_dtype=F32)
        times, size = [], 0
        for _ in range(repeats):
            touch_adapters(adapted, gen)
            t = time.perf_counter()
            merged = lora.merged_local_shards(adapted, fsdp.local_shards(adapted))
            report = sync.run(merged, engine.sink, None)
            times.append(time.perf_counter() - t)
            size = report.engine_bytes
        return times, size
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    spec = TinyModelSpec(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_layers=args.layers,
                         num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
                         max_positions=256)
    base = build_tiny_policy(spec, seed=0, pad_token_id=0)
    adapted = lora.attach(copy.deepcopy(base), LoraConfig(rank=args.rank), seed=1).eval()
    gen = torch.Generator().manual_seed(2)
    touch_adapters(adapted, gen)
    total = sum(p.numel() for n, p in adapted.named_parameters() if not lora.is_adapter(n))
    adapters = sum(p.numel() for n, p in adapted.named_parameters() if lora.is_adapter(n))
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
          f"{total / 1e6:.1f} M weights; rank-{args.rank} adapters on every linear layer: "
          f"{adapters / 1e6:.3f} M ({100 * adapters / total:.2f} %)")

    with tempfile.TemporaryDirectory(prefix="avrid-lora-bench-") as tmp:
        path = Path(tmp) / "base"
        base.save_pretrained(path)
        adapter_s: list[float] = []
        merged_s: list[float] = []
        base_loads: list[float] = []
        for r in range(args.rounds):
            times, adapter_bytes, base_s = adapter_round(path, adapted, args.rank,
                                                         args.repeats, gen)
            adapter_s += times
            base_loads.append(base_s)
            times, merged_bytes = merged_round(path, adapted, args.repeats, gen)
            merged_s += times
            last = slice(-args.repeats, None)
            print(f"round {r}: adapter sync median {statistics.median(adapter_s[last]):.4f} s, "
                  f"merged sync median {statistics.median(merged_s[last]):.4f} s")

    a, m = statistics.median(adapter_s), statistics.median(merged_s)
    print()
    print("| sync | bytes into the engine per sync | wall time per sync (median) |")
    print("|---|---|---|")
    print(f"| adapter (`lora.sync=adapter`) | {adapter_bytes / 2**20:.2f} MiB | {a * 1e3:.1f} ms |")
    print(f"| merged (`lora.sync=merged`) | {merged_bytes / 2**20:.2f} MiB | {m * 1e3:.1f} ms |")
    print(f"| base, once per run (adapter mode) | {merged_bytes / 2**20:.2f} MiB | "
          f"{statistics.median(base_loads) * 1e3:.1f} ms |")
    print()
    print(f"bytes adapter / merged = {adapter_bytes / merged_bytes:.4f} (target < 0.05)")
    print(f"time  adapter / merged = {a / m:.3f}  (merged / adapter = {m / a:.1f}x)")


if __name__ == "__main__":
    main()
