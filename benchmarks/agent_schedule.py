"""Issue 31: the engine's busy share over multi-turn episodes whose tools take 0-200 ms,
scheduled per trajectory vs turn-synchronous, side by side in one run.

Chapter 7's episode loop (`avrid.agents.episodes.run_episodes`) on a `TorchEngine` holding a
tiny random Qwen2 policy. Each of N episodes runs M policy turns of exactly `turn_tokens`
tokens (greedy, no stop ids, so every turn has its length and every episode its turns); after
each turn the environment's tool sleeps a random 0-200 ms, drawn from (seed, episode, turn),
so both schedules wait for the same tools, then answers a few ids. Tools run on a pool of
`--tool-threads` threads (64 by default: a sleeping tool takes no CPU, so all of them may
overlap without slowing the engine).

- `turn_sync`: one engine call per turn for the whole batch; every episode then waits for
  the slowest tool of the turn (about 200 ms of 64 draws) before the next call.
- `per_trajectory`: an episode goes back to the engine as soon as its tool answers; each
  call generates for whoever is ready.

The schedules alternate for R rounds (these machines are noisy). Per round and as medians it
prints wall time, engine busy time (inside `generate`), busy share = busy / wall, engine
calls, policy tokens per second of wall time and of busy time; then busy share
per_trajectory / turn_sync (target >= 1.5 by default: exit 1 below it) and the wall-time
speedup. It also checks that both schedules made identical episodes (greedy: the same ids),
since a schedule decides which episodes share a call, never what an episode is (exit 1 if
not).

Note: per_trajectory makes more, smaller calls, so its engine time per token is higher; the
busy share counts the engine's time, tokens/s of wall time the work done, and engine
tokens/s (tokens / busy time) what a busy second yields. All three are printed.

    python benchmarks/agent_schedule.py [--episodes 64 --turns 4 --turn-tokens 12 --hidden 128
        --layers 2 --rounds 3 --target 1.5]

Not a timed test: it measures; only the target and the identity check set the exit code.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from avrid.agents.env import EpisodeLimits, StepResult  # noqa: E402
from avrid.agents.episodes import SCHEDULES, LoopStats, run_episodes  # noqa: E402
from avrid.agents.trajectory import Trajectory  # noqa: E402
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy  # noqa: E402
from avrid.ppo.engines.torch_engine import SamplingParams, TorchEngine  # noqa: E402

PAD = 0
PROMPT_LEN, OBS_LEN = 6, 3


class IdTokenizer:
    """Observations are ids (the episode loop takes them in range(`vocab_size`)); `decode`
    only gives the environment its text view."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    encode_text = encode  # observations and stops as they are (no template here)

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))


class SleepyToolEnv:
    """One episode: a fixed prompt; each step is a tool that sleeps a seeded random time
    in [0, max_tool_s) and answers `OBS_LEN` ids; done after `turns` policy turns."""

    def __init__(self, index: int, *, seed: int, turns: int, vocab: int,
                 max_tool_s: float) -> None:
        self.index, self.seed, self.turns, self.vocab = index, seed, turns, vocab
        self.max_tool_s = max_tool_s
        self.steps = 0
        self.slept = 0.0

    def _rng(self, turn: int) -> random.Random:
        # (seed, episode, turn) fixes a draw, whichever thread or schedule runs it.
        return random.Random(f"{self.seed}/{self.index}/{turn}")

    def reset(self) -> list[int]:
        rng = self._rng(-1)
        return [rng.randrange(1, self.vocab) for _ in range(PROMPT_LEN)]

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        rng = self._rng(self.steps)
        self.steps += 1
        delay = rng.random() * self.max_tool_s
        time.sleep(delay)
        self.slept += delay
        if self.steps >= self.turns:
            return StepResult(observation=[], reward=1.0, done=True, tool_calls=1,
                              tool_seconds=delay)
        return StepResult(observation=[rng.randrange(1, self.vocab) for _ in range(OBS_LEN)],
                          tool_calls=1, tool_seconds=delay)


def run_once(engine: TorchEngine, schedule: str, args: argparse.Namespace,
             limits: EpisodeLimits) -> tuple[list[Trajectory], LoopStats, float]:
    """One rollout of all episodes under `schedule`: (trajectories, stats, summed tool s)."""
    envs = [SleepyToolEnv(i, seed=args.seed, turns=args.turns, vocab=args.vocab,
                          max_tool_s=args.max_tool_ms / 1e3) for i in range(args.episodes)]
    params = SamplingParams(max_new_tokens=1, greedy=True, stop_token_ids=(), seed=args.seed)
    trajs, stats = run_episodes(engine, envs, tokenizer=IdTokenizer(args.vocab), limits=limits,
                                params=params, schedule=schedule,  # type: ignore[arg-type]
                                tool_threads=args.tool_threads)
    return trajs, stats, sum(e.slept for e in envs)


def policy_tokens(trajs: Sequence[Trajectory]) -> int:
    """Tokens the engine generated (the action mask's ones)."""
    return sum(sum(t.action) for t in trajs)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4, help="policy turns per episode")
    ap.add_argument("--turn-tokens", type=int, default=12, help="tokens per policy turn")
    ap.add_argument("--max-tool-ms", type=float, default=200.0,
                    help="each tool sleeps uniform [0, this) ms")
    ap.add_argument("--tool-threads", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="the engine's intra-op threads (1: on a shared 2-core machine, "
                         "two OpenMP threads stall each other whenever another process runs)")
    ap.add_argument("--target", type=float, default=1.5,
                    help="least median busy-share ratio per_trajectory / turn_sync")
    args = ap.parse_args(argv)
    for name in ("episodes", "turns", "turn_tokens", "tool_threads", "hidden", "layers",
                 "rounds", "torch_threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab < 2:
        ap.error(f"--vocab must be >= 2 (id 0 is padding), got {args.vocab}")
    if args.hidden % 64:
        ap.error(f"--hidden must be a multiple of 64 (heads of 64), got {args.hidden}")
    if not args.max_tool_ms >= 0:
        ap.error(f"--max-tool-ms must be >= 0, got {args.max_tool_ms}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    max_tokens = args.turns * (args.turn_tokens + OBS_LEN)
    limits = EpisodeLimits(max_turns=args.turns, turn_tokens=args.turn_tokens,
                           max_tokens=max_tokens)
    spec = TinyModelSpec(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_layers=args.layers,
                         num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64,
                         max_positions=PROMPT_LEN + max_tokens + 8)
    engine = TorchEngine(build_tiny_policy(spec, seed=args.seed, pad_token_id=PAD),
                         pad_token_id=PAD)
    print(f"policy: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"{args.episodes} episodes x {args.turns} turns x {args.turn_tokens} tokens; tools "
          f"sleep U[0, {args.max_tool_ms:g}) ms on {args.tool_threads} threads; "
          f"torch threads {torch.get_num_threads()}")
    t = time.perf_counter()  # warm-up: the first calls pay for allocation
    engine.generate([[1] * PROMPT_LEN] * args.episodes,
                    SamplingParams(max_new_tokens=args.turn_tokens, greedy=True))
    one_call = time.perf_counter() - t
    print(f"warm-up: one call of {args.episodes} rows x {args.turn_tokens} tokens took "
          f"{one_call * 1e3:.0f} ms")
    slowest = statistics.mean(
        max(SleepyToolEnv(i, seed=args.seed, turns=args.turns, vocab=args.vocab,
                          max_tool_s=args.max_tool_ms)._rng(turn).random() * args.max_tool_ms
            for i in range(args.episodes))
        for turn in range(args.turns))
    print(f"turn_sync waits {slowest:.0f} ms a turn on average for its slowest tool: with "
          f"calls of G ms its busy share is about G / (G + {slowest:.0f})")

    rows: dict[str, list[tuple[float, ...]]] = {s: [] for s in SCHEDULES}
    identical = True
    print("\n| round | schedule | wall s | engine busy s | busy share | engine calls | "
          "tokens/s | engine tokens/s | tool s (sum) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        made: dict[str, list[Trajectory]] = {}
        # Alternate which schedule goes first, so neither always runs on a warmer machine.
        order = SCHEDULES if r % 2 == 0 else tuple(reversed(SCHEDULES))
        for schedule in order:
            trajs, stats, slept = run_once(engine, schedule, args, limits)
            made[schedule] = trajs
            tokens = policy_tokens(trajs)
            tps, engine_tps = tokens / stats.wall_s, tokens / stats.busy_s
            rows[schedule].append((stats.wall_s, stats.busy_s, stats.busy_share,
                                   stats.engine_calls, tps, engine_tps))
            print(f"| {r} | {schedule} | {stats.wall_s:.3f} | {stats.busy_s:.3f} | "
                  f"{stats.busy_share:.3f} | {stats.engine_calls} | {tps:.0f} | "
                  f"{engine_tps:.0f} | {slept:.2f} |")
        a, b = made["per_trajectory"], made["turn_sync"]
        same = [x.ids for x in a] == [y.ids for y in b] and \
            [(x.prompt, x.action, x.done) for x in a] == [(y.prompt, y.action, y.done) for y in b]
        expected = args.turns * args.turn_tokens
        complete = all(sum(t.action) == expected and t.done for t in a + b)
        identical &= same and complete
        if not (same and complete):
            print(f"round {r}: episodes differ between schedules (same ids: {same}; every "
                  f"episode {args.turns} whole turns: {complete})")

    med = {s: [statistics.median(col) for col in zip(*rows[s], strict=True)]
           for s in SCHEDULES}
    print("\n| schedule (median of rounds) | wall s | engine busy s | busy share | "
          "engine calls | tokens/s | engine tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in SCHEDULES:
        w, busy, share, calls, tps, engine_tps = med[s]
        print(f"| {s} | {w:.3f} | {busy:.3f} | {share:.3f} | {calls:.0f} | {tps:.0f} | "
              f"{engine_tps:.0f} |")
    ratios = [p[2] / t[2] for p, t in zip(rows["per_trajectory"], rows["turn_sync"],
                                          strict=True)]
    speedups = [t[0] / p[0] for p, t in zip(rows["per_trajectory"], rows["turn_sync"],
                                            strict=True)]
    ratio, speedup = statistics.median(ratios), statistics.median(speedups)
    print(f"\nbusy share per_trajectory / turn_sync: median {ratio:.2f}x "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}; target >= {args.target:g}x)")
    print(f"wall time turn_sync / per_trajectory:  median {speedup:.2f}x "
          f"(rounds: {', '.join(f'{x:.2f}' for x in speedups)})")
    print(f"identical episodes under both schedules (greedy ids, masks, done): "
          f"{'yes' if identical else 'NO'}")
    ok = ratio >= args.target and identical
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
