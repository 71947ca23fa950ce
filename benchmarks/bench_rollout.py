"""Benchmark — rollout on CPU: vLLM (its CPU build) against avrid's TorchEngine, and the cost
of one weight sync into vLLM against the bytes it moves.

Needs the vLLM environment (``make vllm-setup``; run with ``.venv-vllm/bin/python``).

Throughput: one tiny random Qwen2 (``--hidden`` wide, ``--layers`` deep, heads of 64, vocab
``--vocab``) saved to a temporary directory; both engines hold the same fp32 weights and get the
same ``--prompts`` prompts of 8-40 random tokens and sample ``--new-tokens`` tokens each
(temperature 1, no stop token, so every row runs to the cap and both generate exactly the same
number of tokens). Per repeat each engine generates once, the order swapped every repeat,
after one untimed warm-up each; tokens/s = generated tokens / wall time, medians over repeats,
and the ratio vLLM / torch. The torch engine runs in this process with the same thread count.

Weight sync: `VllmEngine.load_weights` (vLLM's in-place reload: fuse q/k/v and gate/up, then
re-pack every linear layer for the CPU kernels, then a prefix-cache reset) for models of
growing width, then the fingerprint read-back the PPO loop does after every sync
(`VllmEngine.checksums`); medians over repeats, beside the bytes loaded and the rate.

Run: ``.venv-vllm/bin/python benchmarks/bench_rollout.py [--repeats 5] [--prompts 64]
[--new-tokens 32] [--hidden 256] [--layers 2]``. It always exits 0: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.engines.torch_engine import SamplingParams, TorchEngine
from avrid.reshard import ModelLayout


def spec_for(hidden: int, layers: int, vocab: int) -> TinyModelSpec:
    return TinyModelSpec(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_layers=layers, num_heads=hidden // 64, num_kv_heads=hidden // 64,
                         max_positions=512)


def throughput(args: argparse.Namespace, root: Path) -> None:
    from avrid.ppo.engines.vllm_engine import VllmEngine

    spec = spec_for(args.hidden, args.layers, args.vocab)
    policy = build_tiny_policy(spec, seed=0, pad_token_id=0)
    policy.save_pretrained(root / "tp")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, args.vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 41, (args.prompts,), generator=gen)]
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=1)
    torch_engine = TorchEngine(policy, pad_token_id=0)
    vllm_engine = VllmEngine(str(root / "tp"), max_model_len=128, dtype="float32")
    engines = {"vllm": vllm_engine.generate, "torch": torch_engine.generate}
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for run in engines.values():  # warm-up, untimed
            run(prompts, params)
        for rep in range(args.repeats):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            for name in order:
                t = time.perf_counter()
                done = engines[name](prompts, params)
                times[name].append(time.perf_counter() - t)
                assert sum(len(c.token_ids) for c in done) == args.prompts * args.new_tokens
    finally:
        vllm_engine.close()
    tokens = args.prompts * args.new_tokens
    rate = {n: tokens / statistics.median(ts) for n, ts in times.items()}
    print(f"rollout: {args.prompts} prompts x {args.new_tokens} new tokens, model hidden "
          f"{args.hidden} x {args.layers} layers, fp32, {torch.get_num_threads()} threads")
    for name in engines:
        print(f"  {name:6s} {rate[name]:9.0f} tokens/s   (median of {args.repeats}: "
              f"{statistics.median(times[name]):.3f} s)")
    print(f"  vllm / torch: {rate['vllm'] / rate['torch']:.2f}x")


def sync_cost(args: argparse.Namespace, root: Path) -> None:
    from avrid.ppo.engines.vllm_engine import VllmEngine

    print("weight sync into vLLM (load_weights = reload + re-pack + prefix reset; then the "
          "fingerprint read-back):")
    print(f"  {'hidden':>6s} {'MB':>8s} {'load s':>8s} {'MB/s':>8s} {'check s':>8s}")
    for hidden in args.sync_hidden:
        spec = spec_for(hidden, args.layers, args.vocab)
        policy = build_tiny_policy(spec, seed=0, pad_token_id=0)
        path = root / f"sync{hidden}"
        policy.config.save_pretrained(path)
        weights = {n: p.detach() for n, p in policy.named_parameters()}
        nbytes = sum(t.nbytes for t in weights.values())
        layout = ModelLayout.fsdp({n: (tuple(t.shape), t.dtype) for n, t in weights.items()},
                                  1)
        engine = VllmEngine(str(path), max_model_len=128, dtype="float32",
                            load_format="dummy")
        loads, checks = [], []
        try:
            engine.load_weights(weights.items())  # warm-up
            for _ in range(args.repeats):
                t = time.perf_counter()
                engine.load_weights(weights.items())
                loads.append(time.perf_counter() - t)
                t = time.perf_counter()
                engine.checksums(layout)
                checks.append(time.perf_counter() - t)
        finally:
            engine.close()
        load = statistics.median(loads)
        print(f"  {hidden:6d} {nbytes / 1e6:8.1f} {load:8.3f} {nbytes / 1e6 / load:8.0f} "
              f"{statistics.median(checks):8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--sync-hidden", type=int, nargs="+", default=[128, 256, 512, 1024])
    args = parser.parse_args()
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # `make bench` runs every script in .venv
        print("bench_rollout: needs vllm; run it with .venv-vllm/bin/python (make vllm-setup)")
        return
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        throughput(args, Path(tmp))
        sync_cost(args, Path(tmp))


if __name__ == "__main__":
    main()
