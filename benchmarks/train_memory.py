"""Benchmark — the trainer's peak memory, today's padded full-logits forward vs packed+chunked.

Issue 28: a micro-batch right-padded to its longest row computes n x longest tokens, and the
log-probs were taken from (n, L, vocab) logits, gathered to (n, T, vocab), then copied to
fp32 twice more. The training path now runs one packed row of the real tokens
(`columns.packed_inputs`) and projects hidden states to the vocabulary over the response
positions only, `--chunk` at a time (`logprobs.chunked_logprobs`, checkpointed under grad).

What runs: a tiny random Qwen2 (hidden 64, 2 layers, eager attention as the trainer builds
it) with a 32k and a 152k vocabulary; a length-skewed micro-batch (8 samples of 16 prompt
tokens, 6 responses of 16 tokens and 2 long ones of S tokens, S at two sizes). Per config
and path, ONE child process (``MALLOC_MMAP_THRESHOLD_=1048576``: freed buffers go back to
the OS instead of staying resident) runs the old-log-prob pass (no grad, with the entropy
metric, as `PolicyWorker.compute_logprobs`) and then one PPO update (forward, policy loss,
backward, AdamW step). Each phase's peak is the child's resident high-water mark (VmHWM,
reset through /proc/self/clear_refs before the phase) minus its resident size when the phase
began: the memory the phase added. Medians over `--repeats` runs.

"today" is `padded_logprobs` below: the code of c30d38c's `forward.response_logprobs`
(right-padded inputs, full logits, gather, `logprobs_from_logits`, `entropy_from_logits`)
kept here as the reference. "chunked" is the trainer's `forward.response_logprobs` on the
right-padded inputs (`memory.pack_sequences=false`); "packed" the same on
`columns.packed_inputs`, the trainer's default layout.

Also printed: tokens computed / real tokens (packed: the real tokens, exactly; padded:
n x longest), and each path's logits model — n x L x vocab x 4 bytes today against
chunk x vocab x 4 bytes packed — so the growth can be read against it.

Run: ``.venv/bin/python benchmarks/train_memory.py [--repeats 3] [--chunk 128]``. CPU only,
about 4.5 minutes on 2 cores. It always exits 0: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

VOCABS = (32_000, 151_936)  # a 32k vocabulary and Qwen2.5's
LONG = (64, 128)  # the two long responses' lengths, two sizes
N_SAMPLES, PROMPT, SHORT = 8, 16, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--child", nargs=3, metavar=("PATH", "VOCAB", "LONG"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, vocab, long = args.child
        print(json.dumps(measure(path, int(vocab), int(long), args.chunk)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_NUM_THREADS": "1"}
    print(f"peak memory a phase adds, MB (median of {args.repeats}); chunk = {args.chunk} "
          f"positions; {N_SAMPLES} samples: prompts {PROMPT}, 6 responses of {SHORT}, 2 of S")
    print(f"{'vocab':>7} {'S':>4} {'phase':>8} {'today':>8} {'chunked':>8} {'ratio':>6} "
          f"{'packed':>8} {'ratio':>6}  {'logits today':>12} {'chunk':>6}  "
          f"{'computed/real today':>19} {'packed':>6}")
    for vocab in VOCABS:
        for long in LONG:
            runs: dict[str, list[dict]] = {"padded": [], "chunked": [], "packed": []}
            for _ in range(args.repeats):
                for path in runs:
                    out = subprocess.run(
                        [sys.executable, __file__, "--chunk", str(args.chunk), "--child",
                         path, str(vocab), str(long)],
                        env=env, capture_output=True, text=True, check=True)
                    runs[path].append(json.loads(out.stdout.strip().splitlines()[-1]))
            for phase in ("logprobs", "update"):
                old, mid, new = (statistics.median(r[phase] for r in runs[p]) / 2**20
                                 for p in ("padded", "chunked", "packed"))
                pad, pack = runs["padded"][0], runs["packed"][0]
                print(f"{vocab:>7} {long:>4} {phase:>8} {old:>8.0f} {mid:>8.0f} "
                      f"{old / mid:>5.1f}x {new:>8.0f} {old / new:>5.1f}x  "
                      f"{pad['logit_bytes'] / 2**20:>10.0f}MB "
                      f"{pack['logit_bytes'] / 2**20:>4.0f}MB  "
                      f"{pad['computed'] / pad['real']:>19.2f} "
                      f"{pack['computed'] / pack['real']:>6.2f}")


def measure(path: str, vocab: int, long: int, chunk: int) -> dict:
    """In the child: one log-prob pass and one update on `path` ("padded" or "packed");
    bytes each phase added to the resident set at its peak."""
    import torch

    from avrid.dispatch import Batch
    from avrid.ppo.algo.losses import policy_loss
    from avrid.ppo.data.columns import packed_inputs, padded, padded_inputs
    from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
    from avrid.ppo.roles.forward import response_logprobs

    torch.set_num_threads(1)
    spec = TinyModelSpec(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=4,
                         max_positions=PROMPT + max(LONG) + 8)
    model = build_tiny_policy(spec, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    responses = [SHORT] * (N_SAMPLES - 2) + [long] * 2
    tokens = [torch.randint(2, vocab, (PROMPT + r,), generator=g) for r in responses]
    batch = Batch.from_rows(sample_ids=range(N_SAMPLES), prompt_lens=[PROMPT] * N_SAMPLES,
                            response_lens=responses,
                            packed={"tokens": tokens,
                                    "old_logp": [-torch.rand(r, generator=g) for r in responses],
                                    "advantages": [torch.randn(r, generator=g)
                                                   for r in responses]})
    if path == "chunked":  # the padded layout with the chunked head (pack_sequences=false)
        x = padded_inputs(batch, 0)

        def logprobs(with_entropy: bool):  # noqa: ANN202
            return response_logprobs(model, x, 1.0, with_entropy=with_entropy, chunk=chunk)
        logit_bytes = chunk * vocab * 4
    elif path == "padded":
        x = padded_inputs(batch, 0)

        def logprobs(with_entropy: bool):  # noqa: ANN202
            return padded_logprobs(model, x, 1.0, with_entropy=with_entropy)
        logit_bytes = x.input_ids.numel() * vocab * 4
    else:
        x = packed_inputs(batch, 0)

        def logprobs(with_entropy: bool):  # noqa: ANN202
            return response_logprobs(model, x, 1.0, with_entropy=with_entropy, chunk=chunk)
        logit_bytes = chunk * vocab * 4
    result = {"computed": x.input_ids.numel(), "real": int(batch.packed["tokens"].offsets[-1]),
              "logit_bytes": logit_bytes}

    start = _reset_peak()
    with torch.no_grad():
        logp, ent = logprobs(True)
    result["logprobs"] = _peak() - start
    del logp, ent

    start = _reset_peak()
    logp, _ = logprobs(False)
    mask = x.response_mask
    out = policy_loss(logp, padded(batch, "old_logp"), padded(batch, "advantages"), mask,
                      clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    ((out.per_token * mask).sum() / mask.sum()).backward()
    optimizer.step()
    result["update"] = _peak() - start
    return result


def padded_logprobs(model, x, temperature: float, *, with_entropy: bool):  # noqa: ANN001, ANN201
    """Today's (c30d38c) `forward.response_logprobs`, for the comparison: the model's
    (n, L, vocab) logits over the right-padded batch, gathered to (n, T, vocab)."""
    from avrid.ppo.algo.logprobs import entropy_from_logits, logprobs_from_logits

    logits = model(input_ids=x.input_ids, attention_mask=x.attention_mask,
                   position_ids=x.position_ids, use_cache=False).logits
    index = x.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = logits.gather(1, index)
    logp = logprobs_from_logits(picked, x.response_ids, temperature)
    entropy = entropy_from_logits(picked, temperature) if with_entropy else None
    return logp, entropy


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
