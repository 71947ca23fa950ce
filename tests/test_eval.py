"""`avrid eval` (issue 42, item 4): pass@k by hand, and an evaluation that is validation's.

pass@k's unbiased estimator is checked against the binomials written out (exact fractions)
on a fixed set of sample counts, edge cases included. The evaluation is checked against a
4-step tiny-ppo run in this process (`RUN`: 24 validation prompts of copying three digits,
where the untrained model already scores partial credit, so the rewards are not all 0),
validated and checkpointed at steps 2 and 4: `avrid eval` of each checkpoint gives the
``val/reward`` the run logged at that step, exactly; the run's export and a copy of it
elsewhere give the last one; ``--initial`` gives step 0's. Every refusal is one line, exit 2.
"""

from __future__ import annotations

import json
import math
import shutil
from fractions import Fraction
from pathlib import Path

import pytest

from avrid.ppo.algo.pass_at_k import mean_pass_at_k, pass_at_k
from avrid.ppo.driver.eval_target import resolve_target
from avrid.ppo.driver.run import train
from avrid.ppo.outputs.metrics import read_metrics
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from tests.test_cli_config import run_main

pytestmark = pytest.mark.chapter(5)

PROMPTS = 24
TASK = ["task.options=op:copy,length:3", f"train.val_prompts={PROMPTS}"]
"""The task and prompts of `RUN`; an evaluation without a run's config is given them."""
RUN = [*TASK, "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
       "train.steps=4", "train.prompts_per_step=4", "algo.responses_per_prompt=4",
       "train.mini_batch_size=16", "train.val_every=2", "train.checkpoint_every=2",
       "train.progress=false"]
FAST = ["--samples", "4", "--k", "1,2,4"]
"""A small sampled pass: 4 responses per prompt."""


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 - C(n-c, k) / C(n, k), the binomials as exact integers (math.comb is 0 for n-c < k)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize(("n", "c", "k", "by_hand"), [
    (5, 2, 1, Fraction(2, 5)),          # k = 1: the share that passed, c / n
    (5, 2, 2, Fraction(7, 10)),         # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, Fraction(11, 12)),       # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (8, 0, 4, Fraction(0)),             # nothing passed
    (8, 8, 4, Fraction(1)),             # everything passed
    (4, 3, 2, Fraction(1)),             # n - c = 1 < k: every pair holds a pass
    (6, 1, 6, Fraction(1)),             # k = n: the one pass is always drawn
])
def test_pass_at_k_equals_the_hand_computation(n: int, c: int, k: int,
                                                by_hand: Fraction) -> None:
    assert exact_pass_at_k(n, c, k) == by_hand
    assert pass_at_k(n, c, k) == pytest.approx(float(by_hand), abs=1e-12)


def test_pass_at_k_is_stable_where_the_binomials_overflow_a_float() -> None:
    # C(2000, 1000) ~ 1e600: the ratio of floats would be inf / inf.
    for n, c, k in [(2000, 37, 1000), (200, 150, 64), (1000, 1, 999)]:
        assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-9)


def test_pass_at_k_averaged_over_a_fixed_sample_set() -> None:
    passed = [0, 1, 2, 4]  # passes among n = 4 samples, per prompt
    by_hand = {1: Fraction(0 + 1 + 2 + 4, 16),
               2: (0 + Fraction(1, 2) + Fraction(5, 6) + 1) / 4,  # C(3,2)/C(4,2), C(2,2)/..
               4: Fraction(0 + 1 + 1 + 1, 4)}
    for k, value in by_hand.items():
        assert mean_pass_at_k(passed, n=4, k=k) == pytest.approx(float(value), abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 5), (4, 1, 0), (4, 5, 2), (4, -1, 2)])
def test_pass_at_k_refuses_counts_that_cannot_be(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs|must be in"):
        pass_at_k(n, c, k)


# ---- avrid eval on a trained run -----------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eval") / "run"
    train(with_overrides(preset("tiny-ppo"), [*RUN, f"train.out_dir={out}"]))
    return out


def logged_val(run: Path) -> dict[int, float]:
    """step -> the val/reward the run logged at it."""
    return {r["step"]: r["val/reward"] for r in read_metrics(run / "metrics.jsonl")
            if r.get("val/reward") is not None}


def evaluated(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    """`avrid eval ARGS`'s summary, after checking it ran and printed one line."""
    code, out, err = run_main(capsys, "eval", *args, "--backend", "inprocess")
    assert code == 0, err
    assert out.count("\n") == 1 and out.startswith("avrid eval: "), out
    where = Path(out.rstrip().rsplit(" -> ", 1)[1])
    return json.loads((where / "eval_summary.json").read_text())


def test_eval_of_a_checkpoint_gives_the_validation_reward_logged_at_its_step(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    val = logged_val(run)
    assert sorted(val) == [0, 2, 4] and len(set(val.values())) == 3, val  # three apart
    latest = evaluated(capsys, str(run), *FAST)  # a run directory: its latest checkpoint
    assert (latest["kind"], latest["step"], latest["prompts"]) == ("checkpoint", 4, PROMPTS)
    assert latest["greedy/reward"] == val[4]
    older = evaluated(capsys, str(run / "checkpoints" / "step_000002"), "--samples", "0")
    assert older["step"] == 2 and older["greedy/reward"] == val[2]
    assert "sampled/reward" not in older  # --samples 0: the greedy pass only


def test_eval_writes_a_row_per_prompt_with_every_sample_and_a_summary_of_them(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = evaluated(capsys, str(run), *FAST, "--pass-threshold", "0.3", "--out",
                        str(run.parent / "shape"), "--temperature", "0.7")
    rows = [json.loads(line) for line in (run.parent / "shape" / "eval.jsonl").open()]
    assert [r["index"] for r in rows] == list(range(PROMPTS))
    for r in rows:
        assert r["answer"] == r["prompt"].removesuffix("=")  # the copy task
        assert len(r["samples"]) == 4
        for s in [r["greedy"], *r["samples"]]:
            assert set(s) == {"response", "reward", "length", "truncated", "passed"}
            assert s["passed"] == (s["reward"] >= 0.3) and 1 <= s["length"] <= 4
        assert r["passed"] == sum(s["passed"] for s in r["samples"])
    greedy = [r["greedy"]["reward"] for r in rows]
    assert summary["greedy/reward"] == pytest.approx(sum(greedy) / PROMPTS, abs=1e-6)  # fp32
    assert summary["greedy/pass@1"] == sum(g >= 0.3 for g in greedy) / PROMPTS
    sampled = [s["reward"] for r in rows for s in r["samples"]]
    assert summary["sampled/reward"] == pytest.approx(sum(sampled) / (4 * PROMPTS), abs=1e-6)
    passed = [r["passed"] for r in rows]
    assert 0 < sum(passed) < 4 * PROMPTS, passed  # the threshold makes pass@k tell something
    for k in (1, 2, 4):
        assert summary[f"sampled/pass@{k}"] == pytest.approx(mean_pass_at_k(passed, 4, k))
    lengths = [s["length"] for r in rows for s in r["samples"]]
    assert summary["sampled/response_len_max"] == max(lengths)
    assert summary["sampled/response_len"] == pytest.approx(sum(lengths) / (4 * PROMPTS))
    assert (summary["samples"], summary["pass_threshold"], summary["split"]) == (4, 0.3, "val")
    assert summary["temperature"] == 0.7


def test_eval_on_the_training_prompts_of_another_task_set_over_the_checkpoints(
        run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "train"
    summary = evaluated(capsys, str(run), "--split", "train", "--prompts", "5", "--samples",
                        "0", "--set", "task.options=op:reverse,length:3", "--out", str(out))
    rows = [json.loads(line) for line in (out / "eval.jsonl").open()]
    train_split = load_task("digits", op="reverse", length=3).train_prompts()
    assert [(r["prompt"], r["answer"]) for r in rows] == [
        (train_split[i].text, train_split[i].answer) for i in range(5)]
    assert (summary["split"], summary["prompts"]) == ("train", 5)


def test_eval_of_the_runs_export_and_of_a_copy_elsewhere_gives_the_last_validation(
        run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    last = logged_val(run)[4]
    own = evaluated(capsys, str(run / "export"), "--samples", "0")  # the run's config
    assert own["kind"] == "export" and own["greedy/reward"] == last
    assert (run / "eval" / "export" / "eval.jsonl").is_file()  # beside the run's evaluations
    copy = shutil.copytree(run / "export", tmp_path / "hf")  # no run around it: --set the task
    moved = evaluated(capsys, str(copy), "--samples", "0", *(f"--set={s}" for s in TASK))
    assert moved["greedy/reward"] == last
    assert (tmp_path / "hf-eval" / "eval_summary.json").is_file()


def test_eval_places_no_critic_and_no_reference(run: Path) -> None:
    from avrid.ppo.driver.eval_target import resolve_target
    from avrid.ppo.driver.evaluate import EvalOptions, eval_config

    target = resolve_target(run)
    config = eval_config(target.config, target, EvalOptions())
    assert target.config.algo.uses_critic  # a PPO run...
    assert not config.algo.uses_critic and config.algo.kl_coef == 0  # ...evaluated alone


def test_eval_of_the_initial_model_gives_the_untrained_validation(
        run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    summary = evaluated(capsys, "--initial", "--samples", "0", "--out", str(tmp_path / "i"),
                        *(f"--set={s}" for s in TASK))
    assert summary["kind"] == "initial" and summary["greedy/reward"] == logged_val(run)[0]


def test_eval_refuses_to_replace_an_evaluation_without_force_and_keeps_other_files(
        run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own")
    args = (str(run), "--samples", "0", "--out", str(out))
    evaluated(capsys, *args)
    code, _, err = run_main(capsys, "eval", *args)
    assert code == 2 and "already holds an evaluation (eval.jsonl, eval_summary.json); " \
                          "pass --force" in err and err.count("\n") == 1, err
    evaluated(capsys, *args, "--force")
    assert (out / "notes.txt").read_text() == "the user's own"
    assert sorted(p.name for p in out.iterdir()) == ["eval.jsonl", "eval_summary.json",
                                                     "notes.txt"]


@pytest.mark.parametrize(("args", "says"), [
    (["nowhere"], "nowhere does not exist; avrid eval takes a run directory"),
    (["{stray}"], "is not something avrid eval can evaluate (it holds notes.txt); avrid eval "
                  "takes a run directory"),
    (["{run}", "--k", "1,8", "--samples", "4"], "pass@k needs 1 <= k <= --samples (4); --k "
                                                "has 8"),
    (["{run}", "--k", "1,a"], "--k '1,a' is not a list of whole numbers"),
    (["{run}", "--split", "test"], "--split 'test' is not a split; allowed: val, train"),
    ([], "give a TARGET (a run, checkpoint or export directory) or --initial, not neither"),
    (["{run}", "--initial"], "or --initial, not both"),
    (["{run}", "--preset", "tiny-grpo"], "brings its run's config; change parts of it with --set"),
    (["--initial", "--preset", "tiny-agent", "--backend", "inprocess"],
     "is a multi-turn (agent) task; avrid eval scores single-turn tasks"),
])
def test_a_bad_eval_command_is_one_line_and_exit_2(
        run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str],
        says: str) -> None:
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a run")
    argv = [a.format(run=run, stray=stray) for a in args]
    code, out, err = run_main(capsys, "eval", *argv)
    assert code == 2 and out == "", (out, err)
    assert err.startswith("avrid eval: ") and err.count("\n") == 1 and says in err, err
    assert not (stray / "eval").exists() and not (run / "eval" / "initial").exists()


def test_a_lora_export_is_evaluated_by_its_merged_policy(tmp_path: Path) -> None:
    for folder in ("merged", "base"):
        (tmp_path / "x" / folder).mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (tmp_path / "x" / folder / name).write_text("")
    (tmp_path / "x" / "adapter").mkdir()
    target = resolve_target(tmp_path / "x")
    assert (target.kind, target.path) == ("export", tmp_path / "x" / "merged")
    shutil.rmtree(tmp_path / "x" / "merged")  # exported without --merged
    with pytest.raises(ValueError, match=r"without the merged policy \(merged/\).*--merged"):
        resolve_target(tmp_path / "x")


@pytest.mark.vllm
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(400)
def test_eval_with_vllm_on_ray_gives_the_validation_reward_logged_at_its_step(
        tmp_path: Path) -> None:
    """The same check with the vLLM engine in each policy rank, on Ray (`vllm` tier): the
    checkpoint is loaded into vLLM through the first weight sync, as a resumed run's is."""
    from avrid.ppo.driver.evaluate import EvalOptions, eval_config, evaluate

    out = tmp_path / "run"
    train(with_overrides(preset("tiny-ppo-vllm"), [
        *TASK, "train.steps=2", "train.prompts_per_step=4", "algo.responses_per_prompt=4",
        "train.mini_batch_size=16", "train.val_every=2", "train.progress=false",
        f"train.out_dir={out}"]))
    target = resolve_target(out)
    options = EvalOptions(samples=2, ks=(1, 2))
    report = evaluate(eval_config(target.config, target, options), target, options)
    assert target.step == 2 and report.summary["greedy/reward"] == logged_val(out)[2]
    assert [len(r["samples"]) for r in report.rows] == [2] * PROMPTS
