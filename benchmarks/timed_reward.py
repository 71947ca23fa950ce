"""Benchmark helper — a reward function of known cost, for `bench_stream_rewards.py`.

A plain reward module like ``chapters/ch05_ppo/data/pairs_reward.py`` (no avrid import):
``--set task.reward=benchmarks/timed_reward.py:score``. Each call sleeps
``AVRID_BENCH_REWARD_MS`` milliseconds (default 5: a small sandboxed check, a regex over a
long answer), then scores the digit task's answer letter by letter and logs the response's
length as ``reward/length``. The sleep stands for work outside the interpreter (a sandbox,
a service): it holds no core, so the figures measure the orchestration, not CPU contention.
"""

import os
import time


def score(prompt: str, response: str, answer: str, **metadata: object) -> dict:
    """A share of one point per character of `answer` in its place, after the set delay."""
    time.sleep(float(os.environ.get("AVRID_BENCH_REWARD_MS", "5")) / 1000)
    right = sum(a == r for a, r in zip(answer, response, strict=False))
    return {"score": right / max(len(answer), 1), "length": float(len(response))}
