"""Chapter 5 — the step as a graph: which phase waits for which, and why.

`Trainer.train_step` runs its phases one after another (`trainer.py`'s docstring lists them).
Most of that order is forced, some is not: the critic's values need only the tokens, so they
could run while the policy computes its log-probs. This file says which is which. Each phase
is declared as data (`StepPhase`): the worker group its ranks run on, the batch columns it
reads — the ``*_READS`` each worker already declares next to its method — and the columns it
adds (the ``*_WRITES`` beside them). The edges are derived, never written by hand
(`build_graph`), from two rules:

1. data: a phase waits for the latest earlier phase that writes each column it reads;
2. order: calls to one worker group run in order on its ranks (a rank runs one call at a
   time, chapter 1), so a group's consecutive phases are chained — unless the worker puts
   the method on a lane of its own (`Worker.lanes`), then only the phases of one lane are.

The driver is no worker group: its phases (advantages, resample, combine_scores) are
functions of their columns and wait for data alone. A phase that reads a column no earlier
phase writes is refused when the graph is built, naming the phase, the column and what each
phase writes — a step that would fail (or read a stale column) at its tenth minute fails now.

`StepGraph.ready` is the question a concurrent controller asks (issue the phases whose
predecessors are done); `text` is what ``avrid ppo --print-graph`` prints, and
`step_graph_figure.py` draws it (and holds `print_graph`, the command's whole output).
Not here: running the phases (the trainer does), what they cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from avrid.ppo.data.credit import advantages_reads, advantages_writes
from avrid.ppo.data.prompts import PROMPT_COLUMNS
from avrid.ppo.roles.critic import CRITIC_UPDATE_READS, VALUES_READS, VALUES_WRITES, CriticWorker
from avrid.ppo.roles.generation import GENERATE_WRITES
from avrid.ppo.roles.policy import (
    LOGPROBS_READS,
    LOGPROBS_WRITES,
    REF_LOGPROBS_WRITES,
    PolicyWorker,
    actor_update_reads,
)
from avrid.ppo.roles.reference import ReferenceWorker
from avrid.ppo.roles.reward import SCORE_READS, SCORE_WRITES, RewardWorker
from avrid.ppo.roles.reward_model import MODEL_SCORE_WRITES, RewardModelWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.workers.worker import check_lanes

DRIVER = "driver"
"""The group of the phases the driver computes itself (no worker, no order rule)."""

GROUPS = ("policy", "reference", "critic", "reward", "reward_model", DRIVER)
"""Every group a phase may run on, in the order they are listed and drawn."""


@dataclass(frozen=True)
class StepPhase:
    """One phase of a step, as data: where it runs, what it reads and what it adds."""

    name: str
    """The phase's name, as on the timeline (`time/<name>` in the metrics)."""
    group: str
    """The worker group whose ranks run it (`GROUPS`), or `DRIVER`."""
    reads: tuple[str, ...] = ()
    """The batch columns it needs (besides the optional "action_mask": `columns.reads`)."""
    writes: tuple[str, ...] = ()
    """The batch columns it adds (or, for resample, replaces)."""
    model: str = ""
    """Which model of the group it uses, for people (the reference may be the actor with
    its LoRA adapters off: the same group, the same ranks)."""
    lane: str = "default"
    """The group's lane its method runs on (`Worker.lanes`); phases on other lanes of the
    same group are not ordered against it."""
    also_on: tuple[str, ...] = ()
    """Further groups it calls (resample generates and scores more rounds)."""
    timed: bool = True
    """Whether the trainer times it as a phase of its own; combine_scores is a few driver
    tensor operations inside `scoring.score_batch`, timed with nothing."""

    @property
    def groups(self) -> tuple[str, ...]:
        """Every group the phase occupies: its own, then `also_on`."""
        return (self.group, *self.also_on)


@dataclass(frozen=True)
class Edge:
    """`after` waits for `before`: for the `columns` it reads that `before` wrote, and/or
    because both run, in that order, on the ranks of `group`."""

    before: str
    after: str
    columns: tuple[str, ...] = ()
    group: str | None = None

    def reason(self) -> str:
        """Why the edge exists, in words: "tokens, score; policy order"."""
        why = [", ".join(self.columns)] if self.columns else []
        return "; ".join(why + ([f"{self.group} order"] if self.group else []))


class GraphError(ValueError):
    """A phase list that cannot run: a column read before any phase writes it, or a name
    used twice."""


@dataclass(frozen=True)
class StepGraph:
    """A step's phases in the order the serial trainer issues them (a topological order:
    every edge goes forward) and the edges between them."""

    phases: tuple[StepPhase, ...]
    edges: tuple[Edge, ...]

    def names(self) -> tuple[str, ...]:
        """The phases' names, in order."""
        return tuple(p.name for p in self.phases)

    def phase(self, name: str) -> StepPhase:
        """The phase called `name`."""
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"no phase {name!r} in this step; phases: {', '.join(self.names())}")

    def pairs(self) -> set[tuple[str, str]]:
        """Every edge as (before, after)."""
        return {(e.before, e.after) for e in self.edges}

    def waits_for(self, name: str) -> tuple[str, ...]:
        """The phases `name` waits for, in order."""
        return tuple(e.before for e in self.edges if e.after == name)

    def ready(self, done: Iterable[str]) -> tuple[str, ...]:
        """The phases not in `done` whose every predecessor is: what a controller may issue
        now, together. No two of them share a worker group's lane: the order rule chains
        those, so one is always still waiting for the other."""
        finished = set(done)
        return tuple(p.name for p in self.phases if p.name not in finished
                     and all(b in finished for b in self.waits_for(p.name)))

    def depths(self) -> dict[str, int]:
        """Each phase's depth: the most edges on a path from a phase that waits for none
        (the figure's columns: phases of one depth could run at once)."""
        depth: dict[str, int] = {}
        for p in self.phases:  # in order, so every predecessor already has its depth
            depth[p.name] = max((depth[b] + 1 for b in self.waits_for(p.name)), default=0)
        return depth

    def text(self) -> str:
        """The graph as text: each phase with its group, reads, writes and what it waits
        for (and why), in order. What ``avrid ppo --print-graph`` prints."""
        lines = []
        for p in self.phases:
            where = p.group + "".join(f" + {g}" for g in p.also_on)
            model = f" ({p.model})" if p.model else ""
            lane = f", lane {p.lane}" if p.lane != "default" else ""
            untimed = "  [not timed: inside the phase before]" if not p.timed else ""
            lines.append(f"{p.name:<15} on {where}{model}{lane}{untimed}")
            lines.append(f"    reads      {', '.join(p.reads) or '-'}")
            lines.append(f"    writes     {', '.join(p.writes) or '-'}")
            waits = [f"{e.before} ({e.reason()})" for e in self.edges if e.after == p.name]
            lines.append(f"    waits for  {', '.join(waits) or '-'}")
        return "\n".join(lines) + "\n"


def build_graph(phases: Sequence[StepPhase]) -> StepGraph:
    """The graph of `phases` (in the order they are issued), its edges derived from the
    module docstring's two rules; raises `GraphError` for a column read before it is
    written, naming the phase, the column and what each phase writes."""
    names = [p.name for p in phases]
    for name in names:
        if names.count(name) > 1:
            raise GraphError(f"step graph: two phases are called {name!r}; each phase needs a "
                             f"name of its own (phases: {', '.join(names)})")
    writer: dict[str, str] = {}  # column -> the latest phase so far that writes it
    last: dict[tuple[str, str], str] = {}  # (group, lane) -> its latest phase so far
    edges: list[Edge] = []
    for p in phases:
        columns: dict[str, list[str]] = {}  # predecessor -> the columns read from it
        for column in p.reads:
            if column not in writer:
                raise GraphError(_unwritten(p, column, phases))
            columns.setdefault(writer[column], []).append(column)
        order: dict[str, str] = {}  # predecessor -> the group whose order chains them
        for g in p.groups:
            if g == DRIVER:
                continue
            key = (g, p.lane if g == p.group else "default")
            if key in last:
                order.setdefault(last[key], g)
            last[key] = p.name
        for before in [n for n in names if n in columns or n in order]:  # in phase order
            edges.append(Edge(before, p.name, tuple(columns.get(before, ())),
                              order.get(before)))
        writer.update((column, p.name) for column in p.writes)
    return StepGraph(tuple(phases), tuple(edges))


def _unwritten(phase: StepPhase, column: str, phases: Sequence[StepPhase]) -> str:
    """`GraphError`'s message for `phase` reading `column` before any phase writes it."""
    later = [p.name for p in phases if column in p.writes]
    when = (f"only {', '.join(later)} writes it, which runs later" if later
            else "no phase writes it")
    written = "; ".join(f"{p.name}: {', '.join(p.writes) or '-'}" for p in phases)
    return (f"step graph: phase {phase.name!r} reads column {column!r}, but {when}. "
            f"What each phase writes: {written}")


def _lane(worker: type, method: str) -> str:
    """The lane `worker` runs `method` on (`Worker.lanes`; "default" when it names none)."""
    return check_lanes(worker).get(method, "default")


def step_phases(config: PPOConfig, *, updates_actor: bool = True) -> tuple[StepPhase, ...]:
    """The phases `Trainer.train_step` runs under `config`, in its order, as data;
    `updates_actor=False`: a step of the critic's warm-up (no actor update, no sync)."""
    if config.pipeline.disaggregated:
        raise ValueError(f"the step graph is the synchronous loop's (pipeline.mode='sync'); "
                         f"pipeline.mode={config.pipeline.mode!r} generates on a rollout pool "
                         f"of its own (chapter 6), which it does not draw yet")
    return _phases(config, updates_actor)


def learn_graph(config: PPOConfig, *, updates_actor: bool = True) -> StepGraph:
    """The graph the concurrent controller (`concurrent.py`) runs `Trainer.learn` by: the
    step's, in every pipeline mode (chapter 6's learner runs the same phases on the batch
    its rollout pool generated, which stands for the generate phase here)."""
    return build_graph(_phases(config, updates_actor))


def _phases(config: PPOConfig, updates_actor: bool) -> tuple[StepPhase, ...]:
    """`step_phases` without its check of the pipeline mode."""
    a, rm = config.algo, config.reward_model
    generated = PROMPT_COLUMNS + GENERATE_WRITES
    out = [StepPhase("generate", "policy", (), generated, "actor's rollout engine",
                     _lane(PolicyWorker, "generate"))]
    # The score: the rule reward alone, or the rule's and the reward model's, each its own
    # phase on its own group, weighed on the driver (`scoring.score_batch`).
    if not rm.enabled:
        scoring = [StepPhase("reward", "reward", SCORE_READS, SCORE_WRITES, "task reward",
                             _lane(RewardWorker, "score"))]
    else:
        parts = [StepPhase("reward_model", "reward_model", SCORE_READS, MODEL_SCORE_WRITES,
                           "reward model", _lane(RewardModelWorker, "score"))]
        if rm.rule_weight != 0:  # weight 0: the rule reward is not computed at all
            parts.insert(0, StepPhase("reward", "reward", SCORE_READS, ("rule_score",),
                                      "task reward", _lane(RewardWorker, "score")))
        combine = StepPhase("combine_scores", DRIVER,
                            tuple(c for p in parts for c in p.writes), SCORE_WRITES,
                            "rule_weight x rule_score + weight x model_score", timed=False)
        scoring = [*parts, combine]
    out += scoring
    if a.dynamic_sampling:
        # DAPO: drop the groups whose scores are all alike, generate and score more rounds;
        # it rewrites every row, so whatever follows reads its batch, not generate's.
        rewritten = generated + tuple(c for p in scoring for c in p.writes)
        out.append(StepPhase("resample", DRIVER, ("score", "truncated", "group"), rewritten,
                             "dynamic sampling", also_on=tuple(
                                 dict.fromkeys(g for p in [out[0], *scoring]
                                               for g in p.groups if g != DRIVER))))
    out.append(StepPhase("old_logp", "policy", LOGPROBS_READS, LOGPROBS_WRITES, "actor",
                         _lane(PolicyWorker, "compute_logprobs")))
    if a.kl_coef > 0 and config.placement.reference == "pool":  # ranks of its own
        out.append(StepPhase("ref_logp", "reference", LOGPROBS_READS, REF_LOGPROBS_WRITES,
                             "reference, base weights" if config.lora.enabled else "reference",
                             _lane(ReferenceWorker, "compute_logprobs")))
    elif a.kl_coef > 0:  # with LoRA the reference is the actor with its adapters off
        out.append(StepPhase("ref_logp", "policy", LOGPROBS_READS, REF_LOGPROBS_WRITES,
                             "actor, adapters off" if config.lora.enabled else "reference",
                             _lane(PolicyWorker, "compute_logprobs")))
    if a.uses_critic:
        out.append(StepPhase("values", "critic", VALUES_READS, VALUES_WRITES, "critic",
                             _lane(CriticWorker, "compute_values")))
    out.append(StepPhase("advantages", DRIVER, advantages_reads(config),
                         advantages_writes(config), f"{a.name} estimator"))
    if a.uses_critic:
        out.append(StepPhase("critic_update", "critic", CRITIC_UPDATE_READS, (), "critic",
                             _lane(CriticWorker, "update")))
    if updates_actor:
        actor = "actor's LoRA adapters" if config.lora.enabled else "actor"
        out.append(StepPhase("actor_update", "policy", actor_update_reads(config), (), actor,
                             _lane(PolicyWorker, "update")))
        # It reads no column: it waits for the update by the policy group's order.
        out.append(StepPhase("weight_sync", "policy", (), (), "actor -> rollout engine",
                             _lane(PolicyWorker, "sync_weights")))
    return tuple(out)


def step_graph(config: PPOConfig, *, updates_actor: bool = True) -> StepGraph:
    """The graph of a step of `config` (`step_phases`, then `build_graph`)."""
    return build_graph(step_phases(config, updates_actor=updates_actor))
