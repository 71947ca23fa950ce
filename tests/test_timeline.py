"""Chapter 3 — the timeline: trace JSON per worker, busy/idle shares, Gantt PNG, atomic writes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from avrid.results.result import RESULT_VERSION, Span, WorkerResult
from avrid.results.timeline import Lane, Timeline
from avrid.workers import WorkerIdentity

pytestmark = pytest.mark.chapter(3)

T0 = 1_700_000_000.0  # a realistic wall-clock origin: offsets must survive float arithmetic


def result(role: str, rank: int, world_size: int, *spans: tuple[str, float, float]
           ) -> WorkerResult:
    """A hand-built result whose spans are (name, start, end) in seconds after T0."""
    return WorkerResult(
        version=RESULT_VERSION,
        identity=WorkerIdentity(role=role, rank=rank, world_size=world_size),
        sample_ids=torch.tensor([rank], dtype=torch.int64), outputs=None, metrics=(),
        spans=tuple(Span(name=n, start=T0 + a, end=T0 + b) for n, a, b in spans))


def driver(*spans: tuple[str, float, float]) -> list[Span]:
    return [Span(name=n, start=T0 + a, end=T0 + b) for n, a, b in spans]


@pytest.fixture
def timeline() -> Timeline:
    """Driver 0-10 s; actor[0] busy 1-9 with nested micro-batches; actor[1] done at 4 s;
    critic[0] with two overlapping spans 2-6 and 4-8 (busy 6 s, not 8)."""
    results = [
        result("critic", 0, 1, ("values", 2.0, 6.0), ("update", 4.0, 8.0)),
        result("actor", 1, 2, ("update", 1.0, 4.0)),
        result("actor", 0, 2, ("update", 1.0, 9.0), ("fwd", 1.0, 3.0), ("fwd", 3.0, 5.0)),
    ]
    return Timeline.from_results(results, driver_spans=driver(("step", 0.0, 10.0)))


def test_lanes_ordered_driver_then_role_then_rank(timeline: Timeline) -> None:
    assert [lane.label for lane in timeline.lanes] == ["driver", "actor[0]", "actor[1]",
                                                       "critic[0]"]
    assert timeline.start == pytest.approx(T0)
    assert timeline.end == pytest.approx(T0 + 10.0)


def test_no_driver_lane_without_driver_spans() -> None:
    tl = Timeline.from_results([result("actor", 0, 1, ("update", 0.0, 1.0))])
    assert [lane.label for lane in tl.lanes] == ["actor[0]"]


def test_trace_file_is_valid_json_with_expected_events(timeline: Timeline,
                                                       tmp_path: Path) -> None:
    path = timeline.to_chrome_trace(tmp_path / "step.trace.json")
    with path.open() as f:
        trace = json.load(f)
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta
               if e["name"] == "thread_name"}
    assert sorted(processes.values()) == ["actor", "critic", "driver"]
    assert sorted(threads.values()) == ["actor[0]", "actor[1]", "critic[0]", "driver"]
    # Each worker's thread sits in its role's process.
    for (pid, _), label in threads.items():
        assert label.startswith(processes[pid])

    complete = [e for e in events if e["ph"] == "X"]
    per_lane = Counter(threads[(e["pid"], e["tid"])] for e in complete)
    assert per_lane == {"driver": 1, "actor[0]": 3, "actor[1]": 1, "critic[0]": 2}
    # Microseconds from the timeline start (T0 sits ~1.7e9 s away: float error stays < 1 us).
    dur = {(threads[(e["pid"], e["tid"])], e["name"], round(e["ts"])): e["dur"]
           for e in complete}
    assert dur[("driver", "step", 0)] == pytest.approx(10e6, abs=1)
    assert dur[("actor[1]", "update", 1_000_000)] == pytest.approx(3e6, abs=1)
    assert dur[("actor[0]", "fwd", 3_000_000)] == pytest.approx(2e6, abs=1)
    assert dur[("critic[0]", "update", 4_000_000)] == pytest.approx(4e6, abs=1)
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys() for e in complete)
    assert trace == timeline.chrome_trace()


def test_busy_is_the_union_of_overlapping_spans(timeline: Timeline) -> None:
    util = timeline.utilization()
    assert util["critic[0]"].busy == pytest.approx(6.0)  # 2-6 and 4-8 overlap: 6 s, not 8
    assert util["actor[0]"].busy == pytest.approx(8.0)  # nested fwd spans add nothing
    assert util["driver"].share == pytest.approx(1.0)


def test_lane_that_finishes_early_shows_the_bubble(timeline: Timeline) -> None:
    u = timeline.utilization()["actor[1]"]
    assert u.window == pytest.approx(10.0)
    assert u.busy == pytest.approx(3.0)
    assert u.idle == pytest.approx(7.0)
    assert u.share == pytest.approx(0.3)


def test_worker_without_spans_is_all_idle() -> None:
    tl = Timeline.from_results([result("actor", 0, 2, ("update", 0.0, 2.0)),
                                result("actor", 1, 2)])
    u = tl.utilization()["actor[1]"]
    assert (u.busy, u.share) == (0.0, 0.0)
    assert u.idle == pytest.approx(2.0)


def test_merge_joins_lanes_across_steps() -> None:
    step1 = Timeline.from_results([result("actor", 0, 1, ("update", 0.0, 1.0))],
                                  driver_spans=driver(("step", 0.0, 1.0)))
    step2 = Timeline.from_results([result("actor", 0, 1, ("update", 2.0, 3.0)),
                                   result("critic", 0, 1, ("values", 2.0, 2.5))])
    merged = Timeline.merge(step1, step2)
    assert [lane.label for lane in merged.lanes] == ["driver", "actor[0]", "critic[0]"]
    assert len(merged.lanes[1].spans) == 2
    assert merged.utilization()["actor[0]"].share == pytest.approx(2.0 / 3.0)
    assert Timeline.merge(step2, step1) == merged  # order of the steps does not matter


def test_duplicate_lanes_are_refused() -> None:
    lane = Lane(label="actor[0]", group="actor", spans=(Span(name="a", start=0.0, end=1.0),))
    with pytest.raises(ValueError, match="duplicate lanes"):
        Timeline(lanes=(lane, lane))


def test_gantt_png_is_written(timeline: Timeline, tmp_path: Path) -> None:
    path = timeline.gantt(tmp_path / "step.png", title="one PPO step")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 5_000
    fig = timeline.gantt_figure()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[2] == "actor[1]  busy 30%"


def test_writes_are_atomic_and_leave_no_temp_files(timeline: Timeline, tmp_path: Path) -> None:
    out = tmp_path / "nested" / "dir"
    timeline.to_chrome_trace(out / "t.json")
    timeline.to_chrome_trace(out / "t.json")  # overwrite in place
    timeline.gantt(out / "g.png")
    assert sorted(p.name for p in out.iterdir()) == ["g.png", "t.json"]


def test_failed_write_keeps_the_old_file_and_no_temp(timeline: Timeline,
                                                    tmp_path: Path) -> None:
    path = timeline.to_chrome_trace(tmp_path / "t.json")
    before = path.read_bytes()
    with pytest.raises(ValueError):
        timeline.gantt(tmp_path / "t.json")  # "json" is no image format: fails mid-write
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_describe_lists_every_lane(timeline: Timeline) -> None:
    text = timeline.describe()
    assert "busy %" in text
    row = next(line for line in text.splitlines() if line.startswith("actor[1]"))
    assert row.split() == ["actor[1]", "3.000", "7.000", "30.0%"]


def test_empty_timeline_raises_a_clear_error(tmp_path: Path) -> None:
    empty = Timeline.from_results([result("actor", 0, 1)])
    for call in (lambda: empty.start, empty.utilization, empty.chrome_trace, empty.describe,
                 lambda: empty.to_chrome_trace(tmp_path / "t.json"),
                 lambda: empty.gantt(tmp_path / "g.png")):
        with pytest.raises(ValueError, match="no spans"):
            call()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="no spans"):
        _ = Timeline().end
