"""Chapter 7's episode loop: token-in/token-out exactly, masks on policy tokens only, trainer
log-probs = the engine's, limits, both schedules, and per-token weight versions.

The engine is chapter 5's `TorchEngine` on a tiny model (wrapped to record what it returned
for each context); environments are scripted, drawn by Hypothesis."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from avrid.agents.env import EpisodeLimits, StepResult
from avrid.agents.episodes import run_episodes
from avrid.agents.trajectory import trajectory_columns
from avrid.dispatch import Batch
from avrid.ppo.data.columns import with_responses
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.engines.torch_engine import Completion, SamplingParams, TorchEngine
from tests.helpers import trainer_logprobs

pytestmark = pytest.mark.chapter(7)

VOCAB, PAD, EOS, CLOSE = 24, 0, 1, 23  # CLOSE: a tool call's end, a turn stop
STOPS = (EOS, CLOSE)


@dataclass(frozen=True)
class IdTokenizer:
    """Text is never used here: observations are ids; decode is for the env's text view.
    The loop accepts observation ids in range(vocab_size)."""

    vocab_size: int = VOCAB

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    encode_text = encode

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))


class RecordingEngine:
    """`TorchEngine`, remembering what it generated for each context (token-in/token-out
    is checked against it)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.seen: dict[tuple[int, ...], list[Completion]] = {}

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Completion]:
        outs = self.engine.generate(prompts, params)
        for p, c in zip(prompts, outs, strict=True):
            self.seen.setdefault(tuple(p), []).append(c)
        return outs


@dataclass
class ScriptedEnv:
    """Answers turn i with observations[i] (ids); done after `turns` policy turns."""

    prompt: list[int]
    observations: list[list[int]]
    turns: int
    delay_s: float = 0.0
    got: list[list[int]] = field(default_factory=list)
    returned: list[list[int]] = field(default_factory=list)

    def reset(self) -> list[int]:
        return self.prompt

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        self.got.append(list(action_ids))
        if self.delay_s:
            time.sleep(self.delay_s)
        if len(self.got) >= self.turns:
            return StepResult(observation=[], reward=float(len(self.got)), done=True)
        self.returned.append(self.observations[len(self.got) - 1])
        return StepResult(observation=self.returned[-1], tool_calls=1)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_policy(TinyModelSpec(vocab_size=VOCAB), seed=0)


episode = st.tuples(st.lists(st.integers(2, VOCAB - 2), min_size=1, max_size=5),
                    st.lists(st.lists(st.integers(2, VOCAB - 1), max_size=4), min_size=4,
                             max_size=4),
                    st.integers(1, 4))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(episodes=st.lists(episode, min_size=1, max_size=5), seed=st.integers(0, 1000),
       segment=st.sampled_from([None, 2, 3]), turn_tokens=st.integers(2, 6))
def test_trainer_sees_exactly_the_engine_and_environment_tokens(
        model: torch.nn.Module, episodes: list, seed: int, segment: int | None,
        turn_tokens: int) -> None:
    engine = RecordingEngine(TorchEngine(model, pad_token_id=PAD))
    envs = [ScriptedEnv(p, obs, turns) for p, obs, turns in episodes]
    limits = EpisodeLimits(max_turns=4, turn_tokens=turn_tokens, max_tokens=30)
    trajs, _ = run_episodes(engine, envs, tokenizer=IdTokenizer(), limits=limits,
                            params=SamplingParams(max_new_tokens=1, stop_token_ids=STOPS,
                                                  seed=seed),
                            schedule="turn_sync", segment_tokens=segment)
    for env, traj in zip(envs, trajs, strict=True):
        assert list(traj.prompt) == env.prompt
        policy_turns = [s for s in traj.turns if s[0] == "policy"]
        observations = [s for s in traj.turns if s[0] == "observation"]
        # Turn by turn: the environment got exactly each policy turn, and each observation
        # is exactly what it returned.
        assert [traj.ids[a:b] for _, a, b in policy_turns] == env.got
        shown = [o for o in env.returned if o]  # an empty observation adds no tokens
        assert [traj.ids[a:b] for _, a, b in observations] == shown[:len(observations)]
        if traj.done:  # only a limit may leave the last observation out
            assert len(observations) == len(shown)
        # Each policy token is what the engine generated for the context before it.
        for _, start, end in policy_turns:
            pos = start
            while pos < end:
                # (identical contexts may have been sampled more than once: one of them)
                made = engine.seen[(*traj.prompt, *traj.ids[:pos])]
                take = next(k for c in made if (k := min(len(c.token_ids), end - pos))
                            and traj.ids[pos:pos + k] == list(c.token_ids[:k])
                            and traj.logp[pos:pos + k] == list(c.logprobs[:k]))
                pos += take
        # The action mask is 1 exactly on policy tokens.
        expected = [0] * len(traj.ids)
        for _, a, b in policy_turns:
            expected[a:b] = [1] * (b - a)
        assert traj.action == expected
        assert traj.done != traj.truncated
    # What the trainer receives: the same ids, prompt first; mask and log-probs alongside.
    packed, scalars = trajectory_columns(trajs)
    prompts = Batch.from_rows(sample_ids=range(len(trajs)),
                              prompt_lens=[len(t.prompt) for t in trajs],
                              response_lens=[0] * len(trajs),
                              packed={"tokens": [torch.tensor(t.prompt) for t in trajs]})
    generated = Batch.from_rows(sample_ids=range(len(trajs)),
                                prompt_lens=[len(t.prompt) for t in trajs],
                                response_lens=[len(t.ids) for t in trajs],
                                packed={k: [v.row(i) for i in range(len(trajs))]
                                        for k, v in packed.items()}, scalars=scalars)
    batch = with_responses(prompts, generated)
    for i, t in enumerate(trajs):
        assert batch.packed["tokens"].row(i).tolist() == [*t.prompt, *t.ids]
        assert batch.packed["action_mask"].row(i).tolist() == t.action
    # The trainer's log-probs on the policy tokens = the engine's (fp32, chapter 5's bound).
    full = trainer_logprobs(model, [t.prompt for t in trajs], [t.ids for t in trajs],
                            temperature=1.0, pad_id=PAD)
    for t, logp in zip(trajs, full, strict=True):
        mask = torch.tensor(t.action, dtype=torch.bool)
        engine_logp = torch.tensor(t.logp)
        assert torch.allclose(logp[mask].float(), engine_logp[mask], atol=1e-4, rtol=0)


def test_limits_end_episodes_after_whole_turns(model: torch.nn.Module) -> None:
    engine = TorchEngine(model, pad_token_id=PAD)
    long_obs = [[5] * 3] * 4
    envs = [ScriptedEnv([2, 3], long_obs, turns=10) for _ in range(6)]
    limits = EpisodeLimits(max_turns=2, turn_tokens=4, max_tokens=20)
    trajs, stats = run_episodes(engine, envs, tokenizer=IdTokenizer(), limits=limits,
                                params=SamplingParams(max_new_tokens=1, stop_token_ids=STOPS))
    for t, env in zip(trajs, envs, strict=True):
        assert t.truncated and not t.done
        assert t.policy_turns == len(env.got) <= 2
        assert all(b - a <= 4 for kind, a, b in t.turns if kind == "policy")
        assert len(t.ids) <= 20
        assert t.turns[-1][0] == "policy"  # never ends on a cut observation
    assert stats.engine_calls >= 2 and 0 < stats.busy_share <= 1


def test_both_schedules_give_the_same_greedy_episodes(model: torch.nn.Module) -> None:
    # Scheduling decides which episodes share an engine call, never what an episode is:
    # greedy decoding makes each episode independent of its batch-mates.
    rng = random.Random(0)
    make = lambda: [ScriptedEnv([2 + i % 5, 3], [[4, 5], [6], [7, 8, 9]], turns=1 + i % 4,  # noqa: E731
                                delay_s=rng.random() * 0.02) for i in range(12)]
    engine = TorchEngine(model, pad_token_id=PAD)
    limits = EpisodeLimits(max_turns=4, turn_tokens=5, max_tokens=40)
    params = SamplingParams(max_new_tokens=1, greedy=True, stop_token_ids=STOPS)
    runs = {s: run_episodes(engine, make(), tokenizer=IdTokenizer(), limits=limits,
                            params=params, schedule=s, tool_threads=4)
            for s in ("per_trajectory", "turn_sync")}
    a, b = runs["per_trajectory"][0], runs["turn_sync"][0]
    assert [t.ids for t in a] == [t.ids for t in b]
    assert [t.action for t in a] == [t.action for t in b]
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(torch.tensor(x.logp), torch.tensor(y.logp), atol=1e-5)


class VersionEngine:
    """An engine whose weights are frozen between versions: every token it emits IS the
    version it holds (id 2 + version), so a token's recorded version can be checked."""

    def __init__(self) -> None:
        self.version = 0
        self.lock = threading.Lock()

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Completion]:
        n = params.max_new_tokens
        return [Completion(token_ids=(2 + self.version,) * n, logprobs=(-0.5,) * n,
                           finish_reason="length") for _ in prompts]


@dataclass
class Updates:
    """A weight source that moves the engine to the next version every `every` polls."""

    engine: VersionEngine
    every: int
    polls: int = 0

    def poll(self) -> int:
        self.polls += 1
        if self.polls % self.every == 0:
            self.engine.version += 1
        return self.engine.version


@pytest.mark.parametrize("every", [1, 2, 3])
def test_every_token_records_the_version_that_generated_it(every: int) -> None:
    engine = VersionEngine()
    envs = [ScriptedEnv([2], [[1 + VOCAB]] * 4, turns=3) for _ in range(5)]
    limits = EpisodeLimits(max_turns=3, turn_tokens=5, max_tokens=40)
    # VersionEngine has no vocabulary: the observation's id 1 + VOCAB, never a policy token,
    # is in range of a tokenizer this wide.
    trajs, stats = run_episodes(engine, envs, tokenizer=IdTokenizer(vocab_size=2 + VOCAB),
                                limits=limits,
                                params=SamplingParams(max_new_tokens=1, stop_token_ids=STOPS),
                                segment_tokens=2, weights=Updates(engine, every))
    assert len(set(stats.versions)) > 1  # updates did arrive mid-turn
    for t in trajs:
        for tok, version, action in zip(t.ids, t.version, t.action, strict=True):
            assert version == (tok - 2 if action else -1)
        # A 5-token turn in segments of 2 spans several versions, and is still one turn.
        assert t.policy_turns == 3
        assert any(len({t.version[i] for i in range(a, b)}) > 1
                   for kind, a, b in t.turns if kind == "policy")
        assert t.oldest_version() == min(v for v in t.version if v >= 0)


@dataclass
class PythonToolEnv:
    """One tool call per episode: the code the test gives, run by the sandboxed Python tool
    (`tools.python`); the observation is what the tool says, as ids of its length."""

    code: str
    results: list = field(default_factory=list)

    def reset(self) -> list[int]:
        return [2, 3]

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        from avrid.agents.tools import python

        if self.results:
            return StepResult(observation=[], reward=1.0, done=True)
        result = python(self.code, wall_s=2.0, memory_mb=256)
        self.results.append(result)
        return StepResult(observation=[4] * min(3, len(result.observation())), tool_calls=1,
                          tool_errors=int(result.status != "ok"), tool_seconds=result.seconds)


def test_misbehaving_tools_inside_episodes_end_as_observations_and_leave_nothing(
        model: torch.nn.Module) -> None:
    from tests.test_agents_sandbox import namespaces_or_skip

    namespaces_or_skip()  # the default sandbox, where a tool's write to the runtime is refused
    codes = {"ok": "print(6 * 7)", "timeout": "while True: pass",
             "memory": "x = bytearray(1 << 34)",
             "denied": "import os; open(os.__file__, 'a').write('# pwned')",
             "network": "import socket; socket.create_connection(('example.com', 80))",
             "crash": "raise RuntimeError('boom')"}
    envs = [PythonToolEnv(code) for code in codes.values()]
    engine = TorchEngine(model, pad_token_id=PAD)
    start = time.monotonic()
    trajs, _ = run_episodes(engine, envs, tokenizer=IdTokenizer(),
                            limits=EpisodeLimits(max_turns=3, turn_tokens=3, max_tokens=30),
                            params=SamplingParams(max_new_tokens=1, stop_token_ids=STOPS),
                            tool_threads=len(envs))
    # The tools ran side by side: the whole batch took about the slowest one (2 s), not the sum.
    assert time.monotonic() - start < 30
    statuses = [env.results[0].status for env in envs]
    assert statuses == ["ok", "timeout", "memory", "denied", "denied", "error"]
    assert all(t.done and t.tool_calls == 1 for t in trajs)  # every episode went on to its end
    assert [t.tool_errors for t in trajs] == [0, 1, 1, 1, 1, 1]
    assert not open(os.__file__).read().endswith("# pwned")
    for env in envs:  # nothing of any tool is left running
        with pytest.raises(ProcessLookupError):
            os.killpg(env.results[0].pid, 0)


class BrokenEnv(ScriptedEnv):
    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        raise KeyError("no such tool")


def test_an_environment_that_raises_is_named_in_one_line(model: torch.nn.Module) -> None:
    engine = TorchEngine(model, pad_token_id=PAD)
    with pytest.raises(RuntimeError, match=r"task 'agent': the environment of episode 1 raised "
                                           r"at turn 1: KeyError: 'no such tool'"):
        run_episodes(engine, [ScriptedEnv([2], [[3]], 1), BrokenEnv([2], [[3]], 1)],
                     tokenizer=IdTokenizer(), limits=EpisodeLimits(),
                     params=SamplingParams(max_new_tokens=1, stop_token_ids=STOPS))
