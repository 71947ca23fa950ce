"""Chapter 7's episode loop at its limits, with an engine whose every token is scripted.

`test_agents_episodes.py` draws episodes at random over a tiny model; these pin the edges
exactly: a turn that reaches the episode's `max_tokens` exactly (the call's budget is the
smaller of what is left of the turn and of the episode, each row cut at its own), and a stop
token inside a call's budget or exactly at a segment's end (the turn ends there, the
environment gets the turn up to and with its stop token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from avrid.agents.env import EpisodeLimits, StepResult
from avrid.agents.episodes import run_episodes
from avrid.ppo.engines.torch_engine import Completion, SamplingParams
from tests.test_agents_episodes import IdTokenizer

pytestmark = pytest.mark.chapter(7)

EOS, CLOSE, WORD = 1, 23, 5  # CLOSE ends a tool call: a turn stop
PARAMS = SamplingParams(max_new_tokens=1, stop_token_ids=(EOS, CLOSE))


@dataclass
class ScriptedEngine:
    """Writes `script` (from its start) for every context, as a real engine would: stopping
    after the first of the call's stop ids, or at the call's `max_new_tokens`. Records each
    call's budget."""

    script: list[int]
    budgets: list[int] = field(default_factory=list)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Completion]:
        self.budgets.append(params.max_new_tokens)
        outs = []
        for _ in prompts:
            ids = self.script[:params.max_new_tokens]
            stop = next((i for i, t in enumerate(ids) if t in params.stop_token_ids), None)
            ids = ids if stop is None else ids[:stop + 1]
            reason = "stop" if stop is not None else "length"
            outs.append(Completion(token_ids=tuple(ids), logprobs=tuple([-1.0] * len(ids)),
                                   finish_reason=reason))
        return outs


@dataclass
class EchoEnv:
    """Answers every turn with `observation` (ids), never done; records the turns it got."""

    observation: list[int]
    got: list[list[int]] = field(default_factory=list)

    def reset(self) -> list[int]:
        return [2, 3]

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        self.got.append(list(action_ids))
        return StepResult(observation=self.observation)


def test_a_turn_reaches_the_episodes_cap_exactly_and_never_passes_it() -> None:
    # max_tokens 10, turns of up to 8 tokens, then the environment's observation: with 1
    # token, turn 2 may take only the 1 token left (not the 8 of its turn), so the episode is
    # exactly 10 tokens, then ends truncated (no room for another observation). With 0
    # tokens, 2 are left: each row is cut at its own budget within one call. With 2 tokens
    # the observation does not fit (the next turn would have no token): it ends at 8.
    # In segments of 4 the same episodes, and never an empty call.
    runs = []
    for segment in (None, 4):
        engine = ScriptedEngine([WORD] * 20)
        envs = [EchoEnv([7]), EchoEnv([]), EchoEnv([7, 7])]
        limits = EpisodeLimits(max_turns=4, turn_tokens=8, max_tokens=10)
        trajs, _ = run_episodes(engine, envs, tokenizer=IdTokenizer(), limits=limits,
                                params=PARAMS, schedule="turn_sync", segment_tokens=segment)
        assert [len(t.ids) for t in trajs] == [10, 10, 8], segment
        turns = [[b - a for kind, a, b in t.turns if kind == "policy"] for t in trajs]
        assert turns == [[8, 1], [8, 2], [8]], segment
        assert all(t.truncated and not t.done for t in trajs)
        assert 0 not in engine.budgets
        runs.append(([t.ids for t in trajs], engine.budgets))
    assert runs[0][1] == [8, 2]  # a call runs to the largest row's budget
    assert runs[1] == (runs[0][0], [4, 4, 2])  # the turn ends at its own limit, not later


def test_a_stop_token_ends_the_turn_inside_a_calls_budget_and_at_a_segments_end() -> None:
    # The engine writes "5 CLOSE 5 5 ...": the turn is "5 CLOSE", whether the stop comes
    # before the call's budget (6 tokens a turn) or as the last token of a 2-token segment
    # (a segment's end continues a turn only when no stop token ended it).
    for segment in (None, 2):
        engine = ScriptedEngine([WORD, CLOSE, WORD, WORD, WORD, WORD])
        env = EchoEnv([7])
        limits = EpisodeLimits(max_turns=2, turn_tokens=6, max_tokens=30)
        [traj], _ = run_episodes(engine, [env], tokenizer=IdTokenizer(), limits=limits,
                                 params=PARAMS, segment_tokens=segment)
        assert env.got == [[WORD, CLOSE], [WORD, CLOSE]], segment
        assert [traj.ids[a:b] for kind, a, b in traj.turns if kind == "policy"] == env.got
        assert traj.ids == [WORD, CLOSE, 7, WORD, CLOSE] and traj.truncated
