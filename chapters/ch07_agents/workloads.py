"""Chapter 7 — the small pieces the demo and the notebook run episodes with.

- `SleepyToolEnv`: an episode whose every tool call sleeps a seeded random 0-200 ms (the
  idea of `benchmarks/agent_schedule.py`, small enough for the demo), with `IdTokenizer`;
- `TimedEngine`: any engine, each `generate` call's start and end recorded (the picture of
  when the engine was busy);
- `NewWeightsEvery`: a `WeightSource` that loads new weights into the engine every few
  engine calls, as an asynchronous trainer would mid-rollout (partial rollouts);
- `glyphs`, `show_trajectory` and `behaviour_gap`: a trajectory printed token by token with
  its mask and versions, and its recorded log-probs checked against the weights of each
  token's version.

What this file is not: the episode loop or the environment protocol (`avrid.agents`). These
are the lesson's props, not library code: nothing in `avrid/` imports them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from avrid.agents.env import StepResult
from avrid.agents.trajectory import Trajectory
from avrid.ppo.algo.logprobs import logprobs_from_logits
from avrid.ppo.engines.torch_engine import Completion, SamplingParams


class IdTokenizer:
    """Observations are ids already; `decode` only gives the environment a text view. The
    episode loop takes ids in range(`vocab_size`): 17, as `SleepyToolEnv` draws them."""

    def __init__(self, vocab_size: int = 17) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    encode_text = encode  # observations and stops as they are (no template here)

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))


class SleepyToolEnv:
    """One episode: a seeded prompt of 6 ids; each step is a tool that sleeps a random time
    in [0, `max_tool_s`) drawn from (seed, episode, turn), so that every schedule waits for
    the same tools, and answers 3 ids; done after `turns` policy turns."""

    def __init__(self, index: int, *, seed: int = 0, turns: int = 3, vocab: int = 17,
                 max_tool_s: float = 0.2) -> None:
        self.index, self.seed, self.turns, self.vocab = index, seed, turns, vocab
        self.max_tool_s = max_tool_s
        self.steps = 0

    def _rng(self, turn: int) -> random.Random:
        return random.Random(f"{self.seed}/{self.index}/{turn}")

    def reset(self) -> list[int]:
        rng = self._rng(-1)
        return [rng.randrange(2, self.vocab) for _ in range(6)]

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        rng = self._rng(self.steps)
        self.steps += 1
        delay = rng.random() * self.max_tool_s
        time.sleep(delay)  # the tool: a sleeping thread takes no CPU from the engine
        if self.steps >= self.turns:
            return StepResult(observation=[], reward=1.0, done=True, tool_calls=1,
                              tool_seconds=delay)
        return StepResult(observation=[rng.randrange(2, self.vocab) for _ in range(3)],
                          tool_calls=1, tool_seconds=delay)


class TimedEngine:
    """`engine`, with each `generate` call's (start, end) in seconds since `reset()`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[float, float]] = []
        self._origin = time.perf_counter()

    def reset(self) -> None:
        """Forget the calls so far and start the clock again."""
        self.calls = []
        self._origin = time.perf_counter()

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Completion]:
        start = time.perf_counter() - self._origin
        outs = self.engine.generate(prompts, params)
        self.calls.append((start, time.perf_counter() - self._origin))
        return outs


class NewWeightsEvery:
    """A `WeightSource` whose trainer publishes new weights every `every` engine calls:
    `poll` loads them into the engine (version + 1) before the call. `make_model(v)` builds
    version v's model; `models` keeps every version, to check the log-probs against."""

    def __init__(self, engine: Any, make_model: Callable[[int], torch.nn.Module], *,
                 every: int) -> None:
        self.engine, self.make_model, self.every = engine, make_model, every
        self.models = {0: make_model(0)}
        self.version, self.polls = 0, 0
        engine.load_weights(self.models[0].state_dict().items())

    def poll(self) -> int:
        if self.polls and self.polls % self.every == 0:
            self.version += 1
            self.models[self.version] = self.make_model(self.version)
            self.engine.load_weights(self.models[self.version].state_dict().items())
        self.polls += 1
        return self.version


def glyphs(tokenizer: Any) -> Callable[[int], str]:
    """One character per token id of a character tokenizer: its text, "$" for EOS and "_"
    for the pad id (a random policy samples it now and then: it is a token like any other)."""
    special = {tokenizer.eos_token_id: "$", tokenizer.pad_token_id: "_"}
    return lambda token: special.get(int(token)) or tokenizer.decode([token])


def show_trajectory(traj: Trajectory, glyph: Callable[[int], str]) -> str:
    """Four rows, one column per token: the prompt, then per response token its character
    (`glyphs`), "A" for the policy's tokens and "o" for observation tokens, and the version
    that generated it (its last digit; "-" on observations)."""
    prompt = "".join(glyph(t) for t in traj.prompt)
    pad = " " * len(prompt)
    return "\n".join([f"{'prompt':<9}{prompt}",
                      f"{'tokens':<9}{pad}{''.join(glyph(t) for t in traj.ids)}",
                      f"{'action':<9}{pad}{''.join('A' if a else 'o' for a in traj.action)}",
                      f"{'version':<9}{pad}"
                      f"{''.join(str(v % 10) if v >= 0 else '-' for v in traj.version)}"])


@torch.no_grad()
def behaviour_gap(traj: Trajectory, models: dict[int, torch.nn.Module]) -> float:
    """The largest |recorded log-prob - log-prob under the model of the token's version| over
    the policy's tokens (sampled at temperature 1 with top-k and top-p off)."""
    ids = torch.tensor([[*traj.prompt, *traj.ids]])
    start = len(traj.prompt)
    gap = 0.0
    for version in sorted({v for v in traj.version if v >= 0}):
        logits = models[version](input_ids=ids).logits[0, start - 1:-1]
        logp = logprobs_from_logits(logits, ids[0, start:])
        for i, (v, a) in enumerate(zip(traj.version, traj.action, strict=True)):
            if a and v == version:
                gap = max(gap, abs(float(logp[i]) - traj.logp[i]))
    return gap
