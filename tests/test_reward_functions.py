"""A reward function without a class: ``task.reward=module:function`` and ``task.rewards``.

The functions live in plain modules each test writes to its tmp dir, as a user's would: by
module name from the directory the command runs in, or by file path. Scoring is tested
directly (`score_samples`: dict extras, weights, batched == per sample, each bad value one
line naming function, sample and value), bad specs at config time through the command line,
and whole GRPO runs in process and on Ray from one ``avrid ppo`` command.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from avrid.cli import main
from avrid.ppo.driver.run import train
from avrid.ppo.setup.config_file import read_config, write_config
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.reward_functions import Sample, load_functions, score_samples
from avrid.ppo.setup.task import Prompt
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(5)

ROOT = Path(__file__).resolve().parents[1]

REWARDS = '''
def exact(prompt, response, answer, **metadata):
    """Full marks for the whole answer; its first digit and the task's op as extras."""
    first = float(response[:1] == answer[:1])
    return {"score": float(response[:len(answer)] == answer), "first_digit": first,
            "is_" + metadata["op"]: 1.0}


def partial(prompt, response, answer, **metadata):
    """The digit task's own partial credit, as a plain number."""
    return sum(a == r for a, r in zip(answer, response)) / len(answer)


def partial_batched(prompts, responses, answers, op):
    """`partial` over lists (`op` is the metadata key, one value per sample)."""
    assert isinstance(op, list) and len(op) == len(prompts)
    return [partial(p, r, a) for p, r, a in zip(prompts, responses, answers)]


partial_batched.batched = True


def length_bonus(prompt, response, answer, **metadata):
    return {"score": len(response) / 10, "length": float(len(response))}


def no_metadata(prompt, response, answer):
    """Takes none of the prompt's metadata (the digit task's `op`)."""
    return float(response == answer)


def op_only(prompt, response, answer, op):
    return float(op == "reverse")


def nan_reward(prompt, response, answer, **metadata):
    return float("nan")


def text_reward(prompt, response, answer, **metadata):
    return "1.0"


def no_score(prompt, response, answer, **metadata):
    return {"accuracy": 1.0}


def short_batch(prompts, responses, answers, **metadata):
    return [0.0]


short_batch.batched = True

def raises(prompt, response, answer, **metadata):
    raise ValueError("no such\\ncolumn")


def half_batched(prompts, responses, answers, **metadata):
    return [0.0] * len(prompts)


half_batched.batched = 1

not_a_function = 3
'''


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding ``user_rewards.py``, importable by name (as `avrid ppo` makes the
    directory it runs in) and by path."""
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _samples() -> list[Sample]:
    prompts = [Prompt(index=i, text=f"{d}=", answer=d[::-1], metadata={"op": "reverse"})
               for i, d in enumerate(("381", "120", "907"))]
    return [Sample(sample_id=10 + i, prompt=p, response=r)
            for i, (p, r) in enumerate(zip(prompts, ("183", "120", "7"), strict=True))]


# ---- scoring ----------------------------------------------------------------------------------

def test_a_dict_gives_the_score_and_extras_by_name(user_dir: Path) -> None:
    scores, extras = score_samples(load_functions({"user_rewards:exact": 1.0}), _samples())
    assert scores == [1.0, 0.0, 0.0]
    assert extras == {"first_digit": [1.0, 0.0, 1.0], "is_reverse": [1.0, 1.0, 1.0]}


def test_a_function_gets_only_the_metadata_it_names(user_dir: Path) -> None:
    functions = load_functions({"user_rewards:no_metadata": 0.5, "user_rewards:op_only": 0.5})
    assert functions[0].keywords == frozenset({"prompt", "response", "answer"})
    assert score_samples(functions, _samples())[0] == [1.0, 0.5, 0.5]


def test_weights_combine_as_a_weighted_sum(user_dir: Path) -> None:
    functions = load_functions({"user_rewards:partial": 0.7, "user_rewards:length_bonus": 0.3})
    scores, extras = score_samples(functions, _samples())
    partial = [1.0, 1 / 3, 1 / 3]  # "183" all right; "120" vs "021" and "7" vs "709": 1 of 3
    lengths = [3.0, 3.0, 1.0]
    assert scores == pytest.approx([0.7 * p + 0.3 * n / 10 for p, n in zip(partial, lengths,
                                                                         strict=True)])
    assert extras == {"length": lengths, "partial": pytest.approx(partial),
                      "length_bonus": [n / 10 for n in lengths]}


def test_a_batched_function_gives_the_per_sample_rewards(user_dir: Path) -> None:
    one = score_samples(load_functions({"user_rewards:partial": 1.0}), _samples())
    batched = load_functions({f"{user_dir}/user_rewards.py:partial_batched": 1.0})
    assert batched[0].batched
    assert score_samples(batched, _samples()) == one


@pytest.mark.parametrize("name, says", [
    ("nan_reward", "returned reward nan for prompt 0 ('381='): rewards must be finite"),
    ("text_reward", "returned reward '1.0' for prompt 0 ('381='): rewards must be numbers"),
    ("no_score", "returned {'accuracy': 1.0} for prompt 0 ('381='): a dict must hold 'score'"),
    ("short_batch", "returned [0.0] for 3 samples (sample ids 10..12)"),
])
def test_a_bad_value_names_the_function_the_sample_and_the_value(user_dir: Path, name: str,
                                                                   says: str) -> None:
    with pytest.raises(ValueError) as e:
        score_samples(load_functions({f"user_rewards:{name}": 1.0}), _samples())
    assert f"reward function 'user_rewards:{name}'" in str(e.value) and says in str(e.value)
    assert name == "short_batch" or str(e.value).startswith("sample 10: ")
    assert "\n" not in str(e.value)


def test_an_exception_in_the_function_names_it_and_the_sample(user_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^reward function 'user_rewards:raises' raised "
                                         r"ValueError: no such column \(on sample 10\)$"):
        score_samples(load_functions({"user_rewards:raises": 1.0}), _samples())


# ---- bad specs: one line at config time --------------------------------------------------------

@pytest.mark.parametrize("spec, says", [
    ("user_rewards", "reward function 'user_rewards' is not a spec"),
    ("no_such_module:f", "cannot import module 'no_such_module'"),
    ("user_rewards:missing", "'user_rewards' has no 'missing'"),
    ("user_rewards:not_a_function", "'not_a_function' is 3 (int), not callable"),
    ("nowhere/rewards.py:f", "no file '"),
])
def test_a_bad_spec_is_one_line_before_anything_starts(capsys: pytest.CaptureFixture[str],
                                                       user_dir: Path, spec: str,
                                                       says: str) -> None:
    out = user_dir / "run"
    with pytest.raises(SystemExit) as done:
        main(["ppo", "--preset", "tiny-grpo", "--out", str(out), "--set",
              f"task.reward={spec}"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith("avrid ppo: config field 'task.reward': ") and says in err, err
    assert "expected 'module:function' (a module on the import path) or " \
           "'path/to/file.py:function'" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_batched_attribute_that_is_not_a_bool_is_refused(user_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^config field 'task.reward': reward function "
                                         r"'user_rewards:half_batched': its attribute batched "
                                         r"is 1; set it to True"):
        with_overrides(preset("tiny-grpo"), ["task.reward=user_rewards:half_batched"])


def test_reward_and_rewards_are_not_both_set(user_dir: Path) -> None:
    with pytest.raises(ValueError, match="task.reward .one function. or task.rewards"):
        with_overrides(preset("tiny-grpo"), ["task.reward=user_rewards:exact",
                                             "task.rewards=user_rewards:partial=1"])
    with pytest.raises(ValueError, match="'user_rewards:partial' needs a finite weight"):
        with_overrides(preset("tiny-grpo"), ["task.rewards=user_rewards:partial"])


def test_rewards_in_a_config_file_are_a_mapping_and_round_trip(user_dir: Path) -> None:
    path = user_dir / "run.yaml"
    path.write_text("task:\n  rewards:\n    user_rewards:partial: 0.7\n"
                    "    user_rewards:length_bonus: 0.3\n")
    config = read_config(path)
    assert dict(config.task.reward_weights) == {"user_rewards:partial": 0.7,
                                                "user_rewards:length_bonus": 0.3}
    write_config(config, user_dir / "again.yaml")
    assert read_config(user_dir / "again.yaml") == config
    (user_dir / "bad.yaml").write_text("task:\n  rewards:\n    user_rewards:partial: high\n")
    with pytest.raises(ValueError, match=r"'task.rewards.user_rewards:partial': a weight must "
                                         r"be a finite number, got 'high'"):
        read_config(user_dir / "bad.yaml")


def test_a_file_spec_is_made_absolute_for_the_workers(user_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(user_dir)
    config = with_overrides(preset("tiny-grpo"), ["task.reward=user_rewards.py:exact"])
    assert config.task.reward == f"{user_dir.resolve()}/user_rewards.py:exact"


# ---- whole runs ------------------------------------------------------------------------------

def _grpo(out: Path, *sets: str):  # noqa: ANN202 (a RunSummary)
    """Three steps of tiny GRPO in process (one rank per role), with `sets` on top."""
    return train(with_overrides(preset("tiny-grpo"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.steps=3", "train.prompts_per_step=4", "algo.responses_per_prompt=4",
        "train.mini_batch_size=16", "train.val_prompts=8", "train.val_every=2",
        "train.progress=false", f"train.out_dir={out}", *sets]))


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/score" in r]


@pytest.mark.slow
def test_weighted_functions_train_and_log_their_extras(user_dir: Path) -> None:
    _grpo(user_dir / "w", "task.rewards=user_rewards:exact=0.7,user_rewards:length_bonus=0.3")
    rows = _metrics(user_dir / "w")
    assert len(rows) == 3
    for r in rows:  # each function's score by its name, its extras by theirs
        assert {"reward/exact", "reward/length_bonus", "reward/first_digit",
                "reward/is_reverse", "reward/length"} <= set(r)
        assert r["reward/is_reverse"] == 1.0
        assert r["reward/length_bonus"] == pytest.approx(r["reward/length"] / 10)
        assert r["reward/score"] == pytest.approx(0.7 * r["reward/exact"]
                                                  + 0.3 * r["reward/length_bonus"], abs=1e-6)


@pytest.mark.slow
def test_a_batched_function_trains_exactly_as_the_per_sample_one(user_dir: Path) -> None:
    _grpo(user_dir / "one", "task.reward=user_rewards:partial")
    _grpo(user_dir / "many", f"task.reward={user_dir}/user_rewards.py:partial_batched")
    _grpo(user_dir / "task")  # the digit task's own reward: the same partial credit
    one, many, task = (_algorithmic(user_dir / n) for n in ("one", "many", "task"))
    assert one == many == task
    assert any("val/reward" in r for r in one) and any("actor/loss" in r for r in one)


def _algorithmic(out: Path) -> list[dict]:
    """Every metrics row, without what measures the machine (times, throughput, bytes)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "sync/"))}
            for r in rows]


@pytest.mark.slow
def test_grpo_on_ray_from_one_command_with_a_plain_module(tmp_path: Path) -> None:
    # The module is found by name from the directory the command runs in, by the driver and
    # by the Ray workers (which do not start there): `avrid ppo` puts it on PYTHONPATH.
    work = tmp_path / "project"
    work.mkdir()
    (work / "my_reward.py").write_text(REWARDS)
    done = subprocess.run(
        [sys.executable, "-m", "avrid.cli", "ppo", "--preset", "tiny-grpo", "--out", "run",
         "--steps", "2", "--set", "task.reward=my_reward:exact", "--set",
         "train.prompts_per_step=4", "--set", "algo.responses_per_prompt=4", "--set",
         "train.val_prompts=8", "--set", "train.progress=false"],
        cwd=work, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _metrics(work / "run")
    assert len(rows) == 2 and all(r["reward/is_reverse"] == 1.0 for r in rows)
    assert all(0.0 <= r["reward/first_digit"] <= 1.0 and math.isfinite(r["reward/score"])
               for r in rows)


@pytest.mark.slow
def test_a_bad_reward_value_mid_run_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "my_reward.py").write_text(REWARDS)
    done = subprocess.run(
        [sys.executable, "-m", "avrid.cli", "ppo", "--preset", "tiny-grpo", "--backend",
         "inprocess", "--out", "run", "--set", "task.reward=my_reward:no_score", "--set",
         "train.progress=false", "--set", "train.val_prompts=2"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert line.startswith("avrid ppo: reward[0].score() raised: ValueError: sample ")
    assert "reward function 'my_reward:no_score' returned {'accuracy': 1.0} for prompt" in line
