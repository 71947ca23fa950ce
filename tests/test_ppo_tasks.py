"""Tasks, rewards and tokenizers for chapter 5 (avrid.ppo.setup.task, .gsm8k, .tokenizer)."""

from __future__ import annotations

import json
import math
import pickle
import random
from pathlib import Path

import pytest

from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.digits import DIGIT_OPS, DigitTask
from avrid.ppo.setup.gsm8k import Gsm8kTask, extract_answer
from avrid.ppo.setup.task import Prompt, Task, check_reward
from avrid.ppo.setup.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

pytestmark = pytest.mark.chapter(5)

# --- a user-defined task, loaded below through "tests.test_ppo_tasks:make_custom_task" ---


class ParityTask:
    """The example of the setup/task.py docstring: is a 4-bit number even (E) or odd (O)?"""

    name = "parity"
    max_response_tokens = 2
    alphabet = "01=EO"

    def __init__(self, bits: int = 4) -> None:
        self.bits = bits

    def _prompts(self, numbers: range) -> list[Prompt]:
        return [Prompt(index=i, text=f"{n:0{self.bits}b}=", answer="EO"[n % 2])
                for i, n in enumerate(numbers)]

    def train_prompts(self) -> list[Prompt]:
        return self._prompts(range(12))

    def val_prompts(self) -> list[Prompt]:
        return self._prompts(range(12, 2**self.bits))

    def reward(self, prompt: Prompt, response: str) -> float:
        return 1.0 if response.strip() == prompt.answer else 0.0


def make_custom_task(**kwargs: int) -> ParityTask:
    return ParityTask(**kwargs)


def make_not_a_task() -> object:
    return object()


def make_empty_task() -> ParityTask:
    task = ParityTask()
    task.val_prompts = list  # type: ignore[method-assign]  # returns []
    return task


# --- DigitTask ---


@pytest.mark.parametrize(("op", "answer"), [("reverse", "183"), ("copy", "381"),
                                             ("sort", "138")])
def test_digit_ops_by_hand(op: str, answer: str) -> None:
    assert DIGIT_OPS[op]("381") == answer
    task = DigitTask(op=op, length=3, num_val=200)
    prompt = next(p for p in [*task.val_prompts(), *task.train_prompts()] if p.text == "381=")
    assert prompt.answer == answer


def test_digit_splits_are_disjoint_and_cover_everything() -> None:
    task = DigitTask(op="reverse", length=3, num_val=200, seed=1)
    val = [p.text for p in task.val_prompts()]
    train = [p.text for p in task.train_prompts()]
    assert (len(val), len(train)) == (200, 800)
    assert not set(val) & set(train)
    assert sorted(val + train) == [f"{n:03d}=" for n in range(1000)]
    assert [p.index for p in task.train_prompts()[:3]] == [0, 1, 2]
    assert task.train_prompts()[-1] == task.train_prompts()[799]
    assert all(p.answer == p.text[:-1][::-1] for p in task.val_prompts())


def test_digit_split_is_seeded_and_shuffled() -> None:
    a = [p.text for p in DigitTask(seed=0).val_prompts()]
    assert a == [p.text for p in DigitTask(seed=0).val_prompts()]
    assert a != [p.text for p in DigitTask(seed=1).val_prompts()]
    assert a != sorted(a)


def test_digit_long_strings_are_lazy() -> None:
    task = DigitTask(op="sort", length=8, num_val=1000)
    train = task.train_prompts()
    assert len(train) == 10**8 - 1000
    p = train[12_345_678]
    assert len(p.text) == 9 and p.answer == "".join(sorted(p.text[:-1]))


def test_digit_reward_partial_credit() -> None:
    task = DigitTask()
    p = Prompt(index=0, text="381=", answer="183")
    assert task.reward(p, "183") == 1.0
    assert task.reward(p, "180") == pytest.approx(2 / 3)
    assert task.reward(p, "18") == pytest.approx(2 / 3)
    assert task.reward(p, "999") == 0.0
    assert task.reward(p, "") == 0.0
    assert task.reward(p, "1834") == 1.0  # characters after the answer are ignored


def test_random_guesser_scores_below_untrained_level() -> None:
    task = DigitTask(op="reverse", length=3)
    rng = random.Random(0)
    rewards = [task.reward(p, "".join(rng.choice("0123456789") for _ in range(3)))
               for p in task.val_prompts()]
    assert sum(rewards) / len(rewards) < 0.3


def test_digit_task_members_and_errors() -> None:
    task = DigitTask(length=4, num_val=50)
    assert isinstance(task, Task)
    assert task.max_response_tokens == 5 and task.alphabet == "0123456789="
    assert task.name == "digits-reverse-4"
    assert pickle.loads(pickle.dumps(task)) == task
    with pytest.raises(ValueError, match="not one of"):
        DigitTask(op="add")
    with pytest.raises(ValueError, match="1..8"):
        DigitTask(length=9)
    with pytest.raises(ValueError, match="num_val"):
        DigitTask(length=2, num_val=100)


# --- tokenizers ---


def test_char_tokenizer_round_trip() -> None:
    tok = CharTokenizer(DigitTask.alphabet)
    ids = tok.encode("381=")
    assert min(ids) >= 2 and max(ids) < tok.vocab_size == 13
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == "381="
    assert pickle.loads(pickle.dumps(tok)) == tok
    assert pickle.loads(pickle.dumps(tok)).encode("9") == tok.encode("9")


def test_char_tokenizer_errors() -> None:
    tok = CharTokenizer("0123456789=")
    with pytest.raises(ValueError, match=r"'x' at position 2"):
        tok.encode("12x4")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([99])
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer("aa")


def _save_tiny_hf_tokenizer(path: Path) -> None:
    """A word-level tokenizer with a chat template, built in code: no download."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", "hello", "world", "user",
                                         "assistant", ":"])}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
    fast.save_pretrained(str(path))


def test_hf_tokenizer_from_a_local_directory(tmp_path: Path) -> None:
    _save_tiny_hf_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert tok.vocab_size == 8 and tok.eos_token_id == 1
    assert tok.pad_token_id == tok.eos_token_id  # no pad token: falls back to eos
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([3, 4, 1]) == "hello world"
    chat = HFTokenizer(tmp_path, chat_template=True)
    assert chat.encode("hello world") == [5, 7, 3, 4, 6, 7]  # user : hello world assistant :
    again = pickle.loads(pickle.dumps(chat))
    assert again.chat_template and again.encode("hello") == [5, 7, 3, 6, 7]
    assert isinstance(load_tokenizer(str(tmp_path)), HFTokenizer)


def test_stop_ids_include_every_eos_of_the_generation_config(tmp_path: Path) -> None:
    from avrid.ppo.setup.tokenizer import response_text

    _save_tiny_hf_tokenizer(tmp_path)
    assert HFTokenizer(tmp_path).stop_token_ids == (1,)  # no generation config: EOS alone
    # Qwen2.5-Instruct style: the turn ends at one id, the config lists another as well.
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 1]}')
    tok = HFTokenizer(tmp_path)
    assert tok.stop_token_ids == (1, 7)  # the tokenizer's EOS first, no repeats
    assert response_text([3, 4, 7, 5, 1], tok) == "hello world"  # cut at the first stop
    assert CharTokenizer("ab").stop_token_ids == (1,)


def test_hf_tokenizer_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        HFTokenizer(missing)


def test_load_tokenizer_specs() -> None:
    tok: Tokenizer = load_tokenizer("char:0123456789=")
    assert tok == CharTokenizer("0123456789=")
    assert load_tokenizer("char:ab").encode("ab") == [2, 3]
    with pytest.raises(ValueError, match="chat_template"):
        load_tokenizer("char:ab", chat_template=True)
    with pytest.raises(FileNotFoundError):
        load_tokenizer("/nonexistent/tokenizer")


# --- GSM8K ---

PROBLEMS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A car costs $1,200 and a bike $34. Total?", "answer": "1200+34\n#### 1,234"},
    {"question": "It is 2 degrees and drops 5.5. Now?", "answer": "2 - 5.5\n#### -3.5"},
]


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_parsing_and_split(tmp_path: Path) -> None:
    task = Gsm8kTask(_write_jsonl(tmp_path / "gsm.jsonl", PROBLEMS), val_share=0.3)
    assert isinstance(task, Task) and task.alphabet is None and task.name == "gsm8k"
    train, val = task.train_prompts(), task.val_prompts()
    assert (len(train), len(val)) == (2, 1)
    assert sorted(p.answer for p in [*train, *val]) == ["-3.5", "1234", "7"]
    assert [p.index for p in train] == [0, 1]
    assert all(p.text.endswith("after '####'.") for p in train)
    again = Gsm8kTask(tmp_path / "gsm.jsonl", val_share=0.3)
    assert again.val_prompts() == val  # seeded: the same split every time


def test_gsm8k_val_path(tmp_path: Path) -> None:
    train_file = _write_jsonl(tmp_path / "train.jsonl", PROBLEMS[:2])
    val_file = _write_jsonl(tmp_path / "test.jsonl", PROBLEMS[2:])
    task = Gsm8kTask(train_file, val_path=val_file, instruction="")
    assert [p.answer for p in task.train_prompts()] == ["7", "1234"]
    assert [p.text for p in task.val_prompts()] == [PROBLEMS[2]["question"]]


@pytest.mark.parametrize(("text", "expected"), [
    ("#### 1,234", "1234"),
    ("so the answer is\n#### -3.5", "-3.5"),
    ("#### $72.", "72"),
    ("the answer is 7", None),
    ("#### 5\nwait, recheck\n#### 6", "6"),
])
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_gsm8k_reward(tmp_path: Path) -> None:
    task = Gsm8kTask(_write_jsonl(tmp_path / "gsm.jsonl", PROBLEMS), val_path=tmp_path /
                     "gsm.jsonl")
    apples, cost, temp = task.train_prompts()
    assert task.reward(apples, "3 + 4 = 7\n#### 7") == 1.0
    assert task.reward(apples, "#### 7.0") == 1.0
    assert task.reward(apples, "#### 8") == 0.0
    assert task.reward(apples, "7") == 0.0
    assert task.reward(cost, "#### 1234") == task.reward(cost, "#### 1,234") == 1.0
    assert task.reward(temp, "#### -3.5") == 1.0
    graded = Gsm8kTask(tmp_path / "gsm.jsonl", format_score=0.1)
    assert graded.reward(apples, "#### 8") == 0.1


def test_gsm8k_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        Gsm8kTask(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROBLEMS[0]) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2: missing field 'answer'"):
        Gsm8kTask(bad)
    bad.write_text(json.dumps(PROBLEMS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        Gsm8kTask(bad)
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: field 'answer'"):
        Gsm8kTask(bad)
    with pytest.raises(ValueError, match="at least 2"):
        Gsm8kTask(_write_jsonl(tmp_path / "one.jsonl", PROBLEMS[:1]))


# --- load_task and check_reward ---


def test_load_task_builtins(tmp_path: Path) -> None:
    task = load_task("digits", op="copy", length=2, num_val=10)
    assert isinstance(task, DigitTask) and task.op == "copy"
    gsm = load_task("gsm8k", path=str(_write_jsonl(tmp_path / "g.jsonl", PROBLEMS)))
    assert isinstance(gsm, Gsm8kTask)
    with pytest.raises(ValueError, match="needs path"):
        load_task("gsm8k")
    with pytest.raises(TypeError, match="'digits'"):
        load_task("digits", colour="red")


def test_load_task_custom_factory() -> None:
    task = load_task("tests.test_ppo_tasks:make_custom_task", bits=5)
    assert isinstance(task, ParityTask) and task.bits == 5
    assert len(task.val_prompts()) == 20
    assert task.reward(task.val_prompts()[0], "E") == 1.0


def test_load_task_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'chess'.*'digits'.*'gsm8k'.*:factory"):
        load_task("chess")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_task("no_such_module_xyz:make")
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_task("tests.test_ppo_tasks:nope")
    with pytest.raises(TypeError, match=r"not a Task: missing \['name'"):
        load_task("tests.test_ppo_tasks:make_not_a_task")
    with pytest.raises(ValueError, match=r"val_prompts\(\) is empty"):
        load_task("tests.test_ppo_tasks:make_empty_task")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "x", "0.5", None, [1.0],
                                   True, False, 1e300, -1e7])
def test_check_reward_rejects_non_finite(value: object) -> None:
    prompt = Prompt(index=17, text="381=", answer="183")
    with pytest.raises(ValueError, match=r"'parity'.*prompt 17 \('381='\)"):
        check_reward(value, task_name="parity", prompt=prompt)


def test_check_reward_accepts_numbers() -> None:
    import numpy as np

    prompt = Prompt(index=0, text="1=", answer="1")
    assert check_reward(np.float32(0.5), task_name="t", prompt=prompt) == 0.5
    assert check_reward(-1e6, task_name="t", prompt=prompt) == -1e6
    with pytest.raises(ValueError, match="rewards must be numbers, not bool"):
        check_reward(np.bool_(True), task_name="t", prompt=prompt)
    assert isinstance(check_reward(1, task_name="t", prompt=prompt), float)
