"""Benchmark — what a seed on every request costs vLLM: `VllmEngine`'s ``seed_mode="request"``
(one torch.Generator per request, vLLM samples the batch row by row) against ``"batch"`` (the
call seeds vLLM's sampler once; the whole batch in one draw).

Needs the vLLM environment (``make vllm-setup``; run with ``.venv-vllm/bin/python``): it runs
vLLM's CPU build here, its CUDA build where that is installed.

One tiny random Qwen2 (``--hidden`` wide, 2 layers, heads of 64, vocab ``--vocab``) in one
engine; ``--prompts`` prompts of 8-24 random tokens, ``--new-tokens`` sampled tokens each
(temperature 1, no stop token: every row runs to the cap, both modes generate the same number
of tokens). Per repeat each mode generates once, the order swapped every repeat, after an
untimed warm-up of each; tokens/s = generated tokens / wall time (prefill included; the prompts
are short, so it is mostly decoding); medians over repeats, side by side, and the ratio.

Run: ``.venv-vllm/bin/python benchmarks/vllm_seeds.py [--repeats 5] [--prompts 128]
[--new-tokens 48] [--hidden 128] [--vocab 32000]``. It always exits 0: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.engines.torch_engine import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    from avrid.ppo.engines.vllm_engine import VllmEngine

    spec = TinyModelSpec(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_layers=2,
                         num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64,
                         max_positions=256)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, args.vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 25, (args.prompts,), generator=gen)]
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_policy(spec, seed=0, pad_token_id=0).save_pretrained(Path(tmp))
        engine = VllmEngine(tmp, max_model_len=128, seed=0, dtype="float32",
                            max_num_seqs=args.prompts)
        rates: dict[str, list[float]] = {"request": [], "batch": []}
        try:
            for mode in rates:  # warm-up: first-call costs out of the timings
                engine.seed_mode = mode
                engine.generate(prompts, params)
            for r in range(args.repeats):
                for mode in (("request", "batch") if r % 2 == 0 else ("batch", "request")):
                    engine.seed_mode = mode
                    start = time.perf_counter()
                    done = engine.generate(prompts, params)
                    seconds = time.perf_counter() - start
                    rates[mode].append(sum(len(c.token_ids) for c in done) / seconds)
        finally:
            engine.close()
    request, batch = (statistics.median(rates[m]) for m in ("request", "batch"))
    print(f"vLLM sampling seeds: {args.prompts} prompts x {args.new_tokens} new tokens, "
          f"hidden {args.hidden}, vocab {args.vocab}, {torch.get_num_threads()} threads, "
          f"medians of {args.repeats}")
    print(f"  {'seed_mode':<10}{'tokens/s':>10}   runs")
    for mode, median in (("request", request), ("batch", batch)):
        runs = " ".join(f"{x:.0f}" for x in rates[mode])
        print(f"  {mode:<10}{median:>10.0f}   {runs}")
    print(f"  batch / request: {batch / request:.2f}x")


if __name__ == "__main__":
    main()
