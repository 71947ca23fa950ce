"""A config as a file and the command line around it (issue 13).

`avrid ppo --print-config` writes YAML (or JSON) that `avrid ppo --config FILE` reads back to
the same config and the same text; precedence is preset | file < flags < --set; a bad file
is one line naming the field, exit status 2; `--help-config` documents every field; and
`avrid --version` says which avrid this is. Everything but the one short training run goes
through `avrid.cli.main` in this process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from avrid.cli import main
from avrid.ppo.outputs.checkpoint import latest_checkpoint
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.config_file import (
    config_from_dict,
    config_to_dict,
    dump_config,
    read_config,
    write_config,
)
from avrid.ppo.setup.field_help import field_docs
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import PRESETS, preset

pytestmark = pytest.mark.chapter(5)


@pytest.fixture(autouse=True)
def _keep_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """`avrid ppo` adds the working directory to sys.path and PYTHONPATH; undo it after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `avrid ARGS` run in this process."""
    try:
        main(list(args))
        code = 0
    except SystemExit as done:
        code = int(done.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_dicts_and_files(name: str, tmp_path: Path) -> None:
    config = preset(name)
    assert config_from_dict(config_to_dict(config)) == config
    json.dumps(config_to_dict(config))  # plain values only
    for file in ("c.yaml", "c.yml", "c.json"):
        assert read_config(write_config(config, tmp_path / file)) == config
    assert dump_config(read_config(tmp_path / "c.yaml")) == dump_config(config)


def test_a_file_may_leave_fields_out_and_they_take_their_defaults() -> None:
    config = config_from_dict({"algo": {"name": "grpo"}, "train": None})
    assert config == dataclasses.replace(PPOConfig(), algo=dataclasses.replace(
        PPOConfig().algo, name="grpo"))


@pytest.mark.parametrize("name", ["tiny-ppo", "qwen-gsm8k"])
def test_print_config_then_config_prints_the_same_text(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str) -> None:
    code, printed, _ = run_main(capsys, "ppo", "--preset", name, "--print-config")
    assert code == 0 and printed.startswith("model:\n")
    (tmp_path / "c.yaml").write_text(printed)
    code, again, _ = run_main(capsys, "ppo", "--config", str(tmp_path / "c.yaml"),
                              "--print-config")
    assert code == 0 and again == printed
    code, as_json, _ = run_main(capsys, "ppo", "--preset", name, "--print-config", "json")
    assert code == 0 and config_from_dict(json.loads(as_json)) == preset(name)


def test_flags_override_the_file_and_set_overrides_the_flags(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    file = write_config(preset("tiny-ppo"), tmp_path / "c.yaml")
    code, out, _ = run_main(capsys, "ppo", "--config", str(file), "--set", "train.steps=7",
                            "--print-config", "json")
    assert code == 0 and json.loads(out)["train"]["steps"] == 7
    code, out, _ = run_main(capsys, "ppo", "--config", str(file), "--steps", "3", "--seed", "5",
                            "--set", "train.steps=9", "--print-config", "json")
    assert code == 0
    assert (json.loads(out)["train"]["steps"], json.loads(out)["train"]["seed"]) == (9, 5)
    # A file is a whole config: --algo grpo changes algo.name only, not to the tiny-grpo preset.
    code, out, _ = run_main(capsys, "ppo", "--config", str(file), "--algo", "grpo",
                            "--print-config", "json")
    assert json.loads(out)["algo"]["name"] == "grpo"
    assert json.loads(out)["train"]["out_dir"] == "runs/tiny_ppo"


def test_preset_and_config_together_are_refused(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    file = write_config(preset("tiny-ppo"), tmp_path / "c.yaml")
    code, _, err = run_main(capsys, "ppo", "--preset", "tiny-grpo", "--config", str(file),
                            "--print-config")
    assert code == 2 and "--preset tiny-grpo and --config" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("text, names", [
    ("train:\n  stpes: 3\n", "train has no field 'stpes'; fields: steps,"),
    ("trian:\n  steps: 3\n", "unknown section 'trian'; allowed: model, task, algo"),
    ("train:\n  steps: ten\n", "config field 'train.steps': expected int, got a string 'ten'"),
    ("algo:\n  name: ppo2\n", "config field 'algo.name': unknown algorithm 'ppo2'; allowed"),
    ("rollout:\n  top_p: 1.5\n", "config field 'rollout.top_p': must be in (0, 1]"),
    ("task:\n  options: [1, 2]\n", "config field 'task.options': expected mapping"),
    ("- train\n", "a config is a mapping of sections"),
    ("train: {steps: 3\n", "not valid YAML at line 2"),
    ("", "the file is empty"),
])
def test_a_bad_file_is_one_line_naming_the_field(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path, text: str,
                                                 names: str) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    code, out, err = run_main(capsys, "ppo", "--config", str(file), "--print-config")
    assert code == 2 and out == ""
    assert err.startswith(f"avrid ppo: {file}: ") and names in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_bad_json_file_or_extension_is_one_line(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"train": {"steps": 3,}}')
    (tmp_path / "c.toml").write_text("")
    for file, names in (("bad.json", "not valid JSON"), ("c.toml", "must end in .yaml")):
        code, _, err = run_main(capsys, "ppo", "--config", str(tmp_path / file))
        assert code == 2 and names in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name, text, says", [
    ("two_sections.yaml", "train:\n  steps: 3\nalgo:\n  name: grpo\ntrain:\n  seed: 4\n",
     "duplicate key 'train' at line 5 (first at line 1)"),
    ("two_values.yaml", "train:\n  steps: 3\n  steps: 5\n",
     "duplicate key 'steps' at line 3 (first at line 2)"),
    ("flow.yaml", "train: {steps: 3, seed: 1, steps: 5}\n",
     "duplicate key 'steps' at line 1 (first at line 1)"),
    ("two_sections.json", '{"train": {"steps": 3},\n "algo": {"name": "grpo"},\n'
                          ' "train": {"seed": 4}}',
     "duplicate key 'train' at line 3 (first at line 1)"),
    ("two_values.json", '{"train": {\n  "steps": 3,\n  "seed": 1,\n  "st\\u0065ps": 5}}',
     "duplicate key 'steps' at line 4 (first at line 2)"),
])
def test_a_key_written_twice_is_refused_naming_it_and_its_lines(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, text: str,
        says: str) -> None:
    file = tmp_path / name
    file.write_text(text)
    code, out, err = run_main(capsys, "ppo", "--config", str(file), "--print-config")
    assert code == 2 and out == ""
    assert err.startswith(f"avrid ppo: {file}: {says}: each key may appear once"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_same_name_in_two_sections_and_a_yaml_merge_are_no_duplicates(
        tmp_path: Path) -> None:
    from avrid.ppo.setup.config_file import _json_duplicate  # the JSON scan, on its own

    file = tmp_path / "c.json"
    file.write_text('{"algo": {"name": "grpo"}, "task": {"name": "digits", "options": '
                    '{"k": ["name", "name"]}}}')
    assert read_config(file).algo.name == "grpo"
    assert _json_duplicate('[{"a": 1}, {"a": {"a": "a:"}}]') is None  # one "a" per object
    assert "duplicate key 'a' at line 2" in _json_duplicate('[{"b": {}, "a": [],\n"a": 2}]')
    file = tmp_path / "c.yaml"
    file.write_text("train: {<<: {steps: 3, seed: 2}, steps: 4}\n")  # a merge is overridden
    assert (read_config(file).train.steps, read_config(file).train.seed) == (4, 2)
    # Only avrid's reader is strict: PyYAML's own loader, the user's to use, is unchanged.
    assert yaml.safe_load("a: 1e-6\na: 2\n") == {"a": 2}


def test_one_type_rule_for_a_file_and_for_set(tmp_path: Path) -> None:
    """A file's value keeps its type; --set's text is read as the field's type, by the same
    rule: what a file refuses, --set refuses, and the other way round."""
    file = tmp_path / "c.yaml"

    def from_file(text: str) -> PPOConfig:
        file.write_text(text)
        return read_config(file)

    for text, says in [('train:\n  steps: "3"\n', "expected int, got a string '3' (a value "
                                                     "in a file keeps its type: write the "
                                                     "number without quotes)"),
                       ("train:\n  steps: 3.0\n", "expected int, got a float 3.0"),
                       ('train:\n  actor_lr: "1e-6"\n', "expected float, got a string"),
                       ('train:\n  progress: "true"\n', "expected bool, got a string"),
                       ("train:\n  progress: 1\n", "expected bool, got an int 1")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            from_file(text)
    read = from_file("train:\n  steps: 3\n  actor_lr: 1e-6\n  critic_lr: 1\n"
                     "  progress: no\n").train
    assert (read.steps, read.actor_lr, read.critic_lr, read.progress) == (3, 1e-6, 1, False)
    assert isinstance(read.actor_lr, float)  # YAML 1.2's 1e-6, not YAML 1.1's string
    for bad in ("train.steps=3.0", "train.steps=1e3", "train.progress=1"):
        with pytest.raises(ValueError, match=re.escape(f"override {bad.replace('=', '=' + chr(39))}"
                                                       f"': expected a value of type")):
            with_overrides(PPOConfig(), [bad])
    got = with_overrides(PPOConfig(), ["train.steps=3", "train.actor_lr=1e-6",
                                       "train.critic_lr=1", "train.progress=no",
                                       "train.out_dir=on"]).train
    assert (got.steps, got.actor_lr, got.critic_lr, got.progress, got.out_dir) == (
        3, 1e-6, 1.0, False, "on")


def test_help_config_lists_every_field_with_its_default(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "ppo", "--help-config")
    assert code == 0
    defaults = config_to_dict(PPOConfig())
    for section, values in defaults.items():
        docs = field_docs(type(getattr(PPOConfig(), section)))
        for name, value in values.items():
            [line] = [ln for ln in out.splitlines() if ln.lstrip().startswith(f"{section}.{name}:")]
            assert line.endswith(f" = {json.dumps(value)}"), line
            assert docs[name].splitlines()[0] in out, f"{section}.{name} has no docstring shown"
    assert 'algo.kl_in: "reward" | "loss" = "loss"' in out
    assert 'algo.name: str = "ppo"' in out  # a built-in estimator or "module:function"
    code, only, _ = run_main(capsys, "ppo", "--help-config", "algo")
    assert code == 0 and "algo.clip_low" in only and "train.steps" not in only
    code, _, err = run_main(capsys, "ppo", "--help-config", "trian")
    assert code == 2 and "unknown section 'trian'" in err
    code, out, _ = run_main(capsys, "ppo", "--help")
    assert code == 0 and "--help-config" in out and "--config FILE" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.startswith("avrid ") and len(out.splitlines()) == 1


def test_a_run_from_a_config_file_saves_that_config(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    small = ["train.progress=false", "train.val_prompts=4", "train.prompts_per_step=4",
             "algo.responses_per_prompt=4", "train.mini_batch_size=16"]
    code, printed, _ = run_main(capsys, "ppo", *[a for s in small for a in ("--set", s)],
                                "--print-config")
    assert code == 0
    file = tmp_path / "c.yaml"
    file.write_text(printed)
    out = tmp_path / "run"
    on_top = ["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1"]
    code, _, err = run_main(capsys, "ppo", "--config", str(file), "--steps", "2", "--out",
                            str(out), *[a for s in on_top for a in ("--set", s)])
    assert code == 0, err
    state = json.loads((latest_checkpoint(out / "checkpoints") / "state.json").read_text())
    expected = with_overrides(read_config(file), ["train.steps=2", f"train.out_dir={out}",
                                                  *on_top])
    assert config_from_dict(state["config"]) == expected


def test_the_algo_flag_offers_every_built_in_estimator() -> None:
    from avrid.cli import ALGOS
    from avrid.ppo.algo.registry import ADVANTAGE_ESTIMATORS

    assert ALGOS == tuple(ADVANTAGE_ESTIMATORS)
