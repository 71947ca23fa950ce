"""``--set task.options=``: one syntax, ``key:value,key:value``, read strictly (issue 42).

Each value is read as the type the task declares (the digit task's fields, a factory's
annotations); where none is declared, by its look, and ``nan`` is never a float. JSON, a part
without ``:``, a key given twice or one the task does not take are refused in one line that
names the option text, what is wrong and the syntax.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from avrid.cli import main
from avrid.ppo.setup.field_help import help_config
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.task_options import SYNTAX, parse_options

pytestmark = pytest.mark.chapter(5)


def make_open(**options: object) -> object:
    """A factory that declares nothing: every option is read by its look."""
    raise AssertionError("never called: only its signature is read")


def make_typed(*, mode: str = "x", temperature: float = 1.0, limit: int | None = None,
               strict: bool = False) -> object:
    """A factory whose options are typed by its annotations."""
    raise AssertionError("never called: only its signature is read")


def options(text: str, task: str = "digits") -> dict:
    return dict(with_overrides(preset("tiny-grpo"), [f"task.name={task}",
                                                     f"task.options={text}"]).task.options)


def test_a_valid_option_string_is_typed_by_the_task() -> None:
    assert options("op:sort,length:4") == {"op": "sort", "length": 4}
    assert options(" op : copy , num_val:10 ,") == {"op": "copy", "num_val": 10}
    assert options("") == {}
    typed = "tests.test_task_options:make_typed"
    assert parse_options("mode:7,temperature:2,limit:null,strict:true", typed) == {
        "mode": "7", "temperature": 2.0, "limit": None, "strict": True}
    # a class with an __init__ (not a dataclass): its parameters' annotations
    assert parse_options("format_score:0.2,seed:3,instruction:Think", "gsm8k") == {
        "format_score": 0.2, "seed": 3, "instruction": "Think"}


def test_undeclared_options_are_read_by_their_look_and_nan_stays_text() -> None:
    assert options("mode:nan,hint:true,call_weight:0.5,n:3,kind:hang",
                   "tests.test_task_options:make_open") == {
        "mode": "nan", "hint": True, "call_weight": 0.5, "n": 3, "kind": "hang"}
    assert parse_options("mode:nan", "tests.test_task_options:make_typed") == {"mode": "nan"}


@pytest.mark.parametrize("task, text, says", [
    ("digits", '{"op": "sort", "length": 4}', "JSON is not read here"),
    ("digits", "mode:nan", "task 'digits' takes no option 'mode'; it takes op, length, "
                           "num_val, seed"),
    ("digits", "op:reverse,length:nan", "length must be int (the task declares length: int), "
                                        "got 'nan'"),
    ("tests.test_task_options:make_typed", "temperature:nan",
     "temperature must be float (the task declares temperature: float), got 'nan'"),
    ("gsm8k", "seed:x", "seed must be int (the task declares seed: int), got 'x'"),
    ("digits", "op=sort", "'op=sort' has no ':'"),
    ("digits", "op:sort,op:copy", "key 'op' is given twice"),
    ("digits", "length:", "key 'length' has no value"),
    ("tests.test_task_options:make_open", '"mode":x', "has key '\"mode\"', not a name"),
])
def test_anything_else_is_one_line_naming_the_text_and_the_syntax(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, task: str, text: str,
        says: str) -> None:
    with pytest.raises(SystemExit) as done:
        main(["ppo", "--out", str(tmp_path), "--set", f"task.name={task}", "--set",
              f"task.options={text}"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith(f"avrid ppo: task.options={text!r}: ") and says in err, err
    assert "takes no option" in says or "declares" in says or SYNTAX in err
    assert len(err.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


def test_the_syntax_is_documented_in_help_config() -> None:
    text = help_config("task")
    assert "task.options: mapping" in text
    assert "key:value,key:value (task.options=op:sort,length:4; empty for none)" in \
           " ".join(text.split())
    assert "JSON and anything else are refused" in " ".join(text.split())
