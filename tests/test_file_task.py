"""``task.name=file``: a user's JSONL, Parquet or datasets directory, without a class.

Each data file is built in the test's tmp dir, with a plain reward-function module beside it,
as a user's would be. Whole GRPO runs: one through the ``avrid ppo`` command (JSONL), two in
process (Parquet, a datasets directory), one step each. Then the reading itself: keys, verl's
chat prompts and nested answers, the metadata, the alphabet, the held-out share, GSM8K read
as a file task, and every data error as one line naming what is wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from avrid.cli import main
from avrid.ppo.driver.run import train
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.file_task import FileTask
from avrid.ppo.setup.gsm8k import Gsm8kTask
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.tokenizer import HFTokenizer, load_tokenizer, make_tokenizer
from tests.helpers import child_env
from tests.test_ppo_tasks import _save_tiny_hf_tokenizer

pytestmark = pytest.mark.chapter(5)

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "carry": a + b > 9}
        for a in range(4) for b in range(7, 10)]
"""Twelve sums; `carry` is metadata a reward function reads."""

REWARD = '''
def score(prompt, response, answer, carry, **metadata):
    return {"score": float(response.strip() == answer), "carry": float(carry)}
'''


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dataset(rows: list[dict]):  # noqa: ANN202 (a datasets.Dataset)
    import datasets

    return datasets.Dataset.from_list(rows)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/score" in r]


# ---- whole runs ------------------------------------------------------------------------------

@pytest.mark.slow
def test_grpo_on_a_jsonl_and_a_plain_reward_module_from_one_command(tmp_path: Path) -> None:
    _jsonl(tmp_path / "sums.jsonl", ROWS)
    (tmp_path / "my_reward.py").write_text(REWARD)
    done = subprocess.run(
        [sys.executable, "-m", "avrid.cli", "ppo", "--preset", "tiny-grpo", "--task", "file",
         "--set", "task.path=sums.jsonl", "--set", "task.reward=my_reward.py:score",
         "--backend", "inprocess", "--steps", "1", "--out", "run", "--set",
         "train.prompts_per_step=4", "--set", "algo.responses_per_prompt=4", "--set",
         "train.val_prompts=2", "--set", "train.progress=false"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = _metrics(tmp_path / "run")
    assert 0.0 <= row["reward/carry"] <= 1.0  # the row's own column reached the function


def _grpo(out: Path, path: Path, *sets: str) -> None:
    """One step of tiny GRPO in process on the data at `path`, scored by my_reward.py."""
    (path.parent / "my_reward.py").write_text(REWARD)
    train(with_overrides(preset("tiny-grpo"), [
        "task.name=file", "task.options=", f"task.path={path}",
        f"task.reward={path.parent / 'my_reward.py'}:score",
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.steps=1", "train.prompts_per_step=4", "algo.responses_per_prompt=4",
        "train.mini_batch_size=16", "train.val_prompts=2", "train.progress=false",
        f"train.out_dir={out}", *sets]))


@pytest.mark.slow
def test_grpo_on_a_parquet_file_in_process(tmp_path: Path) -> None:
    _dataset(ROWS).to_parquet(tmp_path / "sums.parquet")
    _grpo(tmp_path / "run", tmp_path / "sums.parquet")
    assert len(_metrics(tmp_path / "run")) == 1


@pytest.mark.slow
def test_grpo_on_a_datasets_directory_with_a_validation_file(tmp_path: Path) -> None:
    _dataset(ROWS[:9]).save_to_disk(tmp_path / "train")
    _dataset(ROWS[9:]).save_to_disk(tmp_path / "val")
    _grpo(tmp_path / "run", tmp_path / "train", f"task.val_path={tmp_path / 'val'}")
    assert len(_metrics(tmp_path / "run")) == 1


# ---- reading -----------------------------------------------------------------------------------

def test_a_file_of_prompts_only_trains_with_a_reward_function_and_refuses_exact_match(
        tmp_path: Path) -> None:
    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": r["prompt"], "carry": r["carry"]}
                                            for r in ROWS])
    task = FileTask(prompts)  # no "answer" column, none asked for: answers are ""
    assert {p.answer for p in task.train_prompts()} == {""}
    assert task.max_response_tokens == 64  # nothing to size it from
    with pytest.raises(ValueError, match=r"has no column 'answer'.*task\.reward.*rule_weight=0"):
        task.reward(task.train_prompts()[0], "1")
    with pytest.raises(ValueError, match=r"no column 'answer' \(task\.answer_key\)"):
        FileTask(prompts, answer_key="answer")  # named: it must exist
    module = tmp_path / "longest.py"
    module.write_text("def score(prompt, response, answer, **metadata):\n"
                      "    return float(len(response.strip()))\n")
    _grpo(tmp_path / "run", prompts, f"task.reward={module}:score",
          "rollout.max_response_tokens=4")
    assert len(_metrics(tmp_path / "run")) == 1


def test_keys_metadata_and_alphabet_come_from_the_data(tmp_path: Path) -> None:
    rows = [{"question": r["prompt"], "sum": int(r["answer"]), "carry": r["carry"]}
            for r in ROWS]
    task = load_task("file", path=str(_jsonl(tmp_path / "d.jsonl", rows)),
                     prompt_key="question", answer_key="sum", val_share=0.25)
    prompts = [*task.train_prompts(), *task.val_prompts()]
    assert sorted(p.text for p in prompts) == sorted(r["prompt"] for r in ROWS)
    first = next(p for p in prompts if p.text == "0+7=")
    assert (first.answer, dict(first.metadata)) == ("7", {"carry": False})
    assert task.alphabet == "".join(sorted(set("".join(r["prompt"] + r["answer"]
                                                        for r in ROWS))))
    assert task.max_response_tokens == 3  # "12" and EOS
    assert task.reward(first, " 7\n") == 1.0 and task.reward(first, "8") == 0.0
    # the char tokenizer of a tiny run: the task's alphabet, or task.alphabet where set
    config = with_overrides(preset("tiny-grpo"), ["task.name=file", "task.options=",
                                                  f"task.path={tmp_path / 'd.jsonl'}"])
    assert make_tokenizer(config, task).alphabet == task.alphabet
    wider = with_overrides(config, ["task.alphabet=0123456789+=-"])
    assert make_tokenizer(wider, task).alphabet == "0123456789+=-"


def test_verl_chat_prompts_and_a_nested_ground_truth(tmp_path: Path) -> None:
    rows = [{"data_source": "sums", "prompt": [{"role": "user", "content": r["prompt"]}],
             "reward_model": {"style": "rule", "ground_truth": r["answer"]}} for r in ROWS]
    _dataset(rows).to_parquet(tmp_path / "verl.parquet")
    task = FileTask(tmp_path / "verl.parquet", answer_key="reward_model.ground_truth")
    p = task.train_prompts()[0]
    assert (p.text, p.answer) == (ROWS[0]["prompt"], ROWS[0]["answer"])
    assert dict(p.metadata) == {"data_source": "sums", "reward_model": {
        "style": "rule", "ground_truth": ROWS[0]["answer"]}}


def test_the_held_out_share_is_disjoint_and_the_same_every_time(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    task = FileTask(path, val_share=0.25)
    train, val = ({p.text for p in split} for split in (task.train_prompts(),
                                                        task.val_prompts()))
    assert len(val) == 3 and len(train) == 9 and not train & val
    assert train | val == {r["prompt"] for r in ROWS}
    assert FileTask(path, val_share=0.25).val_prompts() == task.val_prompts()
    assert {p.text for p in FileTask(path, val_share=0.25, seed=1).val_prompts()} != val
    assert [p.index for p in task.train_prompts()] == list(range(9))
    with pytest.raises(ValueError, match="not both"):
        with_overrides(preset("tiny-grpo"), ["task.val_path=v.jsonl", "task.val_share=0.2"])


def test_gsm8k_reads_through_the_file_task(tmp_path: Path) -> None:
    rows = [{"question": f"What is {n} + {n}?", "answer": f"{n} + {n} = {2 * n}\n#### {2 * n}"}
            for n in range(5)]
    _dataset(rows).save_to_disk(tmp_path / "gsm")  # a directory the old reader refused
    task = Gsm8kTask(tmp_path / "gsm", val_share=0.2, instruction="")
    assert isinstance(task, FileTask) and task.alphabet is None
    assert sorted(p.answer for p in [*task.train_prompts(), *task.val_prompts()]) == [
        "0", "2", "4", "6", "8"]
    # the same rows held out as the file task holds out of the same file
    plain = FileTask(tmp_path / "gsm", prompt_key="question", val_share=0.2)
    assert [p.text for p in task.val_prompts()] == [p.text for p in plain.val_prompts()]


def test_chat_template_auto_wraps_where_the_tokenizer_has_one(tmp_path: Path) -> None:
    _save_tiny_hf_tokenizer(tmp_path / "chat")
    auto = HFTokenizer(tmp_path / "chat", chat_template="auto")
    assert auto.uses_template and auto.encode("hello world") == [5, 7, 3, 4, 6, 7]
    _save_tiny_hf_tokenizer(tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink()  # a tokenizer without a template
    plain = HFTokenizer(tmp_path / "plain", chat_template="auto")
    assert not plain.uses_template and plain.encode("hello world") == [3, 4]
    with pytest.raises(ValueError, match="has no chat template"):
        HFTokenizer(tmp_path / "plain", chat_template=True)
    assert load_tokenizer("char:ab", chat_template="auto").encode("ab") == [2, 3]
    config = with_overrides(preset("tiny-grpo"), ["model.chat_template=auto"])
    assert config.model.chat_template == "auto"
    assert with_overrides(config, ["model.chat_template=true"]).model.chat_template is True
    with pytest.raises(ValueError, match="model.chat_template"):
        with_overrides(config, ["model.chat_template=maybe"])


# ---- errors, each one line -------------------------------------------------------------------

def _error(tmp_path: Path, *sets: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The one line `avrid ppo` prints for a file task set up with `sets` (exit status 2)."""
    capsys.readouterr()  # not what building the test's files printed
    with pytest.raises(SystemExit) as done:
        main(["ppo", "--preset", "tiny-grpo", "--task", "file", "--backend", "inprocess",
              "--out", str(tmp_path / "run"), *[f"--set={s}" for s in sets]])
    assert done.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_each_data_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    line = _error(tmp_path, f"task.path={data}", "task.prompt_key=question", capsys=capsys)
    assert f"{str(data)!r} has no column 'question' (task.prompt_key)" in line
    assert "its columns: prompt, answer, carry" in line
    line = _error(tmp_path, f"task.path={tmp_path / 'gone.jsonl'}", capsys=capsys)
    assert "gone.jsonl' does not exist" in line
    (tmp_path / "d.csv").write_text("prompt,answer\n1+1=,2\n")
    line = _error(tmp_path, f"task.path={tmp_path / 'd.csv'}", capsys=capsys)
    assert "unsupported type '.csv'; allowed: .jsonl, .json, .parquet, or a directory" in line
    (tmp_path / "empty.jsonl").write_text("\n")
    line = _error(tmp_path, f"task.path={tmp_path / 'empty.jsonl'}", capsys=capsys)
    assert "empty.jsonl' is empty" in line
    _dataset(ROWS).select([]).to_parquet(tmp_path / "none.parquet")
    line = _error(tmp_path, f"task.path={data}", f"task.val_path={tmp_path / 'none.parquet'}",
                  capsys=capsys)
    assert "none.parquet' has no rows" in line
    bad = _jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"prompt": 7, "answer": "1"}])
    line = _error(tmp_path, f"task.path={bad}", capsys=capsys)
    assert "bad.jsonl line 2: column 'prompt' must hold a non-empty string" in line
    bad = _jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[1], {"prompt": "1+1="}])
    line = _error(tmp_path, f"task.path={bad}", capsys=capsys)
    assert "bad.jsonl line 3: missing field 'answer'" in line


def test_without_datasets_the_error_says_how_to_install_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    with pytest.raises(ImportError, match=r"needs the datasets library: pip install datasets$"):
        FileTask(_jsonl(tmp_path / "d.jsonl", ROWS))
