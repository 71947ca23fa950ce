"""Chapter 7's episode loop when environments misbehave: a step that hangs, a first failure
while other steps still run, observations that are not text or ids of the vocabulary, a
two-million-character observation; and what the loop leaves behind (its threads) and
passes on (the caller's context variables).

Nothing here waits on a sleep: slow and hung steps wait on Events the tests set, and every
test that leaves a step hanging releases it at teardown (`release`)."""

from __future__ import annotations

import contextvars
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from avrid.agents import step_pool
from avrid.agents.env import EpisodeLimits, StepResult
from avrid.agents.episodes import SCHEDULES, run_episodes
from avrid.agents.step_pool import THREAD_NAME
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.engines.torch_engine import SamplingParams, TorchEngine
from avrid.ppo.setup.task import Prompt
from avrid.ppo.setup.tokenizer import CharTokenizer
from tests.helpers import child_env
from tests.test_agents_episodes import PAD, STOPS, VOCAB, BrokenEnv, IdTokenizer, ScriptedEnv
from tests.test_agents_gsm8k_tool import tokenizer as gsm8k_tokenizer

pytestmark = pytest.mark.chapter(7)

PARAMS = SamplingParams(max_new_tokens=1, stop_token_ids=STOPS)
SHORT = EpisodeLimits(max_turns=3, turn_tokens=2, max_tokens=20)  # a few tokens: fast turns
SLACK_S = 3.0  # how late an error may come after its deadline on a busy 2-core machine


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine(build_tiny_policy(TinyModelSpec(vocab_size=VOCAB), seed=0),
                       pad_token_id=PAD)


def env_threads() -> set[threading.Thread]:
    """The step pools' threads alive now."""
    return {t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)}


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """What hung steps wait on: set at teardown, and their threads joined, so no test leaves
    a thread behind for the next one."""
    event = threading.Event()
    before = env_threads()
    yield event
    event.set()
    for thread in env_threads() - before:
        thread.join(timeout=10)
    assert not env_threads() - before


@dataclass
class HungEnv:
    """Its step at turn `hang_at` waits on `release`: as far as the loop can tell, it never
    returns (earlier turns get an observation)."""

    release: threading.Event
    hang_at: int = 1
    started: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0  # time.monotonic() when the hung step began
    thread: str = ""  # the name of the thread the hung step runs on
    turns: int = 0

    def reset(self) -> list[int]:
        return [2]

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        self.turns += 1
        if self.turns < self.hang_at:
            return StepResult(observation=[3])
        self.started_at, self.thread = time.monotonic(), threading.current_thread().name
        self.started.set()
        self.release.wait(timeout=60)
        return StepResult(observation=[], reward=1.0, done=True)


@dataclass
class RaisesOnceStarted(BrokenEnv):
    """Raises at its first step, once `other` has started its own: the failure arrives while
    that step is running."""

    other: HungEnv | None = None
    raised_at: float = 0.0

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        assert self.other is not None and self.other.started.wait(timeout=10)
        self.raised_at = time.monotonic()
        return super().step(action_ids, action_text)


def named(index: int, text: str) -> Prompt:
    return Prompt(index=index, text=text, answer="?")


def test_a_hung_step_fails_the_loop_at_its_deadline_while_others_finish(
        engine: TorchEngine, release: threading.Event) -> None:
    others = [ScriptedEnv([2], [[3, 4]], turns=2) for _ in range(3)]
    hung = HungEnv(release)
    limits = replace(SHORT, tool_wall_s=0.5, step_wall_s=1.0)
    with pytest.raises(RuntimeError, match=re.escape(
            "task 'hangs': the environment of prompt 7 ('say hi') did not return from step() "
            "at turn 1 within EpisodeLimits.step_wall_s=1.0 s")):
        run_episodes(engine, [*others, hung], tokenizer=IdTokenizer(), limits=limits,
                     params=PARAMS, prompts=[named(i, "x") for i in range(3)] +
                     [named(7, "say hi")], tool_threads=4, task_name="hangs")
    late = time.monotonic() - hung.started_at
    # Not before the step had its full time, and not long after.
    assert limits.step_wall_s <= late < limits.step_wall_s + SLACK_S
    # per_trajectory: the other episodes went on to their end meanwhile.
    assert all(len(env.got) == 2 for env in others)


class SlowEnv(HungEnv):
    """A step that takes 30 s (until `release`)."""

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        self.started.set()
        self.release.wait(timeout=30)
        return StepResult(observation=[3], tool_calls=1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_first_failure_is_raised_at_once_without_waiting_for_running_steps(
        engine: TorchEngine, release: threading.Event, schedule: str) -> None:
    slow = SlowEnv(release)
    broken = RaisesOnceStarted([2], [[3]], 1, other=slow)
    with pytest.raises(RuntimeError, match=r"task 'agent': the environment of episode 1 "
                                           r"raised at turn 1: KeyError: 'no such tool'"):
        run_episodes(engine, [slow, broken], tokenizer=IdTokenizer(), limits=SHORT,
                     params=PARAMS, schedule=schedule, tool_threads=2)
    # The slow step, running all along, had 30 s to go.
    assert time.monotonic() - broken.raised_at < SLACK_S


def test_steps_still_queued_at_the_first_failure_never_start(engine: TorchEngine) -> None:
    # One thread: the broken step runs first, the others wait in the queue behind it.
    queued = [ScriptedEnv([2], [[3]], 1) for _ in range(3)]
    with pytest.raises(RuntimeError, match="KeyError"):
        run_episodes(engine, [BrokenEnv([2], [[3]], 1), *queued], tokenizer=IdTokenizer(),
                     limits=SHORT, params=PARAMS, tool_threads=1)
    assert [env.got for env in queued] == [[], [], []]


@dataclass
class Returns:
    """Its `reset` (where="reset") or its first step's observation (where="step") is
    `value`; a step that returns `value` itself with where="result"."""

    value: object
    where: str

    def reset(self) -> object:
        return self.value if self.where == "reset" else [2]

    def step(self, action_ids: Sequence[int], action_text: str) -> object:
        if self.where == "result":
            return self.value
        return StepResult(observation=self.value)


BAD = [123, None, [1.5], ["a"], [True], [VOCAB], [-1], b"\x03", {3: 4}, [[3]],
       list(range(VOCAB, VOCAB + 10_000))]


@pytest.mark.parametrize("where", ["reset", "step"])
@pytest.mark.parametrize("value", BAD, ids=lambda v: repr(v)[:20])
def test_a_bad_observation_is_one_error_naming_task_prompt_and_value(
        engine: TorchEngine, value: object, where: str) -> None:
    env = Returns(value, where)
    with pytest.raises(ValueError) as info:
        run_episodes(engine, [ScriptedEnv([2], [[3]], 1), env], tokenizer=IdTokenizer(),
                     limits=SHORT, params=PARAMS, task_name="obs",
                     prompts=[named(0, "a"), named(5, "2+2=")])
    message = str(info.value)
    what = "reset() of the environment of prompt 5 ('2+2=') returned" if where == "reset" \
        else "the environment of prompt 5 ('2+2=') returned at turn 1 the observation"
    assert message.startswith(f"task 'obs': {what} ")
    assert message.endswith("it must be a string, or token ids in range(0, 24)")
    shown = repr(value) if len(repr(value)) <= 80 else "[24, 25, 26"  # cut, not all 10,000
    assert shown in message and len(message) < 400


def test_a_step_that_returns_no_step_result_is_named(engine: TorchEngine) -> None:
    with pytest.raises(ValueError, match=re.escape(
            "task 'agent': the environment of episode 0 returned {'observation': [3]} (dict) "
            "at turn 1; step() must return a StepResult")):
        run_episodes(engine, [Returns({"observation": [3]}, "result")],
                     tokenizer=IdTokenizer(), limits=SHORT, params=PARAMS)


@dataclass
class EndsSaying:
    """Ends the episode at its first step, with `last` as the observation."""

    last: object

    def reset(self) -> list[int]:
        return [2]

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        return StepResult(observation=self.last, reward=1.0, done=True)


@pytest.mark.parametrize("last, shown", [("you win", "'you win'"), ([3, 4], "[3, 4]")],
                         ids=["text", "ids"])
def test_an_observation_returned_with_done_is_refused_not_dropped(
        engine: TorchEngine, last: object, shown: str) -> None:
    # No turn follows a done step, so the policy could never read `last`: silently dropping
    # it hid a bug of the environment (it was the loop's behaviour before).
    with pytest.raises(ValueError, match=re.escape(
            f"task 'obs': the environment of prompt 5 ('2+2=') returned at turn 1 done=True "
            f"with the observation {shown}; an episode that is over shows the policy nothing "
            f"more: return observation='' (or []) with done=True, or done=False")):
        run_episodes(engine, [ScriptedEnv([2], [[3]], 1), EndsSaying(last)],
                     tokenizer=IdTokenizer(), limits=SHORT, params=PARAMS, task_name="obs",
                     prompts=[named(0, "a"), named(5, "2+2=")])
    # Empty, in either form, is how an episode ends.
    for empty in ("", []):
        trajs, _ = run_episodes(engine, [EndsSaying(empty)], tokenizer=IdTokenizer(),
                                limits=SHORT, params=PARAMS)
        assert trajs[0].done and trajs[0].reward == 1.0


@dataclass(frozen=True)
class CountingTokenizer(IdTokenizer):
    """Counts the characters of every text it tokenizes (`seen`); says nothing of how long
    a token may be, so the loop assumes its default."""

    seen: list[int] = field(default_factory=list)

    def encode_text(self, text: str) -> list[int]:
        self.seen.append(len(text))
        return [3] * len(text)


@dataclass(frozen=True)
class ChunkTokenizer(CountingTokenizer):
    """One token per 4 characters: the most a token stands for here."""

    max_token_chars: int = 4

    def encode_text(self, text: str) -> list[int]:
        self.seen.append(len(text))
        return [3] * -(-len(text) // self.max_token_chars)


@dataclass
class SaysOnce:
    """Answers its first turn with `text`, then ends."""

    text: str
    steps: int = 0
    said_at: float = 0.0  # time.monotonic() when it returned `text`

    def reset(self) -> list[int]:
        return [2]

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        self.steps += 1
        if self.steps > 1:
            return StepResult(observation="", reward=1.0, done=True)
        self.said_at = time.monotonic()
        return StepResult(observation=self.text)


# One policy token per turn: after the first turn an observation has room for 20 - 1 - 1
# tokens (one is left for the next turn), so 18 * 4 characters of ChunkTokenizer.
LIMITS = EpisodeLimits(max_turns=3, turn_tokens=1, max_tokens=20)
FITS = 18 * 4


@pytest.mark.parametrize("make", [ChunkTokenizer, CountingTokenizer],
                         ids=["max_token_chars=4", "default"])
def test_a_huge_observation_ends_the_episode_without_being_tokenized(
        engine: TorchEngine, make: type[CountingTokenizer]) -> None:
    tok = make()
    env = SaysOnce("7" * 2_000_000)
    (traj,), _ = run_episodes(engine, [env], tokenizer=tok, limits=LIMITS, params=PARAMS)
    assert time.monotonic() - env.said_at < 1.0  # from the step's answer to the loop's end
    assert traj.truncated and not traj.done and traj.policy_turns == 1
    assert [kind for kind, _, _ in traj.turns] == ["policy"]  # nothing of it was shown
    assert tok.seen == []  # never tokenized


@pytest.mark.parametrize("chars, fits", [(FITS, True), (FITS + 1, False)])
def test_an_observation_that_exactly_fits_goes_in_whole(
        engine: TorchEngine, chars: int, fits: bool) -> None:
    tok = ChunkTokenizer()
    (traj,), _ = run_episodes(engine, [SaysOnce("7" * chars)], tokenizer=tok, limits=LIMITS,
                              params=PARAMS)
    if fits:
        assert tok.seen == [FITS]  # tokenized once, whole
        assert traj.done and [(k, b - a) for k, a, b in traj.turns] == [
            ("policy", 1), ("observation", 18), ("policy", 1)]
    else:  # one character more cannot fit: not even tokenized
        assert tok.seen == [] and traj.truncated and len(traj.turns) == 1


def test_tokenizers_say_how_many_characters_a_token_stands_for(tmp_path: Path) -> None:
    assert CharTokenizer("0123456789=").max_token_chars == 1
    hf = gsm8k_tokenizer(tmp_path)  # words and Qwen's tool markers as single tokens
    assert hf.max_token_chars == len("</tool_response>")  # its longest token


BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("backend", default="unset")


@dataclass
class SeesBackend(ScriptedEnv):
    """Records the caller's BACKEND at every step, then sets its own (which must not leak)."""

    seen: list[str] = field(default_factory=list)

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        self.seen.append(BACKEND.get())
        BACKEND.set(f"changed by step {len(self.seen)}")
        return super().step(action_ids, action_text)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_steps_see_the_callers_context_variables(engine: TorchEngine, schedule: str) -> None:
    envs = [SeesBackend([2], [[3], [4]], turns=3) for _ in range(4)]
    token = BACKEND.set("firejail")
    try:
        run_episodes(engine, envs, tokenizer=IdTokenizer(), limits=SHORT,
                     params=PARAMS, schedule=schedule, tool_threads=2)
        assert BACKEND.get() == "firejail"  # a step's own setting stays in its copy
    finally:
        BACKEND.reset(token)
    assert all(env.seen and set(env.seen) == {"firejail"} for env in envs)


@dataclass
class NamesItsThread(ScriptedEnv):
    """Records the name of every thread its steps ran on."""

    threads: set[str] = field(default_factory=set)

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        self.threads.add(threading.current_thread().name)
        return super().step(action_ids, action_text)


class FailsAtTurn2(ScriptedEnv):
    """Answers its first turn, raises at its second."""

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        if self.got:
            raise KeyError("no such tool")
        return super().step(action_ids, action_text)


def test_no_thread_outlives_the_loop_but_one_stuck_in_a_hung_step(
        engine: TorchEngine, release: threading.Event) -> None:
    before = env_threads()
    # Returning normally: at most tool_threads threads ran steps, and all of them ended.
    envs = [NamesItsThread([2], [[3], [4]], turns=3) for _ in range(8)]
    run_episodes(engine, envs, tokenizer=IdTokenizer(), limits=SHORT,
                 params=PARAMS, tool_threads=3)
    assert 1 <= len(set().union(*(env.threads for env in envs))) <= 3
    assert env_threads() == before
    # Failing at turn 2, after the other episodes ended at turn 1 (turn_sync: their steps
    # were over before the next turn): every thread ended.
    with pytest.raises(RuntimeError, match="KeyError"):
        run_episodes(engine, [ScriptedEnv([2], [[3]], 1), FailsAtTurn2([2], [[3]], 3),
                              ScriptedEnv([2], [[3]], 1)], tokenizer=IdTokenizer(),
                     limits=SHORT, params=PARAMS, schedule="turn_sync", tool_threads=3)
    assert env_threads() == before
    # Hung at turn 2, the same way: only the thread inside the step is left (a daemon),
    # until the step returns.
    hung = HungEnv(release, hang_at=2)
    with pytest.raises(RuntimeError, match="did not return from step"):
        run_episodes(engine, [ScriptedEnv([2], [[3]], 1), hung, ScriptedEnv([2], [[3]], 1)],
                     tokenizer=IdTokenizer(), params=PARAMS, schedule="turn_sync",
                     limits=replace(SHORT, tool_wall_s=0.2, step_wall_s=0.3), tool_threads=3)
    (left,) = env_threads() - before
    assert left.name == hung.thread and left.daemon
    release.set()
    left.join(timeout=10)
    assert not left.is_alive()


NEVER_RETURNS = """
import importlib.util, sys, threading

# step_pool.py alone (importing avrid.agents would bring Ray and torch: seconds).
spec = importlib.util.spec_from_file_location("step_pool", sys.argv[1])
step_pool = importlib.util.module_from_spec(spec)
sys.modules["step_pool"] = step_pool  # its dataclasses look their module up
spec.loader.exec_module(step_pool)
with step_pool.StepPool(threads=2, wall_s=0.5) as pool:
    pool.submit("returns", int, "7")
    outcomes = pool.finished(wait=True)
    pool.submit("hangs", threading.Event().wait)  # forever
    outcomes += pool.finished(wait=True)
print(sorted((f.key, f.value, f.overdue) for f in outcomes), pool.abandoned)
"""


def test_a_step_that_never_returns_does_not_hold_the_process_at_exit() -> None:
    # The loop's steps run on these threads: the hung one is still waiting when the
    # interpreter ends, and nothing joins it (a ThreadPoolExecutor's would be joined).
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", NEVER_RETURNS,
                          str(Path(step_pool.__file__))], capture_output=True, text=True,
                         timeout=60, env=child_env())
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["[('hangs',", "None,", "True),", "('returns',", "7,",
                                  "False)]", "1"]
    assert time.monotonic() - start < 10
