"""Chapter 7 — the episode loop: many multi-turn episodes over one engine, each at its own pace.

An episode alternates two kinds of wait: the engine generating its turn, and the
environment answering it (a tool may take 200 ms, or time out after 5 s). Run turn by turn
for the whole batch ("turn_sync"), the engine sits idle until the slowest tool of each turn
returns. Scheduled per trajectory (the default), an episode goes back to the engine the
moment its observation arrives, while others still wait on their tools:

    ready ──► engine.generate(every ready context) ──► turn ended at a stop token?
      ▲                                                  │ no: the turn continues (a segment
      │                                                  │     ended; see below) ──► ready
      │                                                  ▼ yes
      └── observation appended ◄── env.step on a thread (tools run here) ──► done: finished

Each call generates for the episodes ready at that moment; on vLLM the call is one
continuously batched `generate`. Environments step on a few threads (`step_pool.py`, at most
`tool_threads`, each step in a copy of the caller's `contextvars` context), so tools of
different episodes run at once while the engine works.

When an environment misbehaves, the loop fails at once with one error naming the task, the
prompt (index and text) and the turn; it never waits for other steps still running:

- a step that raises: RuntimeError with the step's error;
- a step that does not return within `EpisodeLimits.step_wall_s`: RuntimeError at that
  deadline. Python cannot stop a thread, so the hung step is abandoned on its daemon thread
  (neither the caller nor interpreter exit waits for it);
- a step that returns something other than a `StepResult`, or a first context (`reset`) or
  observation that is neither text nor token ids in range(tokenizer.vocab_size): ValueError
  showing the value;
- a step that returns `done=True` with a non-empty observation: ValueError showing it (no
  turn follows, so the policy could never read it; it is refused, never silently dropped).

Steps still queued when the loop fails never start. An observation too long for what is left
of `max_tokens` ends the episode as truncated, never cut; a text longer than the room times
the most characters one token stands for cannot fit, so it is not even tokenized (a tool
that prints two million characters costs nothing).

Partial rollouts: a turn may be generated in segments of `segment_tokens`. Between two
engine calls the loop asks its `WeightSource` which version the engine holds (the source
loads newly arrived weights first): the next segment continues the same turn from its tokens
so far under the new weights (abort and resume), and each token records the version that
generated it. With the default source (`FixedVersion`) every token has one version.

Reproducibility: every call's seed comes from (seed, call number), so "turn_sync" gives the
same episodes for the same seed and weights. "per_trajectory" batches whatever is ready, which
depends on how long the tools took: each episode is still a valid sample of the policy, but
which episodes share a call (and so the exact samples) can change from run to run.

Not here: what an environment is (`env.py`), the token record (`trajectory.py`), turning
episodes into a training batch on a worker (`worker.py`).
"""

from __future__ import annotations

import reprlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import Any, Literal, Protocol

from avrid.agents.env import Environment, EpisodeLimits, StepResult
from avrid.agents.step_pool import StepPool
from avrid.agents.trajectory import Trajectory
from avrid.ppo.engines.torch_engine import SamplingParams
from avrid.ppo.setup.task import Prompt, check_reward
from avrid.ppo.setup.tokenizer import Tokenizer

Schedule = Literal["per_trajectory", "turn_sync"]
SCHEDULES: tuple[str, ...] = ("per_trajectory", "turn_sync")


class WeightSource(Protocol):
    """Where new weights come from during a rollout (chapter 6's async mode)."""

    def poll(self) -> int:
        """Load any weights that arrived since the last call into the engine; return the
        weight version the engine holds now. Called before every engine call."""
        ...


@dataclass(frozen=True, slots=True)
class FixedVersion:
    """A `WeightSource` whose weights never change mid-rollout: the synchronous loop's."""

    version: int

    def poll(self) -> int:
        return self.version


@dataclass(slots=True)
class LoopStats:
    """Where one `run_episodes` call spent its time."""

    wall_s: float = 0.0
    """From the first reset to the last episode finished."""
    busy_s: float = 0.0
    """Inside the engine's generate calls."""
    engine_calls: int = 0
    versions: list[int] = field(default_factory=list)
    """The version the engine held at each call."""

    @property
    def busy_share(self) -> float:
        """busy_s / wall_s: how much of the rollout the engine was generating."""
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(slots=True)
class _Episode:
    index: int
    env: Environment
    prompt: Prompt | None
    traj: Trajectory
    turn_start: int = 0  # where the current policy turn starts in traj.ids
    mid_turn: bool = False  # the current turn was cut by a segment and goes on

    @property
    def where(self) -> str:
        """The episode as an error names it: its prompt (index and text) when known."""
        return f"prompt {self.prompt.index} ({self.prompt.text!r})" if self.prompt else \
            f"episode {self.index}"


def run_episodes(engine: Any, envs: Sequence[Environment], *, tokenizer: Tokenizer,
                 limits: EpisodeLimits, params: SamplingParams,
                 prompts: Sequence[Prompt | None] | None = None,
                 schedule: Schedule = "per_trajectory", tool_threads: int = 8,
                 segment_tokens: int | None = None, weights: WeightSource | None = None,
                 task_name: str = "agent") -> tuple[list[Trajectory], LoopStats]:
    """Run one episode per environment to its end; returns the trajectories (in `envs`'
    order) and the loop's timing.

    `params` gives the sampling (temperature, top-k/p, greedy, stop ids: EOS and the turn
    stops, seed); its `max_new_tokens` is ignored: each turn gets `limits.turn_tokens`, and
    at most what is left of `limits.max_tokens`. `prompts` (optional, one per env) name the
    prompt in error messages. Steps run on at most `tool_threads` threads (`StepPool`).

    The first failure ends the call at once, naming the task, the prompt and the turn: a
    step that raises or runs past `limits.step_wall_s` (RuntimeError), returns something
    other than a `StepResult`, a first context or observation that is neither text nor
    token ids in range(tokenizer.vocab_size), or a non-empty observation with `done=True`
    (ValueError).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if segment_tokens is not None and segment_tokens < 1:
        raise ValueError(f"segment_tokens must be >= 1 or None, got {segment_tokens!r}")
    weights = weights or FixedVersion(0)
    stats = LoopStats()
    start = time.perf_counter()
    vocab = tokenizer.vocab_size
    episodes = []
    for i, env in enumerate(envs):
        ep = _Episode(i, env, prompts[i] if prompts else None, Trajectory(prompt=()))
        first = _checked(env.reset(), vocab, f"task {task_name!r}: reset() of the "
                                             f"environment of {ep.where} returned")
        # Text as the task's prompts are (`Tokenizer.encode`: a chat model's template
        # included), ids as they are.
        ep.traj.prompt = tuple(tokenizer.encode(first) if isinstance(first, str) else first)
        episodes.append(ep)
    ready: deque[_Episode] = deque(episodes)
    pending: dict[int, _Episode] = {}  # by episode index: those whose step is on the pool
    with StepPool(max(1, tool_threads), wall_s=limits.step_wall_s) as pool:
        while ready or pending:
            # turn_sync: every episode waits for the slowest tool of the turn. Outcomes are
            # read as they come all the same, so the first failure ends the call at once
            # (leaving the pool abandons the steps still running).
            wait = bool(pending) and (schedule == "turn_sync" or not ready)
            for done in pool.finished(wait=wait):
                ep = pending.pop(done.key)
                if done.overdue:
                    raise RuntimeError(
                        f"task {task_name!r}: the environment of {ep.where} did not return "
                        f"from step() at turn {ep.traj.policy_turns} within "
                        f"EpisodeLimits.step_wall_s={limits.step_wall_s} s (each tool call "
                        f"has tool_wall_s={limits.tool_wall_s} s); the step is abandoned")
                if done.error is not None:
                    raise done.error
                if _observe(ep, done.value, tokenizer, limits, task_name):
                    ready.append(ep)
            if not ready or (schedule == "turn_sync" and pending):
                continue
            batch = sorted(ready, key=lambda e: e.index)  # a fixed order within a call
            ready.clear()
            for ep in _generate(engine, batch, params, limits, segment_tokens, weights, stats):
                if ep.mid_turn:
                    ready.append(ep)  # a segment ended inside the turn: it goes on
                else:
                    turn = ep.traj.ids[ep.turn_start:]
                    pool.submit(ep.index, _step, ep, turn, tokenizer.decode(turn), vocab,
                                task_name)
                    pending[ep.index] = ep
    stats.wall_s = time.perf_counter() - start
    return [ep.traj for ep in episodes], stats


def _generate(engine: Any, batch: list[_Episode], params: SamplingParams,
              limits: EpisodeLimits, segment_tokens: int | None, weights: WeightSource,
              stats: LoopStats) -> list[_Episode]:
    """One engine call for `batch`; appends each episode's new tokens. Each row gets its
    own budget (the rest of its turn, of the episode, of the segment): the call runs to the
    largest and every row is cut at its own (the tokens it keeps never depend on the ones
    dropped after them: each token depends only on those before it)."""
    version = weights.poll()
    budgets = []
    for ep in batch:
        if not ep.mid_turn:
            ep.turn_start = len(ep.traj.ids)
        used = len(ep.traj.ids) - ep.turn_start
        budget = min(limits.turn_tokens - used, limits.max_tokens - len(ep.traj.ids))
        budgets.append(budget if segment_tokens is None else min(budget, segment_tokens))
    call = replace(params, max_new_tokens=max(budgets),
                   seed=(params.seed * 1_000_003 + stats.engine_calls * 7919) % (1 << 62))
    t0 = time.perf_counter()
    outs = engine.generate([ep.traj.context for ep in batch], call)
    stats.busy_s += time.perf_counter() - t0
    stats.engine_calls += 1
    stats.versions.append(version)
    stops = set(params.stop_token_ids)
    for ep, out, budget in zip(batch, outs, budgets, strict=True):
        ids, logps = list(out.token_ids[:budget]), list(out.logprobs[:budget])
        stopped = bool(ids) and ids[-1] in stops
        ep.traj.add_policy(ids, logps, [version] * len(ids), continues=ep.mid_turn)
        used = len(ep.traj.ids) - ep.turn_start
        room = min(limits.turn_tokens - used, limits.max_tokens - len(ep.traj.ids))
        # Only a segment's own limit continues a turn; a stop token, the turn's or the
        # episode's budget ends it.
        ep.mid_turn = not stopped and room > 0 and len(ids) == budget and \
            segment_tokens is not None and budget == segment_tokens
    return batch


def _step(ep: _Episode, turn: list[int], text: str, vocab: int, task_name: str) -> StepResult:
    """`ep.env.step` on a pool thread, its answer checked there (so a bad one stops the pool
    at once): a StepResult whose observation is text or a list of ids in range(vocab). Its
    errors name the task, the episode's prompt and the turn (a tool's failure is an
    observation, so an error here is a bug in the environment)."""
    where, n = f"task {task_name!r}: the environment of {ep.where}", ep.traj.policy_turns
    try:
        step = ep.env.step(turn, text)
    except Exception as e:
        raise RuntimeError(f"{where} raised at turn {n}: {type(e).__name__}: {e}") from e
    if not isinstance(step, StepResult):
        raise ValueError(f"{where} returned {_short(step)} ({type(step).__name__}) at turn "
                         f"{n}; step() must return a StepResult")
    observation = _checked(step.observation, vocab,
                           f"{where} returned at turn {n} the observation")
    if step.done and len(observation) > 0:
        # No policy turn follows a done step, so nothing could ever read this observation;
        # refused rather than dropped unseen (or appended as tokens no action depends on).
        raise ValueError(f"{where} returned at turn {n} done=True with the observation "
                         f"{_short(observation)}; an episode that is over shows the policy "
                         f"nothing more: return observation='' (or []) with done=True, or "
                         f"done=False to show it and end the episode on a later turn")
    return replace(step, observation=observation)


def _observe(ep: _Episode, step: StepResult, tokenizer: Tokenizer, limits: EpisodeLimits,
             task_name: str) -> bool:
    """Apply the environment's (checked) answer to a policy turn; True if the episode goes
    on."""
    traj = ep.traj
    traj.tool_calls += step.tool_calls
    traj.tool_errors += step.tool_errors
    traj.tool_seconds += step.tool_seconds
    if step.reward is not None:
        traj.reward = check_reward(step.reward, task_name=task_name, prompt=ep.prompt
                                   or Prompt(index=ep.index, text="?", answer="?"))
    if step.done:
        traj.done = True
        return False
    # The episode ends on a limit after a whole turn or observation: a cut observation
    # would show the policy a context the environment never gave. `room`: what an
    # observation may take, leaving at least one token for the next turn.
    room = limits.max_tokens - len(traj.ids) - 1
    obs = None if traj.policy_turns >= limits.max_turns else \
        _fitting_ids(step.observation, tokenizer, room)
    if obs is None:
        traj.truncated = True
        return False
    traj.add_observation(obs)
    return True


DEFAULT_MAX_TOKEN_CHARS = 256
"""Characters one token may stand for, for a tokenizer that does not say
(`max_token_chars`: `CharTokenizer` 1, `HFTokenizer` measured over its vocabulary). Too
small would end an episode whose observation fits (a wrong sample); too large only
tokenizes a text that cannot fit. So it errs high: a byte-level BPE vocabulary holds long
runs of one character as single tokens (spaces of indented code, dashes of a rule), and
256 is well above the runs such vocabularies are trained to merge."""


def _fitting_ids(observation: str | list[int], tokenizer: Tokenizer,
                 room: int) -> list[int] | None:
    """The observation's ids if they fit in `room` tokens, else None. Text is tokenized
    (once, here, as it is: no chat template around it) only if it may fit: a token stands
    for at most `max_token_chars` characters, so a longer text has too many tokens, and a
    2,000,000-character tool output costs nothing instead of a tokenizer's tens of seconds.
    (True of tokenizers that keep every character in some token, as byte-level BPE and
    SentencePiece do; one that drops whitespace could fit a longer text, and ends it.)"""
    if isinstance(observation, str):
        if len(observation) > room * getattr(tokenizer, "max_token_chars",
                                             DEFAULT_MAX_TOKEN_CHARS):
            return None
        observation = tokenizer.encode_text(observation)
    return observation if len(observation) <= room else None


def _checked(value: object, vocab: int, what: str) -> str | list[int]:
    """`value` as a context: a string as it is, token ids as a list of ints in
    range(vocab) (numpy or torch arrays too; bools are not ids). Anything else is a
    ValueError saying `what` (whose value it is), the value and the allowed forms.

    Example:
        >>> _checked((3, 1), 8, "x")
        [3, 1]
        >>> _checked([8], 8, "reset() returned")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: reset() returned [8] (list): token id 8 at position 0 is out of range; ...
    """
    if isinstance(value, str):
        return value
    items = value.tolist() if hasattr(value, "tolist") else value  # numpy, torch: to ints
    problem = ""
    if not isinstance(items, Sequence) or isinstance(items, bytes | bytearray):
        problem = "neither a string nor a sequence of token ids"
    else:
        for pos, t in enumerate(items):
            if isinstance(t, bool) or not isinstance(t, Integral):
                problem = f"{_short(t)} at position {pos} is not an int"
                break
            if not 0 <= t < vocab:
                problem = f"token id {t} at position {pos} is out of range"
                break
    if problem:
        raise ValueError(f"{what} {_short(value)} ({type(value).__name__}): {problem}; it "
                         f"must be a string, or token ids in range(0, {vocab})")
    return [int(t) for t in items]


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxtuple = 76, 80, 12, 12


def _short(value: object) -> str:
    """`value`'s repr, at most 80 characters (a huge list is not printed whole)."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
