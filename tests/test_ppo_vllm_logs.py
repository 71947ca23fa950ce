"""vLLM's own output inside avrid's engine (`engines/vllm_logs.py`): kept at ERROR while the
engine works, everything put back afterwards, and shown in full on request (``--debug``,
``AVRID_DEBUG=1``, the user's own ``VLLM_LOGGING_LEVEL``).

The scope itself is checked without vLLM (it never imports it); the `vllm`-marked tests
build a real engine in a fresh process, where vLLM configures its logging for the first
time, as in a PPO worker. The whole command's screen in the vLLM tier is checked in
`test_ppo_output_clean.py`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from avrid import cli
from avrid.ppo.engines.vllm_logs import quiet_vllm, vllm_logs_wanted
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(5)

ROOT = Path(__file__).resolve().parents[1]


class Kept(logging.Handler):
    """Keeps the messages of every record that reaches the logger it is added to."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def vllm_logger() -> Iterator[tuple[logging.Logger, Kept]]:
    """The ``vllm`` logger at INFO (as vLLM configures it) with a handler that keeps what it
    gets; the logger's level and handlers are put back afterwards."""
    logger = logging.getLogger("vllm")
    level, kept = logger.level, Kept()
    logger.setLevel(logging.INFO)
    logger.addHandler(kept)
    try:
        yield logger, kept
    finally:
        logger.removeHandler(kept)
        logger.setLevel(level)


@pytest.fixture
def no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AVRID_DEBUG", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH"):
        monkeypatch.delenv(name, raising=False)


def shown(module: str) -> bool:
    """Whether a FutureWarning raised from a module named `module` (as vLLM's code raises
    torch's deprecations) gets through the warning filters in force."""
    with warnings.catch_warnings(record=True) as seen:
        try:
            exec(compile("import warnings\nwarnings.warn('old', FutureWarning)", "<x>", "exec"),
                 {"__name__": module})
        except FutureWarning:  # pytest -W error::FutureWarning: shown, as an error
            return True
    return bool(seen)


@pytest.mark.usefixtures("no_user_settings")
def test_inside_the_scope_vllm_logs_errors_only_and_its_warnings_are_ignored(
        vllm_logger: tuple[logging.Logger, Kept]) -> None:
    logger, kept = vllm_logger
    filters = list(warnings.filters)
    assert not vllm_logs_wanted()
    with quiet_vllm():
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"  # what vLLM configures itself from
        logging.getLogger("vllm.v1.worker").warning("Chat template warmup failed")
        logging.getLogger("vllm.v1.worker").error("a real failure")
        assert not shown("vllm.triton_utils.dispatcher") and not shown("vllm")
        assert shown("user_code") and shown("vllmx")  # anyone else's warnings still show
    assert kept.messages == ["a real failure"]
    # Put back: the variable, the logger's level, the warning filters.
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    assert logger.level == logging.INFO
    assert warnings.filters == filters
    logging.getLogger("vllm.v1.worker").warning("after")
    assert kept.messages[-1] == "after" and shown("vllm.triton_utils.dispatcher")


@pytest.mark.usefixtures("no_user_settings")
def test_the_scope_is_undone_on_an_error_and_a_nested_scope_leaves_it_to_the_outer(
        vllm_logger: tuple[logging.Logger, Kept]) -> None:
    logger, kept = vllm_logger
    with pytest.raises(RuntimeError, match="boom"), quiet_vllm():
        with quiet_vllm():  # e.g. the sink's load inside the engine's load_weights
            pass
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"  # the inner one undid nothing
        assert logger.level == logging.ERROR
        raise RuntimeError("boom")
    assert "VLLM_LOGGING_LEVEL" not in os.environ and logger.level == logging.INFO


@pytest.mark.parametrize(("name", "value"), [("AVRID_DEBUG", "1"),
                                             ("VLLM_LOGGING_LEVEL", "DEBUG"),
                                             ("VLLM_LOGGING_CONFIG_PATH", "/my/logging.json")])
@pytest.mark.usefixtures("no_user_settings")
def test_debug_or_the_users_own_vllm_settings_show_everything(
        monkeypatch: pytest.MonkeyPatch, vllm_logger: tuple[logging.Logger, Kept],
        name: str, value: str) -> None:
    logger, kept = vllm_logger
    monkeypatch.setenv(name, value)
    assert vllm_logs_wanted()
    with quiet_vllm():
        assert os.environ.get("VLLM_LOGGING_LEVEL") == (value if name == "VLLM_LOGGING_LEVEL"
                                                        else None)
        logging.getLogger("vllm.v1.worker").warning("Chat template warmup failed")
        assert shown("vllm.triton_utils.dispatcher")
    assert kept.messages == ["Chat template warmup failed"] and logger.level == logging.INFO


def test_avrid_ppo_debug_reaches_the_workers(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """``--debug`` is put in the environment before the run starts: Ray's workers (new
    processes of a local Ray) and the in-process backend read it from there."""
    import avrid.agents

    class Seen(Exception):
        pass

    def fake_train(config: object, log: object = None) -> None:
        raise Seen(os.environ.get("AVRID_DEBUG"))

    monkeypatch.delenv("AVRID_DEBUG", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # the CLI extends it
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(avrid.agents, "train", fake_train)  # what `avrid ppo` calls
    for argv, seen in ((["--debug"], "1"), ([], None)):
        with pytest.raises(Seen) as run:
            cli.main(["ppo", "--steps", "1", "--out", str(tmp_path / "run"), *argv])
        assert run.value.args == (seen,)
        monkeypatch.delenv("AVRID_DEBUG", raising=False)


# ---- a real engine (vllm tier) -----------------------------------------------------------------

ENGINE_SCRIPT = """
import json, logging, os, sys
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.engines.torch_engine import SamplingParams
from avrid.ppo.engines.vllm_engine import VllmEngine

spec = TinyModelSpec(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_positions=256)
policy = build_tiny_policy(spec, seed=0, pad_token_id=0)
policy.save_pretrained(sys.argv[1])
print("BUILD", flush=True)  # what comes before is the test's own (saving the model)
engine = VllmEngine(sys.argv[1], max_model_len=64, seed=0, dtype="float32",
                    load_format="dummy")
engine.load_weights(policy.named_parameters())
engine.generate([[5, 17, 301]], SamplingParams(max_new_tokens=4))
engine.close()
print("STATE " + json.dumps({"env": os.environ.get("VLLM_LOGGING_LEVEL"),
                             "level": logging.getLogger("vllm").level}), flush=True)
"""


def run_engine(tmp_path: Path, **env: str) -> tuple[list[str], dict]:
    """Build, load, generate and close a tiny VllmEngine in a fresh process; (the lines it
    printed from building the engine on, stdout and stderr together, the STATE line left
    out; that state)."""
    base = {k: v for k, v in child_env().items()
            if k not in ("AVRID_DEBUG", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH",
                         "PYTHONWARNINGS")}
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(tmp_path / "model")],
                          cwd=ROOT, env={**base, **env}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout
    lines = [line for line in done.stdout.split("BUILD\n", 1)[1].splitlines() if line.strip()]
    state = [json.loads(line[6:]) for line in lines if line.startswith("STATE ")]
    return [line for line in lines if not line.startswith("STATE ")], state[0]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_real_engine_prints_nothing_of_vllms_and_leaves_the_process_as_it_was(
        tmp_path: Path) -> None:
    lines, state = run_engine(tmp_path)
    assert state == {"env": None, "level": logging.NOTSET}  # as before the engine was built
    # The one line left: torch's C++ logger, whose level is fixed at process start.
    foreign = [line for line in lines if "NUMA binding" not in line]
    assert foreign == [], "\n".join(lines)


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "value"), [("AVRID_DEBUG", "1"),
                                             ("VLLM_LOGGING_LEVEL", "WARNING")])
def test_a_real_engine_shows_vllms_lines_on_request(tmp_path: Path, name: str,
                                                    value: str) -> None:
    lines, _ = run_engine(tmp_path, **{name: value})
    text = "\n".join(lines)
    assert "Chat template warmup failed" in text, text  # a WARNING with its traceback
    assert "Traceback" in text, text
