"""Chapter 6 — how much of a step generation and training ran at the same time.

`overlap_fraction` reads it off a step's timeline: the length of the time in which some
rollout rank was generating AND some trainer rank (policy, critic, reward) was computing,
within the step's window, divided by the window. 0 for the synchronous loop, where they take
turns; close to min(generation, training) / step when one hides behind the other.

Pure interval arithmetic on (start, end) pairs; nothing here knows workers or steps.
"""

from __future__ import annotations

from collections.abc import Iterable


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint, sorted intervals covering the same time as `intervals`.

        >>> union([(3, 4), (0, 2), (1, 2.5)])
        [(0, 2.5), (3, 4)]
    """
    out: list[tuple[float, float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap_seconds(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]],
                    window: tuple[float, float]) -> float:
    """Seconds inside `window` covered by both `a` and `b`.

        >>> overlap_seconds([(0, 3)], [(2, 5), (6, 7)], window=(1, 10))
        1.0
    """
    lo, hi = window
    total = 0.0
    for s1, e1 in union(a):
        for s2, e2 in union(b):
            total += max(0.0, min(e1, e2, hi) - max(s1, s2, lo))
    return float(total)


def overlap_fraction(generation: Iterable[tuple[float, float]],
                     training: Iterable[tuple[float, float]],
                     window: tuple[float, float]) -> float:
    """The share of `window` in which generation and training both ran (0 for an empty
    window)."""
    length = window[1] - window[0]
    return overlap_seconds(generation, training, window) / length if length > 0 else 0.0
