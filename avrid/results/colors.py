"""Chapter 3 — one colour per span name, the same in every picture of the course.

A phase that is blue in one chart and green in the next makes the reader re-learn the legend
every time. So colours are not handed out by position (the n-th name drawn gets the n-th
colour, which shifts as soon as a run has one phase fewer — GRPO has no ``values``), but by
name, once, here:

- **fixed colours** for the names the course draws: the trainer's phases (chapter 5), the
  driver's `run_shards` spans (plan, split, submit, wait, receive, merge), the worker spans of
  the course's workers (forward, forward_backward, optimizer) and every worker's call handling
  (unpack, pack). Most are matplotlib's ``tab20`` colours (the 4 left out, light blue, light
  orange, light purple and light grey, are each too close to one that is kept), the rest
  come from ``tab20c``, ``Set2`` and ``Dark2``. Every pair of fixed colours is at least
  `MIN_DISTANCE` apart in RGB, checked by the tests;
- **unknown names** get a colour from `UNKNOWN_COLORS`, picked by a stable hash of the name
  (CRC-32, not Python's `hash`, which changes between processes): the same name has the same
  colour in every run and every chart, whatever else is drawn. These 7 colours come from
  ``tab20b`` and keep `MIN_DISTANCE` from every fixed colour, so an unknown span never looks
  like a known phase. Two unknown names may share one (7 slots); the legend tells them apart.

The fixed assignment, and why (a family of related spans shares a hue family):

    generate        blue          the rollout, the biggest block of a step
    reward          olive         scoring the responses ...
    reward_model    sea green     ... and a learned reward model's forward passes
    old_logp        green         the actor's forward pass over the batch ...
    ref_logp        light green   ... and the reference model's: two log-prob passes
    values          purple        the critic's forward pass
    advantages      brown         driver-side maths (GAE or group normalisation)
    critic_update   pink          the critic's training
    actor_update    red           the actor's training ...
    forward_backward light red    ... and a worker's forward + backward inside an update
    optimizer       light pink    a worker's optimizer step
    weight_sync     cyan          trainer -> rollout engine (chapter 4)
    forward         light cyan    a worker's forward pass (chapter 3's example worker)
    plan            orange        the driver plans the dispatch (chapter 2) ...
    split           light olive   ... cuts the batch into shards ...
    submit          amber         ... calls every rank (the shards pickled into the calls) ...
    wait            grey          ... waits for every rank: not the driver's own work ...
    receive         teal          ... fetches their results ...
    merge           light brown   ... and merges them (chapter 3)
    unpack          salmon        a worker's handling of a call before its compute ...
    pack            lime          ... and after it, up to its result built

Colours are hex strings, which matplotlib takes anywhere a colour goes; this file does not
import matplotlib (a dev/notebook dependency).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from types import MappingProxyType

SPAN_COLORS: Mapping[str, str] = MappingProxyType({
    # chapter 5's phases, in the order a step runs them (tab20 index in the comment)
    "generate": "#1f77b4",          # 0  blue
    "reward": "#bcbd22",            # 16 olive
    "reward_model": "#1b9e77",      # Dark2 0: sea green
    "old_logp": "#2ca02c",          # 4  green
    "ref_logp": "#98df8a",          # 5  light green
    "values": "#9467bd",            # 8  purple
    "advantages": "#8c564b",        # 10 brown
    "critic_update": "#e377c2",     # 12 pink
    "actor_update": "#d62728",      # 6  red
    "weight_sync": "#17becf",       # 18 cyan
    # chapter 6's: the trainer waiting for its batch, and the push to the rollout pool
    "wait_rollout": "#c7c7c7",      # 15 light grey: the trainer idle, waiting
    "weight_push": "#6baed6",       # tab20c 2: a blue beside weight_sync's cyan
    # worker spans
    "forward": "#9edae5",           # 19 light cyan
    "forward_backward": "#ff9896",  # 7  light red
    "optimizer": "#f7b6d2",         # 13 light pink
    # the driver's run_shards spans
    "plan": "#ff7f0e",              # 2  orange
    "split": "#dbdb8d",             # 17 light olive
    "submit": "#e6ab02",            # Dark2 5: amber
    "wait": "#7f7f7f",              # 14 grey
    "receive": "#66c2a5",           # Set2 0: teal
    "merge": "#c49c94",             # 11 light brown
    # a worker's handling of a call around its compute spans (ResultBuilder adds them)
    "unpack": "#fc8d62",            # Set2 1: salmon
    "pack": "#a6d854",              # Set2 4: lime
})
"""Name -> colour of every name the course draws; see the module docstring for the choice."""

UNKNOWN_COLORS: tuple[str, ...] = (
    "#393b79", "#5254a3", "#9c9ede",  # tab20b 0, 1, 3: navy, indigo, lavender
    "#637939", "#8ca252",             # tab20b 4, 5: moss, sage
    "#e7ba52",                        # tab20b 10: mustard
    "#d6616b",                        # tab20b 14: rose
)
"""Colours for names not in `SPAN_COLORS`, each at least `MIN_DISTANCE` from every fixed one."""

MIN_DISTANCE = 0.2
"""Smallest Euclidean distance in RGB (each channel 0..1) between two fixed colours, and
between an unknown-name colour and a fixed one (about 50 steps of 255 on one channel)."""


def span_color(name: str) -> str:
    """The colour of spans (or phases) called `name`: fixed for known names, else a stable
    hash of the name into `UNKNOWN_COLORS`.

    Example:
        >>> span_color("generate"), span_color("wait")
        ('#1f77b4', '#7f7f7f')
        >>> span_color("my_phase") in UNKNOWN_COLORS   # the same colour in every run
        True
    """
    fixed = SPAN_COLORS.get(name)
    if fixed is not None:
        return fixed
    return UNKNOWN_COLORS[zlib.crc32(name.encode()) % len(UNKNOWN_COLORS)]


def legend_order(names: Iterable[str]) -> list[str]:
    """`names` without repeats in the order a legend lists them: known names in the order of
    `SPAN_COLORS` (a step's phases as they run, then worker spans, then the driver's calls),
    then unknown names alphabetically. The same names always give the same legend.

    Example:
        >>> legend_order(["wait", "zeta", "generate", "alpha", "wait"])
        ['generate', 'wait', 'alpha', 'zeta']
    """
    found = set(names)
    return [n for n in SPAN_COLORS if n in found] + sorted(found - SPAN_COLORS.keys())


def rgb(color: str) -> tuple[float, float, float]:
    """A ``#rrggbb`` colour as (r, g, b) in 0..1, to measure distances without matplotlib.

    Example:
        >>> rgb("#ff8000")
        (1.0, 0.5019607843137255, 0.0)
    """
    return (int(color[1:3], 16) / 255, int(color[3:5], 16) / 255, int(color[5:7], 16) / 255)
