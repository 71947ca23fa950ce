"""Chapter 6: a resumed pipelined run is the run that never stopped, metric for metric.

A run killed after a checkpoint (as SIGTERM or a crash would) and resumed writes the same
metrics.jsonl, samples.jsonl and final weights as the same run uninterrupted: one_step_off as
it runs (in process and on Ray), async K = 2 with generation that has always finished when
the driver looks (its versions otherwise depend on timing, so not even two uninterrupted runs
would agree). An older checkpoint without pipeline state still resumes, with an empty queue,
and says so, as does a run resumed for more steps than it was set for (it generated nothing
past its end); a resume under another pipeline mode or bound is refused.

Keys left out of the comparison, all of them clocks or read off them: ``time/`` (wall
times), ``perf/`` (tokens per second of ``time/step``), ``pipeline/overlap`` (the share of
the step in which generation and training ran at once); and where generation runs at its own
pace, ``pipeline/queue`` and ``sync/bytes_per_rank``: whether a generation ended (and so
whether its batch is queued, and the push before it checked) before the step's end or just
after it is a race, run to run.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch

from avrid.pipeline import PipelinedTrainer
from avrid.ppo.driver.run import _check_resumable, train
from avrid.ppo.outputs.checkpoint import load_checkpoint, save_checkpoint
from avrid.ppo.outputs.shards import read_model_weights
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.config_file import config_to_dict
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

pytestmark = pytest.mark.chapter(6)

STEPS, EVERY, KILLED_AT = 5, 2, 3
"""Five steps, a checkpoint every two: the run is killed in step 3 and resumes from step 2."""
CLOCKS = ("time/", "perf/", "pipeline/overlap")
RACES = ("pipeline/queue", "sync/bytes_per_rank")


class Preempted(Exception):
    """What the test's kill raises."""


class Killable(PipelinedTrainer):
    """`PipelinedTrainer`, killed when it reaches step `killed_at`; with `instant`, every
    generation has finished by the time the driver looks (each pump waits for it), so that
    an async run's versions no longer depend on timing."""

    def __init__(self, config: PPOConfig, *, instant: bool = False,
                 killed_at: int | None = None) -> None:
        super().__init__(config)
        self.instant, self.killed_at = instant, killed_at

    def train_step(self, step: int):  # noqa: ANN201 - as PipelinedTrainer.train_step
        if step == self.killed_at:
            raise Preempted(f"killed at step {step}")
        return super().train_step(step)

    def _pump(self) -> None:
        while self.instant and self._inflight is not None:
            self._collect()
        super()._pump()


def config(out: Path, *sets: str, inprocess: bool = True, resume: bool = False) -> PPOConfig:
    """tiny-ppo cut to seconds, writing to `out`."""
    where = (["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1"]
             if inprocess else ["placement.cpus_per_worker=0.5", "train.call_timeout_s=60"])
    if inprocess and any(s.startswith("pipeline.mode=") for s in sets):
        where.append("pipeline.rollout_dp=1")  # a rollout pool of one rank
    return with_overrides(preset("tiny-ppo"), [
        f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}", "train.prompts_per_step=8",
        "algo.responses_per_prompt=4", "train.mini_batch_size=16", "train.val_prompts=16",
        "train.progress=false", f"train.out_dir={out}", *where, *sets,
        *(["train.resume=true"] if resume else [])])


def lines(out: Path, name: str, skip: tuple[str, ...] = ()) -> list[dict]:
    rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows]


def final_weights(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    ck = load_checkpoint(out / "checkpoints")
    return {name: read_model_weights(path) for name, path in ck.sharded.items()}


def copied_shards(sharded: dict[str, Path], tmp: Path) -> list[str]:
    """A `write_shards` that copies a loaded checkpoint's shard directories into `tmp`."""
    for name, path in sharded.items():
        shutil.copytree(path, tmp / name)
    return list(sharded)


def interrupted_and_resumed(tmp_path: Path, sets: tuple[str, ...], *, instant: bool,
                            inprocess: bool = True) -> tuple[Path, Path, list[str]]:
    """The run uninterrupted, and the run killed at step 3 and resumed (its resume log)."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(config(whole, *sets, inprocess=inprocess),
          make_trainer=partial(Killable, instant=instant))
    with pytest.raises(Preempted):
        train(config(cut, *sets, inprocess=inprocess),
              make_trainer=partial(Killable, instant=instant, killed_at=KILLED_AT))
    log: list[str] = []
    train(config(cut, *sets, inprocess=inprocess, resume=True), log=log.append,
          make_trainer=partial(Killable, instant=instant))
    return whole, cut, log


def assert_same_run(whole: Path, cut: Path, skip: tuple[str, ...]) -> None:
    assert lines(cut, "metrics.jsonl", skip) == lines(whole, "metrics.jsonl", skip)
    assert [r["step"] for r in lines(cut, "metrics.jsonl")] == list(range(STEPS + 1))
    assert lines(cut, "samples.jsonl") == lines(whole, "samples.jsonl")
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[m][n], b[m][n]) for m in a for n in a[m])


# ---- exact resume ---------------------------------------------------------------------------

def test_a_resumed_one_step_off_run_is_the_uninterrupted_run(tmp_path: Path) -> None:
    whole, cut, log = interrupted_and_resumed(tmp_path, ("pipeline.mode=one_step_off",),
                                              instant=False)
    assert_same_run(whole, cut, CLOCKS + RACES)
    # One version stale from step 1 on, the resumed step 2 included (it was 0 before: the
    # resumed run started with an empty queue and generated step 2 with fresh weights).
    rows = lines(cut, "metrics.jsonl")
    assert [r["pipeline/staleness_max"] for r in rows[1:]] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert any("pipeline state" in line and "restored" in line for line in log), log


def test_a_resumed_async_k2_run_is_the_uninterrupted_run(tmp_path: Path) -> None:
    # Validation at every checkpoint: it pushes the trainer's weights before the save, so
    # the resumed engines must be given the checkpoint's weights (one_step_off above resumes
    # with engines a version behind, to be pushed at the next launch).
    whole, cut, _ = interrupted_and_resumed(
        tmp_path, ("pipeline.mode=async", "pipeline.max_staleness=2", f"train.val_every={EVERY}"),
        instant=True)
    assert_same_run(whole, cut, CLOCKS)
    rows = lines(cut, "metrics.jsonl")
    assert max(r["pipeline/staleness_max"] for r in rows[1:]) == 2.0  # it ran ahead: K = 2
    assert rows[EVERY + 1]["pipeline/queue"] > 0  # the resumed step found batches queued


@pytest.mark.slow
def test_a_resumed_one_step_off_run_on_ray_is_the_uninterrupted_run(
        tmp_path: Path, ray_cluster: None) -> None:
    # Two trainer and two rollout ranks, and a critic warm-up step (versions lag steps).
    # Two runs, not three (Ray starts 7 workers per run): the run killed right after its
    # step-2 checkpoint is the uninterrupted run's outputs as they were then, so resume a
    # copy of those from that checkpoint.
    sets = ("pipeline.mode=one_step_off", "train.critic_warmup_steps=1",
            f"train.keep_checkpoints={STEPS}")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(config(whole, *sets, inprocess=False), make_trainer=Killable)
    shutil.copytree(whole, cut)
    train(config(cut, *sets, f"train.resume_from={cut / 'checkpoints' / 'step_000002'}",
                 inprocess=False, resume=True), make_trainer=Killable)
    assert_same_run(whole, cut, CLOCKS + RACES)


# ---- older checkpoints, other modes -----------------------------------------------------------

def test_a_checkpoint_without_pipeline_state_resumes_with_an_empty_queue(
        tmp_path: Path) -> None:
    sets = ("pipeline.mode=one_step_off",)
    with pytest.raises(Preempted):
        train(config(tmp_path, *sets), make_trainer=partial(Killable, killed_at=KILLED_AT))
    # Rewrite the step-2 checkpoint as an older avrid wrote it: no pipeline state in extra.
    ck = load_checkpoint(tmp_path / "checkpoints")
    assert ck.step == EVERY and "pipeline" in ck.extra
    old_extra = {k: v for k, v in ck.extra.items() if k != "pipeline"}
    save_checkpoint(tmp_path / "checkpoints", ck.step, state=ck.state, extra=old_extra,
                    write_shards=lambda tmp: copied_shards(ck.sharded, tmp))
    log: list[str] = []
    train(config(tmp_path, *sets, resume=True), log=log.append,
          make_trainer=partial(Killable))
    assert any("no pipeline state" in line and "queue starts empty" in line for line in log), log
    rows = lines(tmp_path, "metrics.jsonl")
    # As before: the first batch after the resume is generated with the resumed weights.
    assert [r["pipeline/staleness_max"] for r in rows[1:]] == [0.0, 1.0, 0.0, 1.0, 1.0]


def test_a_run_resumed_past_its_end_says_it_is_exact_only_up_to_it(tmp_path: Path) -> None:
    # A run set for 2 steps generates nothing for step 2; resumed for 5, its step-2 batch is
    # made with the checkpoint's weights (staleness 0), not the version before (1).
    sets = ("pipeline.mode=one_step_off",)
    train(with_overrides(config(tmp_path, *sets), ["train.steps=2"]), make_trainer=Killable)
    log: list[str] = []
    train(config(tmp_path, *sets, resume=True), log=log.append, make_trainer=Killable)
    assert any("its run was set for 2 steps" in line for line in log), log
    rows = lines(tmp_path, "metrics.jsonl")
    assert [r["pipeline/staleness_max"] for r in rows[1:]] == [0.0, 1.0, 0.0, 1.0, 1.0]


def test_a_sync_checkpoint_holds_no_pipeline_state(tmp_path: Path) -> None:
    cfg = with_overrides(config(tmp_path), ["train.steps=1"])
    train(cfg)
    assert set(load_checkpoint(tmp_path / "checkpoints").extra) == {
        "torch_rng", "python_rng", "numpy_rng"}


@pytest.mark.parametrize(("before", "after", "field"), [
    (("pipeline.mode=one_step_off",), ("pipeline.mode=async",), "pipeline.mode"),
    (("pipeline.mode=one_step_off",), (), "pipeline.mode"),
    (("pipeline.mode=async", "pipeline.max_staleness=2"),
     ("pipeline.mode=async", "pipeline.max_staleness=3"), "pipeline.max_staleness"),
])
def test_a_pipelined_checkpoint_resumes_only_under_its_own_mode_and_bound(
        before: tuple[str, ...], after: tuple[str, ...], field: str, tmp_path: Path) -> None:
    saved = config_to_dict(config(tmp_path, *before))
    with pytest.raises(ValueError, match=rf"cannot resume: .*{field}: "):
        _check_resumable(saved, config_to_dict(config(tmp_path, *after, resume=True)))
