"""Pictures: one span name, one colour, in every chart; the driver's row says own work vs
waiting; chapter 4 draws its transfer plan. All built without Ray, in well under a second
each (the figures are never rendered, only their artists read back)."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from avrid.ppo.outputs.plots import PHASES, phase_figure
from avrid.reshard import ModelLayout, decoder_tp_layout, plan_transfer
from avrid.reshard.tp_layout import decoder_shapes
from avrid.results.colors import MIN_DISTANCE, SPAN_COLORS, UNKNOWN_COLORS, rgb, span_color
from avrid.results.result import RESULT_VERSION, Span, WorkerResult
from avrid.results.timeline import Timeline
from avrid.workers import WorkerIdentity
from chapters.ch04_resharding.figure import (
    naive_matrix,
    planned_matrix,
    save_transfer_figure,
    transfer_figure,
)
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(3)

T0 = 1_700_000_000.0
GRPO_PHASES = [p for p in PHASES if p not in ("ref_logp", "values", "critic_update")]
DRIVER_CALLS = ("plan", "split", "submit", "wait", "receive", "merge")
WORKER_HANDLING = ("unpack", "pack")


def rows(phases: list[str], steps: int = 3) -> list[dict]:
    """metrics.jsonl rows with a time/<phase> for each of `phases`."""
    return [{"step": s, **{f"time/{p}": 1.0 + i for i, p in enumerate(phases)},
             "time/step": 2.0 * len(phases)} for s in range(1, steps + 1)]


def phase_colours(fig: Figure) -> dict[str, str]:
    """Phase -> colour from `phase_figure`'s bars and, checked equal, its legend handles."""
    ax = fig.axes[0]
    legend = {t.get_text().split()[0]: to_hex(h.get_facecolor())
              for t, h in zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles,
                              strict=True) if t.get_text() != "time/step"}
    bars = {}
    for name, container in zip(legend, ax.containers, strict=True):  # one bar() per phase
        (colour,) = {to_hex(p.get_facecolor()) for p in container.patches}
        bars[name] = colour
    assert bars == legend
    return legend


def worker(role: str, rank: int, *spans: tuple[str, float, float]) -> WorkerResult:
    return WorkerResult(
        version=RESULT_VERSION, identity=WorkerIdentity(role=role, rank=rank, world_size=2),
        sample_ids=torch.tensor([rank]), outputs=None, metrics=(),
        spans=tuple(Span(name=n, start=T0 + a, end=T0 + b) for n, a, b in spans))


def spans(*triples: tuple[str, float, float]) -> list[Span]:
    return [Span(name=n, start=T0 + a, end=T0 + b) for n, a, b in triples]


def step_timeline(phases: list[str], extra: str | None = None) -> Timeline:
    """One step: the driver runs every phase, one run_shards call inside each; the actor
    records a span named after the phase (plus `extra`, an unknown name)."""
    driver, work = [], []
    for i, p in enumerate(phases):
        a = 10.0 * i
        driver += spans((p, a, a + 9), ("plan", a, a + 1), ("split", a + 1, a + 1.5),
                        ("submit", a + 1.5, a + 2), ("wait", a + 2, a + 8),
                        ("receive", a + 8, a + 8.5), ("merge", a + 8.5, a + 9))
        work += [("unpack", a + 2.2, a + 2.5), (p, a + 2.5, a + 7.5), ("pack", a + 7.5, a + 7.8)]
    if extra:
        work.append((extra, 0.0, 1.0))
    return Timeline.from_results([worker("actor", 0, *work)], driver_spans=driver)


def gantt_colours(tl: Timeline) -> dict[str, str]:
    """Span name -> colour from the Gantt chart's legend; every drawn bar (but the grey
    underlay) has one of these colours, and each span's bar has its own name's colour."""
    fig = tl.gantt_figure()
    legend = {t.get_text(): to_hex(h.get_facecolor())
              for t, h in zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles,
                              strict=True)}
    underlay = to_hex("0.93")
    drawn = [to_hex(p.get_facecolor()) for p in fig.axes[0].patches]
    expected = []  # bars are drawn lane by lane: underlay, then each span in lane order
    for lane in tl.lanes:
        expected += [underlay] + [legend[s.name] for s in lane.spans]
    assert drawn == expected
    return legend


def test_a_phase_has_one_colour_in_every_chart_ppo_and_grpo() -> None:
    ppo, grpo = phase_colours(phase_figure(rows(list(PHASES)))), phase_colours(
        phase_figure(rows(GRPO_PHASES)))
    assert list(ppo) == list(PHASES) and list(grpo) == GRPO_PHASES
    assert all(grpo[p] == ppo[p] for p in GRPO_PHASES)  # no shift when GRPO drops 3 phases
    assert ppo == {p: span_color(p) for p in PHASES}
    for phases, bars in ((list(PHASES), ppo), (GRPO_PHASES, grpo)):
        gantt = gantt_colours(step_timeline(phases))
        assert set(gantt) == set(phases) | set(DRIVER_CALLS) | set(WORKER_HANDLING)
        assert all(gantt[p] == bars[p] for p in phases)  # phases.png == timeline.png
        assert all(gantt[c] == SPAN_COLORS[c] for c in DRIVER_CALLS + WORKER_HANDLING)
    assert len(set(ppo.values())) == len(PHASES)


def test_fixed_colours_are_pairwise_distinct_and_unknown_names_avoid_them() -> None:
    fixed = dict(SPAN_COLORS)
    assert set(PHASES) | set(DRIVER_CALLS) | set(WORKER_HANDLING) \
        | {"forward", "forward_backward", "optimizer"} <= fixed.keys()
    for (a, ca), (b, cb) in itertools.combinations(fixed.items(), 2):
        assert math.dist(rgb(ca), rgb(cb)) >= MIN_DISTANCE, (a, ca, b, cb)
    for u, c in itertools.product(UNKNOWN_COLORS, fixed.values()):
        assert math.dist(rgb(u), rgb(c)) >= MIN_DISTANCE, (u, c)
    for name in ("step", "update", "my_new_phase", "score"):
        assert span_color(name) == span_color(name) in UNKNOWN_COLORS
        assert span_color(name) not in fixed.values()


def test_an_unknown_name_keeps_its_colour_whatever_else_is_drawn() -> None:
    few = gantt_colours(step_timeline(["generate"], extra="mystery"))
    many = gantt_colours(step_timeline(list(PHASES), extra="mystery"))
    assert few["mystery"] == many["mystery"] == span_color("mystery")
    # ... and across processes: not Python's per-process salted hash(). Loads the one file
    # alone (no torch import), under two different hash seeds.
    path = Path(__file__).resolve().parents[1] / "avrid" / "results" / "colors.py"
    code = (f"import importlib.util as u; s = u.spec_from_file_location('c', {str(path)!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            "print(m.span_color('mystery'))")
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env=child_env(PYTHONHASHSEED=seed)
                           ).stdout.strip() for seed in ("1", "2")}
    assert seen == {span_color("mystery")}


def test_the_driver_row_says_own_work_and_waiting() -> None:
    # Window 0-5 s. Driver: generate 0-4 holding plan 0.25 + split 0.25 + wait 3.0 + merge 0.5,
    # then advantages 4-4.5, nothing 4.5-5: own work 1.5 s (30%), waiting 3.0 s (60%).
    tl = Timeline.from_results(
        [worker("actor", 0, ("generate", 0.5, 3.4), ("forward_backward", 4.5, 5.0))],
        driver_spans=spans(("generate", 0.0, 4.0), ("plan", 0.0, 0.25), ("split", 0.25, 0.5),
                           ("wait", 0.5, 3.5), ("merge", 3.5, 4.0), ("advantages", 4.0, 4.5)))
    u = tl.utilization()
    assert u["driver"].busy == pytest.approx(4.5) and u["driver"].waiting == pytest.approx(3.0)
    assert (u["driver"].own_share, u["driver"].wait_share) == (pytest.approx(0.3),
                                                              pytest.approx(0.6))
    assert u["actor[0]"].waiting == 0.0 and u["actor[0]"].share == pytest.approx(0.68)
    labels = [t.get_text() for t in tl.gantt_figure().axes[0].get_yticklabels()]
    assert labels == ["driver  own work 30%, waiting 60%", "actor[0]  busy 68%"]
    text = tl.describe().splitlines()
    assert text[1].split() == ["lane", "own", "work", "s", "waiting", "s", "idle", "s", "own",
                               "work", "%", "waiting", "%"]
    assert text[2].split() == ["driver", "1.500", "3.000", "0.500", "30.0%", "60.0%"]
    assert text[3].split() == ["lane", "busy", "s", "idle", "s", "busy", "%"]
    assert text[4].split() == ["actor[0]", "3.400", "1.600", "68.0%"]


def test_chapter4_draws_who_sends_what_next_to_the_all_gather(tmp_path: Path) -> None:
    shapes = decoder_shapes(layers=1, hidden=8, intermediate=16, heads=2, kv_heads=1,
                            vocab=64)
    plan = plan_transfer(ModelLayout.fsdp(shapes, 4), decoder_tp_layout(shapes, 2),
                         same_process={0: 0, 1: 1}, bucket_bytes=1024)
    fig = transfer_figure(plan)
    assert isinstance(fig, Figure)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 1 + 2 + 2  # source layout, one per target rank, two heatmaps
    assert titles[0].startswith("source: FSDP over 4")
    assert [t.split("\n")[0] for t in titles[1:3]] == ["target t0 needs [0:8, 0:4]",
                                                       "target t1 needs [0:8, 4:8]"]
    assert titles[3].startswith("planned") and titles[4].startswith("all-gather")
    planned, naive = planned_matrix(plan), naive_matrix(plan)
    assert planned.sum() == plan.bytes_moved and naive.sum() == plan.bytes_naive
    assert (fig.axes[3].images[0].get_array() == planned).all()
    assert (fig.axes[4].images[0].get_array() == naive).all()
    # Every element a target needs is coloured by a source rank, nothing else is.
    o_proj = plan.target["model.layers.0.self_attn.o_proj.weight"]
    for t in range(2):
        img = fig.axes[1 + t].images[0].get_array()
        need = o_proj.regions[t]
        assert (~img.mask).sum() == need.numel and (~img.mask[need.to_slices()]).all()
    path = save_transfer_figure(plan, tmp_path / "ch04" / "transfer.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in path.parent.iterdir()] == ["transfer.png"]  # atomic: no temp left


def test_chapter6_stacks_timelines_on_one_time_scale(tmp_path: Path) -> None:
    from chapters.ch06_async.figure import save_timelines_figure, timelines_figure

    sync = Timeline.from_results(
        [worker("policy", 0, ("generate", 0, 2), ("forward_backward", 2, 4))],
        driver_spans=spans(("generate", 0, 2), ("plan", 0, 0.1), ("actor_update", 2, 4)))
    off = Timeline.from_results(
        [worker("policy", 0, ("forward_backward", 0, 2)), worker("rollout", 0, ("generate", 0, 2))],
        driver_spans=spans(("actor_update", 0, 2), ("weight_push", 2, 2.2)))
    fig = timelines_figure({"sync": sync, "one_step_off": off})
    top, bottom = fig.axes[:2]
    assert [t.get_text() for t in top.get_yticklabels()] == ["driver (phases)", "policy[0]"]
    assert [t.get_text() for t in bottom.get_yticklabels()] == [
        "driver (phases)", "policy[0]", "rollout[0]"]
    assert top.get_xlim() == bottom.get_xlim() == (0.0, 4.0)  # one scale: the longer one
    # The driver row shows phases only (no plan/split/submit/wait/receive/merge), each in its
    # own colour.
    drawn = {to_hex(p.get_facecolor()) for p in bottom.patches}
    assert {span_color("weight_push"), span_color("generate")} <= drawn
    assert span_color("plan") not in {to_hex(p.get_facecolor()) for p in top.patches}
    path = save_timelines_figure({"a": sync, "b": off}, tmp_path / "t.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
