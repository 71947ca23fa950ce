"""Chapter 5 — a policy rank that hands out its responses as they finish (`rollout.stream_rewards`).

`PolicyWorker.generate` answers once its whole shard is generated, so the reward worker waits
for the step's slowest response (the long tail) before it scores the first. This rank
generates the very same samples, with the same engine call, and keeps each response the
moment the engine finishes it (the `on_finish` of `TorchEngine.generate` and of
`VllmEngine.generate`, which then steps vLLM's engine itself); the driver asks for them
on a lane of their own (`Worker.lanes`: `take_finished` runs beside the `generate_streamed`
still going on the default lane) and sends each handful to the reward worker at once
(`driver/reward_stream.py`):

    driver                          default lane                       "stream" lane
    generate_streamed(shard, k) ──► decoding ... rows 3, 7 stop ──► kept
    take_finished(k) ─────────────────────────────────────────────► [3, 7] ──► reward.score
    take_finished(k) ─────────────────────────────────────────────► waits for the next
    ...                             returns (the rest stop) ──────► the rest, last=True

Only token ids cross, never text: the reward decodes them as in the serial step, so a
sample's reward cannot depend on when it was scored. Not here: sending the responses to the
reward worker and putting their scores together (the driver's `reward_stream.py`); how an
engine knows a row is final (`torch_engine.py`, `vllm_stream.py`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from avrid.dispatch import Shard
from avrid.ppo.roles.policy import PolicyWorker
from avrid.results import WorkerResult
from avrid.workers import WorkerIdentity


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """The responses one rank finished since the driver last asked (`take_finished`)."""

    sample_ids: tuple[int, ...]
    responses: tuple[tuple[int, ...], ...]
    """Each sample's response token ids, as the engine generated them."""
    last: bool
    """The rank's generate call has ended (returned or raised): nothing more will come."""


@dataclass(slots=True)
class _Stream:
    """One generate call's finished responses not yet taken, and whether it has ended."""

    sample_ids: list[int] = field(default_factory=list)
    responses: list[tuple[int, ...]] = field(default_factory=list)
    ended: bool = False


class FinishedResponses:
    """Responses handed from the generating thread to the asking one, by stream key (the
    driver numbers its generate calls). Either side may come first: the driver's first
    question can reach the rank before its generate call starts."""

    def __init__(self) -> None:
        self._changed = threading.Condition()  # guards _streams; woken at each put and end
        self._streams: dict[int, _Stream] = {}

    def put(self, key: int, sample_id: int, response: tuple[int, ...]) -> None:
        """One finished response of stream `key`."""
        with self._changed:
            stream = self._streams.setdefault(key, _Stream())
            stream.sample_ids.append(sample_id)
            stream.responses.append(response)
            self._changed.notify_all()

    def end(self, key: int) -> None:
        """Stream `key`'s generate call has ended (returned or raised)."""
        with self._changed:
            self._streams.setdefault(key, _Stream()).ended = True
            self._changed.notify_all()

    def take(self, key: int, wait_s: float, gather_s: float = 0.0) -> Finished:
        """What stream `key` finished since the last take: as soon as something is there
        (at most after `wait_s`), and then up to `gather_s` more of what finishes meanwhile
        (one reward call for a handful, not one each); at once when the call has ended."""
        with self._changed:
            stream = self._streams.setdefault(key, _Stream())
            self._changed.wait_for(lambda: stream.sample_ids or stream.ended, timeout=wait_s)
            if stream.sample_ids and gather_s > 0:
                self._changed.wait_for(lambda: stream.ended, timeout=gather_s)
            out = Finished(sample_ids=tuple(stream.sample_ids),
                           responses=tuple(stream.responses), last=stream.ended)
            stream.sample_ids, stream.responses = [], []
            if stream.ended:  # told: the stream is over for both sides
                del self._streams[key]
            return out


class StreamingPolicyWorker(PolicyWorker):
    """`PolicyWorker` whose generation can be read as it goes (module docstring); every
    other method is the policy's own. The trainer starts this class only with
    ``rollout.stream_rewards`` (its lane makes each Ray actor a threaded one)."""

    lanes = {"take_finished": "stream"}

    def __init__(self, identity: WorkerIdentity, **kwargs: Any) -> None:
        super().__init__(identity, **kwargs)
        self.finished = FinishedResponses()

    def generate_streamed(self, shard: Shard, *, stream: int, max_new_tokens: int,
                          greedy: bool, seed: int) -> WorkerResult:
        """`PolicyWorker.generate` (the same samples, the same result), keeping each
        response for `take_finished(stream)` as soon as the engine finishes it."""
        ids = shard.batch.sample_ids.tolist()
        try:
            return self._generate(
                shard, max_new_tokens=max_new_tokens, greedy=greedy, seed=seed,
                on_finish=lambda i, done: self.finished.put(stream, ids[i], done.token_ids))
        finally:  # raised or returned, the driver's questions must end
            self.finished.end(stream)

    def take_finished(self, stream: int, *, wait_s: float, gather_s: float = 0.0) -> Finished:
        """The responses `generate_streamed(stream)` finished since the last call (on the
        "stream" lane, beside it): `FinishedResponses.take`'s timing."""
        return self.finished.take(stream, wait_s, gather_s)
