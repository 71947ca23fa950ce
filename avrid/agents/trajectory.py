"""Chapter 7 — a trajectory in tokens: exactly the ids the engine produced and the environment
returned, with what the trainer needs per token.

Token-in/token-out: an episode is never stored as text. The policy's turns are the engine's
token ids as sampled; the environment's observations are ids too (text is tokenized once,
when the environment returns it). The trainer trains on this very sequence, so a turn is
never re-tokenized into something the policy did not produce (a merge across the boundary
of a turn and an observation, a normalised space: verl's multi-turn notes).

Per token of the response (everything after the prompt), four columns:

    ids          the token
    action       1: the policy generated it (it trains); 0: an observation (context only:
                 the policy did not choose it, so no gradient and no advantage goes to it)
    logp         the behaviour log-prob the engine sampled it with (0 on observations)
    version      the weight version that generated it (-1 on observations): with partial
                 rollouts one turn may span versions (`episodes.py`)

Example (a tool call, its result, the answer; ``A`` policy, ``o`` observation):

    prompt  "7*48="
    ids     "[7*48]"  "336;"  "336<eos>"
    action   AAAAAA    oooo    AAAA
    version  333333    ----    4444        (weights changed after the first turn)

Not here: running the episode (`episodes.py`), what the environment says (`env.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from avrid.dispatch import Packed


@dataclass(slots=True, kw_only=True)
class Trajectory:
    """One episode's record, grown turn by turn (see the module docstring)."""

    prompt: tuple[int, ...]
    """The initial prompt's ids (the environment's `reset`)."""
    ids: list[int] = field(default_factory=list)
    """Response ids: policy turns and observations, in order."""
    action: list[int] = field(default_factory=list)
    """Per response id: 1 policy token, 0 observation token."""
    logp: list[float] = field(default_factory=list)
    """Per response id: behaviour log-prob (0.0 on observations)."""
    version: list[int] = field(default_factory=list)
    """Per response id: the weight version that generated it (-1 on observations)."""
    turns: list[tuple[str, int, int]] = field(default_factory=list)
    """("policy" | "observation", start, end) spans of `ids`, one per turn or observation."""
    reward: float = 0.0
    """The last reward the environment gave (the episode's score)."""
    done: bool = False
    """The environment ended the episode."""
    truncated: bool = False
    """A limit ended it instead (turns, tokens, or a turn cut at `turn_tokens`)."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0

    def add_policy(self, ids: Sequence[int], logps: Sequence[float],
                   versions: Sequence[int], *, continues: bool = False) -> None:
        """Append generated tokens. `continues`: they extend the last policy turn (a turn
        generated in segments, around a weight update) instead of starting a new one."""
        if not (len(ids) == len(logps) == len(versions)):
            raise ValueError(f"a policy segment needs one log-prob and one version per "
                             f"token: {len(ids)} ids, {len(logps)} log-probs, "
                             f"{len(versions)} versions")
        start = len(self.ids)
        self.ids += [int(t) for t in ids]
        self.action += [1] * len(ids)
        self.logp += [float(x) for x in logps]
        self.version += [int(v) for v in versions]
        if continues and self.turns and self.turns[-1][0] == "policy":
            kind, first, _ = self.turns[-1]
            self.turns[-1] = (kind, first, len(self.ids))
        else:
            self.turns.append(("policy", start, len(self.ids)))

    def add_observation(self, ids: Sequence[int]) -> None:
        """Append the environment's tokens (context only: action 0, no log-prob)."""
        if not ids:
            return
        start = len(self.ids)
        self.ids += [int(t) for t in ids]
        self.action += [0] * len(ids)
        self.logp += [0.0] * len(ids)
        self.version += [-1] * len(ids)
        self.turns.append(("observation", start, len(self.ids)))

    @property
    def context(self) -> list[int]:
        """What the engine continues from: prompt, then every response id so far."""
        return [*self.prompt, *self.ids]

    @property
    def policy_turns(self) -> int:
        """How many policy turns the episode has."""
        return sum(kind == "policy" for kind, _, _ in self.turns)

    def oldest_version(self) -> int | None:
        """The oldest weight version among the policy tokens (None without any): the
        trajectory's staleness is measured from it."""
        versions = [v for v, a in zip(self.version, self.action, strict=True) if a]
        return min(versions) if versions else None


def trajectory_columns(trajectories: Sequence[Trajectory]) -> tuple[dict[str, Packed],
                                                                   dict[str, torch.Tensor]]:
    """The batch columns of a list of trajectories, in order: packed "response",
    "rollout_logp" (float32), "action_mask" and "token_version" (int64); per-sample scalars
    "score" (float32), "truncated", "turns", "tool_calls", "tool_errors" (int64).

    Example:
        >>> t = Trajectory(prompt=(5, 6))
        >>> t.add_policy([7, 8], [-0.5, -0.25], [3, 3]); t.add_observation([9])
        >>> packed, scalars = trajectory_columns([t])
        >>> packed["action_mask"].row(0).tolist(), packed["token_version"].row(0).tolist()
        ([1, 1, 0], [3, 3, -1])
    """
    def rows(name: str, dtype: torch.dtype) -> Packed:
        return Packed.from_rows([torch.tensor(getattr(t, name), dtype=dtype)
                                 for t in trajectories])

    packed = {"response": rows("ids", torch.int64), "rollout_logp": rows("logp", torch.float32),
              "action_mask": rows("action", torch.int64),
              "token_version": rows("version", torch.int64)}

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    scalars = {"score": column([t.reward for t in trajectories], torch.float32),
               "truncated": column([int(t.truncated) for t in trajectories], torch.int64),
               "turns": column([t.policy_turns for t in trajectories], torch.int64),
               "tool_calls": column([t.tool_calls for t in trajectories], torch.int64),
               "tool_errors": column([t.tool_errors for t in trajectories], torch.int64)}
    return packed, scalars
