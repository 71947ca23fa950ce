"""Chapter 5 (and 6): DAPO's dynamic sampling. Every kept group has responses that scored
differently; the step's batch holds exactly `prompts_per_step` groups; extra rounds stay
within the bound and are logged (`dynamic/*`); rewards that never differ stop the run after
the bound with a one-line error, not a hang; a run is reproducible and a resumed one equals
the uninterrupted one; in chapter 6's pipeline the extra rounds are generated at the
trainer's version (staleness 0), K = 0 is still the synchronous run bit for bit, and a
resumed one-step-off run is still the uninterrupted one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from avrid.dispatch import Batch
from avrid.pipeline import make_trainer
from avrid.ppo.data.dynamic_sampling import (
    EXTRA_ID_BASE,
    DynamicSamplingError,
    fill_groups,
    round_prompts,
    round_seed,
    varied_groups,
)
from avrid.ppo.data.prompts import PromptSet, step_indices
from avrid.ppo.driver.run import train
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.task import Prompt
from avrid.ppo.setup.tokenizer import CharTokenizer
from tests.helpers import child_env
from tests.test_pipeline import algorithmic, same_weights
from tests.test_pipeline_resume import (
    CLOCKS,
    RACES,
    assert_same_run,
    interrupted_and_resumed,
    lines,
)
from tests.test_ppo_trainer import EchoFirstTask

pytestmark = pytest.mark.chapter(5)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, RESPONSES = 8, 4


# ---- the filter and the refill, on made-up batches ------------------------------------------

def scored(scores: list[float], *, per_group: int, first_id: int) -> Batch:
    """A scored batch: len(scores) // per_group groups of `per_group` responses in a row."""
    n = len(scores)
    return Batch.from_rows(sample_ids=range(first_id, first_id + n), prompt_lens=[1] * n,
                           response_lens=[1] * n, packed={"tokens": [torch.ones(2)] * n},
                           scalars={"score": torch.tensor(scores),
                                    "group": torch.arange(n // per_group)
                                    .repeat_interleave(per_group)})


def test_a_group_varies_only_if_its_scores_differ() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.3])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert varied_groups(scores, groups).tolist() == [False, False, True, True, False, False,
                                                     False]  # a group of one never varies
    # A difference of one ulp is a difference: its advantages are not 0.
    tiny = torch.tensor([1.0, float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))])
    assert varied_groups(tiny, torch.tensor([5, 5])).tolist() == [True, True]
    with pytest.raises(ValueError, match="scores and group_ids"):
        varied_groups(scores, groups[:3])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), groups=st.integers(1, 6), per_group=st.integers(2, 5),
       max_rounds=st.integers(1, 5))
def test_the_batch_is_exact_and_every_kept_group_varies(data: st.DataObject, groups: int,
                                                        per_group: int,
                                                        max_rounds: int) -> None:
    # Scores from {0, 1}: many groups come out all alike, so refills are common.
    rounds = [data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=groups * per_group,
                                 max_size=groups * per_group)) for _ in range(max_rounds)]
    drawn: list[int] = []

    def draw(r: int) -> Batch:
        drawn.append(r)
        return scored(rounds[r], per_group=per_group, first_id=1000 * r)

    varied_per_round = [sum(len(set(s[g * per_group:(g + 1) * per_group])) > 1
                            for g in range(groups)) for s in rounds]
    cumulative = [sum(varied_per_round[:r + 1]) for r in range(max_rounds)]
    first = scored(rounds[0], per_group=per_group, first_id=0)
    if cumulative[-1] < groups:  # never enough: the bound ends it, every round was drawn
        with pytest.raises(DynamicSamplingError, match=f"after {max_rounds} generation"):
            fill_groups(first, groups=groups, max_rounds=max_rounds, step=7, draw=draw,
                        shaped=lambda b: b.scalars["score"])
        assert drawn == list(range(1, max_rounds))
        return
    batch, stats = fill_groups(first, groups=groups, max_rounds=max_rounds, step=7, draw=draw,
                               shaped=lambda b: b.scalars["score"])
    needed = next(r for r in range(max_rounds) if cumulative[r] >= groups) + 1
    assert stats.rounds == needed and drawn == list(range(1, needed))  # no round too many
    assert stats.drawn == groups * needed and stats.kept == cumulative[needed - 1]
    assert len(batch) == groups * per_group
    assert batch.scalars["group"].tolist() == [g for g in range(groups) for _ in range(per_group)]
    for g in range(groups):
        s = batch.scalars["score"][batch.scalars["group"] == g]
        assert s.max() > s.min()
    assert len(set(batch.sample_ids.tolist())) == len(batch)
    # The kept groups are the first ones drawn, in order.
    assert batch.sample_ids.tolist() == sorted(batch.sample_ids.tolist())
    metrics = stats.metrics()
    assert metrics["dynamic/groups_dropped"] == stats.drawn - stats.kept
    assert metrics["dynamic/rounds"] == needed


def test_the_error_is_one_line_naming_the_step_the_counts_and_what_to_change() -> None:
    alike = scored([1.0] * 8, per_group=4, first_id=0)
    with pytest.raises(DynamicSamplingError) as info:
        fill_groups(alike, groups=2, max_rounds=3, step=12, draw=lambda r: alike,
                    shaped=lambda b: b.scalars["score"])
    text = str(info.value)
    assert "\n" not in text and "step 12" in text and "0 of the 2 groups" in text
    assert "6 groups drawn" in text and "algo.dynamic_sampling_max_rounds" in text
    assert isinstance(info.value, ValueError)  # the command line reports it in one line


def test_extra_rounds_read_their_own_prompts_with_ids_no_other_sample_has() -> None:
    task = EchoFirstTask()
    prompts = PromptSet(task.train_prompts(), CharTokenizer(task.alphabet), max_tokens=8,
                        split="train")
    ids: list[int] = []
    for step in range(4):
        ids += range(step * 12, (step + 1) * 12)  # round 0: the step's own ids
        for r in range(1, 3):
            b = round_prompts(prompts, step=step, round=r, count=3, repeats=4, seed=5,
                              max_rounds=3)
            assert b.scalars["group"].tolist() == [g for g in range(3) for _ in range(4)]
            assert int(b.sample_ids.min()) >= EXTRA_ID_BASE
            ids += b.sample_ids.tolist()
            again = round_prompts(prompts, step=step, round=r, count=3, repeats=4, seed=5,
                                  max_rounds=3)
            assert again.equals(b)  # a function of (seed, step, round) alone
    assert len(ids) == len(set(ids))
    # Round 0 is untouched: a run with dynamic sampling trains on the same first prompts.
    main = [i for step in range(4) for i in step_indices(step, 3, len(prompts), 5)]
    extra = [int(i) for step in range(2) for r in (1, 2) for i in round_prompts(
        prompts, step=step, round=r, count=3, repeats=1, seed=5,
        max_rounds=3).scalars["prompt_index"]]
    assert extra != main[:12] and sorted(extra[:9]) == list(range(9))  # an epoch of its own
    assert round_seed(10, 0) == 10 and len({round_seed(10, r) for r in range(5)}) == 5
    with pytest.raises(ValueError, match="round must be in"):
        round_prompts(prompts, step=0, round=3, count=3, repeats=1, seed=5, max_rounds=3)


# ---- in the trainer -----------------------------------------------------------------------------

def tiny(out: Path, *extra: str) -> PPOConfig:
    """GRPO in seconds (in-process, one rank per role), with dynamic sampling. Groups of 4 on
    an untrained model: many score all 0, so steps need extra rounds."""
    return with_overrides(preset("tiny-grpo"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.steps=4", f"train.prompts_per_step={PROMPTS}",
        f"algo.responses_per_prompt={RESPONSES}", "train.mini_batch_size=16",
        "train.val_prompts=16", "train.val_every=2", "train.progress=false",
        "algo.dynamic_sampling=true", f"train.out_dir={out}", *extra])


def test_each_step_trains_on_exactly_its_groups_and_a_run_is_reproducible(
        tmp_path: Path) -> None:
    cfg = tiny(tmp_path / "a")
    rows, batches = [], []
    with make_trainer(cfg) as tr:
        tr.start()
        for step in range(cfg.train.steps):
            metrics, batch = tr.train_step(step)
            rows.append(metrics)
            batches.append(batch)
    for batch in batches:
        assert len(batch) == PROMPTS * RESPONSES
        groups = batch.scalars["group"]
        assert sorted(set(groups.tolist())) == list(range(PROMPTS))
        for g in range(PROMPTS):
            s = batch.scalars["score"][groups == g]
            assert len(s) == RESPONSES and s.max() > s.min()
    rounds = [r["dynamic/rounds"] for r in rows]
    assert all(1 <= r <= cfg.algo.dynamic_sampling_max_rounds for r in rounds)
    assert sum(rounds) > len(rows), "no step needed an extra round: the test tests nothing"
    for r in rows:
        assert r["dynamic/groups_drawn"] == PROMPTS * r["dynamic/rounds"]
        assert r["dynamic/groups_kept"] >= PROMPTS and "time/resample" in r
    a = train(cfg).rows
    b = train(tiny(tmp_path / "b")).rows
    assert algorithmic(a) == algorithmic(b)


def test_a_resumed_run_is_the_uninterrupted_run(tmp_path: Path) -> None:
    full = train(tiny(tmp_path / "full"))
    out = tmp_path / "split"
    train(tiny(out, "train.steps=2"))
    resumed = train(tiny(out, "train.resume=true"))
    # Step 2's row differs only by the extra validation the shorter run did at its end.
    assert algorithmic(resumed.rows)[3:] == algorithmic(full.rows)[3:]
    assert any(r.get("dynamic/rounds", 1) > 1 for r in full.rows[3:])


class AlwaysRight(EchoFirstTask):
    """Every response scores 1: no group ever varies."""

    def reward(self, prompt: Prompt, response: str) -> float:
        return 1.0


def make_always_right() -> AlwaysRight:
    return AlwaysRight()


def test_rewards_that_never_differ_stop_the_run_in_one_line_after_the_bound(
        tmp_path: Path) -> None:
    out = tmp_path / "alike"
    sets = ["task.name=tests.test_dynamic_sampling:make_always_right", "task.options=",
            "algo.dynamic_sampling_max_rounds=3", "rollout.max_response_tokens=2"]
    with pytest.raises(DynamicSamplingError, match="step 0 found 0 of the 8 groups .* after 3"):
        train(tiny(out, *sets))
    args = [f"--set={s}" for s in [*sets, "placement.backend=inprocess",
                                   "placement.actor_dp=1", "placement.critic_dp=1",
                                   "algo.dynamic_sampling=true", "train.steps=2",
                                   "train.progress=false", "train.val_prompts=4"]]
    done = subprocess.run([sys.executable, "-m", "avrid.cli", "ppo", "--algo", "grpo",
                           "--out", str(tmp_path / "cli"), *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("avrid ppo: dynamic sampling: step 0 "), lines


# ---- in chapter 6's pipeline -----------------------------------------------------------------

def run(cfg: PPOConfig) -> tuple[list[dict], dict]:
    rows = []
    with make_trainer(cfg) as tr:
        tr.start()
        for step in range(cfg.train.steps):
            metrics, batch = tr.train_step(step)
            metrics["_sample_ids"] = batch.sample_ids.tolist()
            rows.append(metrics)
        weights = tr.state().weights
    return rows, weights


def test_k0_with_dynamic_sampling_is_the_sync_run_bit_for_bit(tmp_path: Path) -> None:
    sync_rows, sync_w = run(tiny(tmp_path / "s"))
    k0_rows, k0_w = run(tiny(tmp_path / "k", "pipeline.mode=async", "pipeline.max_staleness=0",
                             "pipeline.rollout_dp=1"))
    assert algorithmic(k0_rows) == algorithmic(sync_rows)
    assert same_weights(k0_w, sync_w)
    assert sum(r["dynamic/rounds"] for r in k0_rows) > len(k0_rows)


def test_one_step_off_generates_extra_rounds_at_the_trainers_version(tmp_path: Path) -> None:
    rows, _ = run(tiny(tmp_path / "o", "pipeline.mode=one_step_off", "pipeline.rollout_dp=1",
                       "train.steps=5"))
    for r in rows:
        assert r["pipeline/staleness_max"] <= 1.0
    # A step with extra rounds trains partly on fresh samples: its mean staleness is below
    # the queued batch's 1 (the extra rounds are at staleness 0).
    refilled = [r for r in rows[1:] if r["dynamic/rounds"] > 1]
    assert refilled, "no step needed an extra round"
    assert all(r["pipeline/staleness_mean"] < 1.0 for r in refilled)


def test_a_resumed_one_step_off_run_with_dynamic_sampling_is_the_uninterrupted_run(
        tmp_path: Path) -> None:
    whole, cut, _ = interrupted_and_resumed(
        tmp_path, ("pipeline.mode=one_step_off", "algo.name=grpo", "algo.dynamic_sampling=true"),
        instant=False)
    assert_same_run(whole, cut, CLOCKS + RACES)
    rounds = [r["dynamic/rounds"] for r in lines(whole, "metrics.jsonl")[1:]]
    assert max(rounds) > 1, rounds  # the resumed steps refilled, not only the first round
