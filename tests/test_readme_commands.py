"""Every command the READMEs show (README.md and chapters/*/README.md) runs as written, on a
tiny budget, or is listed here with the reason it cannot run in a test.

A command is a line of a ```bash block, or an inline `code` span that starts with a program
(`avrid ...`, `make ...`, `python ...`, `pytest ...`, `pip ...`, `ray ...`, with leading
``VAR=value`` assignments). Each one is handled in one of these ways (`plan`):

- `avrid` commands run in this process through `avrid.cli.main`, in a scratch directory
  (relative paths such as ``runs/tiny_ppo`` land there; an absolute ``--out`` is moved under
  it). A training run gets `BUDGET` appended (one step, in-process workers: argparse keeps a
  flag's last value, so ``--steps 60`` becomes 1); ``--print-config``, ``--help-config``,
  ``--estimate-memory``, ``--print-graph``, ``export``, ``chapters`` and ``--version`` run as
  written.
  Commands that would build the same config (apart from `SAME_RUN`'s fields) train once:
  every command's config is still built, and a flag outside the config (``--debug``)
  changes only how an error is shown.
- `CONFIG_ONLY` commands need what a test machine lacks (a GPU, a Qwen checkpoint, another
  virtual environment, a cluster): their config is built (``--print-config`` appended), so
  their flags and ``--set`` values are checked.
- `make` commands are dry-run (``make -n``): the target exists and its recipe expands.
- `NOT_RUN` commands are run by another test, install packages or start daemons; any test
  file, benchmark or notebook they name must exist.

A file of the repository that a command names (``task.path=chapters/ch05_ppo/data/
pairs.jsonl``, a ``file.py:function`` spec) is copied into its scratch directory at the same
relative path, as it would be found from the repository root.

A command that fits none of these fails `test_every_readme_command_is_run_or_listed`: add it
to a list here, with its reason, or make it runnable. The python blocks: the README's first
taste runs; a block whose first line names a file (``# my_adv.py``) is that file. Such files,
the `Task` contract's example (``my_tasks.py``, in avrid/ppo/setup/task.py's docstring) and
`STAND_INS` (modules the READMEs leave to the learner) are written into every scratch
directory, for the commands that import them (``--task my_tasks:make_task``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from avrid.cli import CHAPTERS
from tests.helpers import child_env

pytestmark = pytest.mark.project

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted((ROOT / "chapters").glob("*/README.md"))]
PROGRAMS = ("avrid", ".venv/bin/avrid", ".venv-vllm/bin/avrid", "make", "python",
            ".venv/bin/python", ".venv-vllm/bin/python", "pytest", "pip", "ray", "source")
"""What an inline span must start with to be a command (after ``VAR=value`` assignments)."""

BUDGET = ("--steps", "1", "--backend", "inprocess")
"""Appended to a training command: one step, every role on threads of this process."""

AS_WRITTEN = ("--print-config", "--help-config", "--estimate-memory", "--print-graph")
"""`avrid ppo` flags that make it print and stop: such a command runs as written."""

CONFIG_ONLY = {
    "avrid ppo --preset qwen-gsm8k": "a GPU, vLLM and a local Qwen2.5 checkpoint "
                                     "(tests/test_ppo_gpu.py on the GPU tier)",
    ".venv-vllm/bin/avrid ppo": ".venv-vllm, vLLM's CPU build (tests/test_ppo_vllm_loop.py "
                                "runs tiny-ppo-vllm on the vLLM tier)",
    "avrid ppo --address auto": "a Ray cluster started with `ray start` "
                                "(tests/test_ray_multinode.py runs one on two nodes)",
    "avrid ppo --set reward_model.path=": "a local reward model checkpoint "
                                          "(tests/test_ppo_reward_model.py builds a tiny "
                                          "one and trains in each placement)",
}
"""Command prefix -> what it needs that a test here lacks; its config is built all the same."""

NOT_RUN = {
    "source .venv/bin/activate": "a shell builtin: it changes the shell it runs in",
    "pip ": "installs packages from an index (tests/test_packaging.py checks the extras)",
    "ray start": "starts a Ray cluster that outlives the command "
                 "(tests/test_ray_multinode.py starts and joins one)",
    "pytest ": "runs part of this suite, which `make test` runs whole",
    "python -m pytest": "runs part of this suite, which `make test` runs whole",
    "python -m chapters.": "a chapter's demo: tests/test_chapters.py runs each",
    ".venv/bin/python -m chapters.": "a chapter's demo: tests/test_chapters.py runs each",
    "avrid demo ": "chapter demos (`python -m chapters.X`): tests/test_chapters.py runs each",
    "python -c import nbformat, nbclient;": "executes a notebook: tests/test_chapters.py "
                                            "executes each",
    "python benchmarks/": "a benchmark: minutes of measuring, no pass or fail (`make bench`)",
    ".venv-vllm/bin/python benchmarks/": "a vLLM benchmark in .venv-vllm (`make bench`)",
    "avrid ppo needs ray:": "the message `avrid ppo` prints without the ppo extra, quoted",
}
"""Command prefix -> why a test does not run it."""

AFTER = {
    "avrid ppo --resume": "avrid ppo",
    "avrid export runs/tiny_ppo hf/": "avrid ppo",
    "avrid eval runs/tiny_ppo": "avrid ppo",
    "avrid ppo --config my.yaml --steps 2": "avrid ppo --print-config > my.yaml",
}
"""Commands that continue what another left in its directory: they run there, after it."""

STAND_INS = {
    "my_module": "# chapter 7, exercise 1: the learner's own AgentTask, whose factory (like\n"
                 "# most) takes none of the calculator's options\n"
                 "from avrid.agents.calc import CalcTask\n\n\n"
                 "def make_task():\n"
                 "    return CalcTask()\n",
}
"""Modules a README command imports that the READMEs leave to the learner to write."""


@dataclass(frozen=True)
class Command:
    """One command of a README: where it is, its words (quotes removed), its environment
    assignments and the file its output is redirected to."""

    where: str
    words: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    redirect: str | None = None

    @property
    def text(self) -> str:
        return " ".join(self.words) + (f" > {self.redirect}" if self.redirect else "")


FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.M | re.S)


def parse(where: str, line: str) -> Command | None:
    """The command on `line` (shell words; `VAR=value` in front and `> FILE` at the end taken
    apart), or None if it holds no command."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError as e:  # an unclosed quote: no shell would run it either
        raise ValueError(f"{where}: {line!r} is not a shell command: {e}") from None
    env = []
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        env.append(tuple(words.pop(0).split("=", 1)))
    redirect = None
    if len(words) > 2 and words[-2] == ">":
        redirect, words = words[-1], words[:-2]
    return Command(where, tuple(words), tuple(env), redirect) if words else None


def readme_commands() -> list[Command]:
    """Every command of every README, in reading order."""
    found = []
    for path in READMES:
        name, text = path.relative_to(ROOT), path.read_text()
        for block in FENCE.finditer(text):
            if block.group(1) != "bash":
                continue
            first = text.count("\n", 0, block.start(2)) + 1
            line, start = "", first
            for i, part in enumerate(block.group(2).splitlines()):
                line, start = line + part, start if line else first + i
                if line.endswith("\\"):  # continued on the next line
                    line = line[:-1] + " "
                    continue
                if (cmd := parse(f"{name}:{start}", line)) is not None:
                    found.append(cmd)
                line = ""
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for span in re.finditer(r"`([^`]+)`", prose):
            words = " ".join(span.group(1).split())
            program = re.sub(r"^([A-Z_]+=\S* )*", "", words).split(" ")[0]
            if program in PROGRAMS and " " in words:
                found.append(parse(f"{name}:{prose.count(chr(10), 0, span.start()) + 1}",
                                   words))
    return found


def readme_files() -> dict[str, str]:
    """The files the READMEs' python blocks give by name (first line ``# name.py``), and
    the modules the READMEs leave to the learner (`STAND_INS`, from avrid's own docs)."""
    files = {f"{name}.py": source for name, source in STAND_INS.items()}
    for path in READMES:
        for block in FENCE.finditer(path.read_text()):
            code = textwrap.dedent(block.group(2))
            if block.group(1) == "python" and re.match(r"# \w+\.py\n", code):
                files[code.split("\n", 1)[0][2:]] = code
    task_doc = (ROOT / "avrid" / "ppo" / "setup" / "task.py").read_text()
    example = task_doc.split("    # my_tasks.py\n", 1)[1].split("\nthen ", 1)[0]
    files["my_tasks.py"] = textwrap.dedent(example)  # the Task contract's own example
    return files


def repo_files(cmd: Command) -> list[str]:
    """The repository files `cmd` names by a relative path: a word, a ``--set`` value, or
    the file of a ``file.py:function`` spec."""
    names = []
    for word in cmd.words:
        value = word.split("=", 1)[-1]
        for candidate in (value, value.rpartition(":")[0]):
            if candidate and not candidate.startswith("/") and (ROOT / candidate).is_file():
                names.append(candidate)
    return names


def plan(cmd: Command) -> tuple[str, str]:
    """How `cmd` is tested: ("run" | "config" | "dry-run" | "skip", why), or ("", "") if
    nothing here says."""
    text = cmd.text
    for prefix, why in NOT_RUN.items():
        if text.startswith(prefix):
            return "skip", why
    for prefix, why in CONFIG_ONLY.items():
        if text.startswith(prefix) and not any(f in cmd.words for f in AS_WRITTEN):
            return "config", why
    if cmd.words[0] in ("avrid", ".venv/bin/avrid"):
        trains = cmd.words[1:2] == ("ppo",) and not any(f in cmd.words for f in AS_WRITTEN)
        return "run", "with BUDGET" if trains else "as written"
    if cmd.words[0] == "make":
        return "dry-run", "make -n"
    return "", ""


def named_paths(text: str) -> list[str]:
    """The repository files a command names: tests, benchmarks, notebooks, chapter demos."""
    paths = re.findall(r"\b((?:tests|benchmarks|notebooks)/[\w/.-]+\.(?:py|ipynb))", text)
    paths += [f"chapters/{m}/__main__.py" for m in re.findall(r"-m chapters\.(\w+)", text)]
    return paths


# ---- every command is accounted for (fast: nothing runs) ----------------------------------------

def test_every_readme_command_is_run_or_listed() -> None:
    commands = readme_commands()
    texts = {c.text for c in commands}
    assert len(texts) > 40, "the READMEs' commands were not found: has their markup changed?"
    unplanned = [f"{c.where}: {c.text}" for c in commands if plan(c)[0] == ""]
    assert not unplanned, ("commands neither run nor listed with a reason in "
                           "tests/test_readme_commands.py:\n" + "\n".join(unplanned))
    stale = [p for p in [*NOT_RUN, *CONFIG_ONLY] if not any(t.startswith(p) for t in texts)]
    assert not stale, f"listed, but no README has such a command any more: {stale}"
    order = list(dict.fromkeys(c.text for c in commands))  # first mention of each
    for then, first in AFTER.items():  # a chain's first command comes first in the READMEs
        assert first in order and then in order, (first, then)
        assert order.index(first) < order.index(then), (first, then)
    missing = [(c.where, p) for c in commands for p in named_paths(c.text)
               if not (ROOT / p).exists()]
    assert not missing, f"commands naming files that do not exist: {missing}"
    demos = [c for c in commands if c.words[:2] == ("avrid", "demo")]
    unknown = [c.text for c in demos if c.words[2] != "all"
               and not any(pkg.startswith(c.words[2]) for pkg, _ in CHAPTERS)]
    assert demos and not unknown, f"`avrid demo` of chapters that do not exist: {unknown}"


def test_every_module_a_readme_command_imports_is_given() -> None:
    files = readme_files()
    assert {"my_adv.py", "my_tasks.py"} <= set(files), sorted(files)
    for name, source in files.items():
        compile(source, name, "exec")  # each is whole Python
    imported = {m for c in readme_commands() if plan(c)[0] in ("run", "config")
                for m in re.findall(r"(?:^|[= ])(\w+):\w+", c.text)}
    assert imported and imported <= {n.removesuffix(".py") for n in files}, imported
    for path in READMES:  # a python block is the first taste (below) or a named file
        for block in FENCE.finditer(path.read_text()):
            if block.group(1) == "python":
                code = textwrap.dedent(block.group(2))
                assert code.startswith("from avrid.workers import") or \
                    re.match(r"# \w+\.py\n", code), (path, code[:80])


def test_readme_make_commands_name_real_targets() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    commands = {c.text: c for c in readme_commands() if plan(c)[0] == "dry-run"}
    assert "make demo" in commands and "make test" in commands, sorted(commands)
    for text, cmd in commands.items():
        run = subprocess.run(["make", "-n", *cmd.words[1:]], cwd=ROOT, env=child_env(),
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, f"{cmd.where}: {text}: {run.stderr.strip()}"


def test_readme_first_taste_runs() -> None:
    text = (ROOT / "README.md").read_text()
    code = text.split("## A first taste", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "hello you from greeter[1], dp=1" in run.stdout


# ---- the avrid commands run (in this process, a step each) -------------------------------------

def avrid(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`avrid ARGV` in this process: its exit status, stdout and stderr (a traceback as
    stderr, status -1, where avrid raised instead of exiting: a bug)."""
    from avrid.cli import main

    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else int(done.code is not None)
    except Exception:  # noqa: BLE001 - reported with the command that raised it
        print(traceback.format_exc(), file=sys.stderr)
        code = -1
    out, err = capsys.readouterr()
    return code, out, err


def argv_of(cmd: Command, scratch: Path) -> list[str]:
    """`cmd`'s arguments as `avrid.cli.main` takes them: an absolute --out moved under
    `scratch`, and what `plan` says is appended."""
    argv = list(cmd.words[1:])
    for i in range(1, len(argv)):
        if argv[i - 1] == "--out" and argv[i].startswith("/"):
            argv[i] = str(scratch / argv[i].lstrip("/"))
    kind, how = plan(cmd)
    if kind == "config":
        return [*argv, "--print-config"]
    return [*argv, *BUDGET] if how == "with BUDGET" else argv


SAME_RUN = ("out_dir", "seed", "progress", "checkpoint_every")
"""Fields of the train section that never change which code a one-step run goes through:
where the outputs go, the numbers drawn, the progress bar, when checkpoints are written (a
one-step run writes its last one)."""


def config_key(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """The config that `avrid ARGV` would train, as JSON without the `SAME_RUN` fields:
    (key, "") or ("", the error it printed)."""
    code, out, err = avrid([*argv, "--print-config", "json"], capsys)
    if code != 0:
        return "", f"exit {code}: {err.strip()}"
    config = json.loads(out)
    for name in SAME_RUN:
        config["train"].pop(name)
    return json.dumps(config, sort_keys=True), ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_avrid_commands_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # `avrid ppo` puts the working directory on sys.path and PYTHONPATH (a user's task module
    # is found there): both are put back after the test, as are the modules it imported.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    files = readme_files()
    commands = list({c.text: c for c in readme_commands()
                     if plan(c)[0] in ("run", "config")}.values())
    chains: dict[str, list[Command]] = {}  # each in a directory of its own, in README order
    for cmd in commands:
        chains.setdefault(AFTER.get(cmd.text, cmd.text), []).append(cmd)
    trained: dict[str, str] = {}  # config key -> the command that trained it
    failures, ran = [], []
    try:
        for n, chain in enumerate(chains.values()):
            scratch = tmp_path / f"{n:02d}"
            scratch.mkdir()
            for name, source in files.items():
                (scratch / name).write_text(source)
            for cmd in chain:
                for name in repo_files(cmd):
                    (scratch / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(ROOT / name, scratch / name)
                with monkeypatch.context() as here:
                    here.chdir(scratch)
                    for key, value in cmd.env:
                        here.setenv(key, value)
                    argv = argv_of(cmd, scratch)
                    if plan(cmd)[1] == "with BUDGET":
                        key, error = config_key(argv, capsys)
                        if error:
                            failures.append(f"{cmd.where}: {cmd.text}: {error}")
                            continue
                        if key in trained and len(chain) == 1:  # a chain needs its own run
                            ran.append(f"   same config as `{trained[key]}`: {cmd.text}")
                            continue
                        trained.setdefault(key, cmd.text)
                    start = time.perf_counter()
                    code, out, err = avrid(argv, capsys)
                ran.append(f"{time.perf_counter() - start:5.1f} s  avrid {' '.join(argv)}")
                if cmd.redirect:
                    (scratch / cmd.redirect).write_text(out)
                if code != 0:
                    failures.append(f"{cmd.where}: {cmd.text}: exit {code}: "
                                    f"{err.strip()[-1500:]}")
    finally:
        for name in files:
            sys.modules.pop(name.removesuffix(".py"), None)
    print("\n".join(ran))  # what ran, and how long each took (pytest -s shows it)
    assert not failures, "\n".join(failures)
