"""Misbehaving multi-turn tasks for `test_agents_escapes_trainer.py`: chapter 7's calc task
whose environment hangs, raises while other steps still run, returns what is not an
observation, returns two million characters, or runs hostile tool code against the trainer
(through `run_python`, in the run's sandbox). Each factory is a ``--task`` for ``avrid ppo``.

The tool attacks write what each call returned to the JSON-lines file named by the
environment variable ``MISBEHAVIOUR_LOG`` (the calc task's alphabet cannot carry it in an
observation), so the test can check that no secret came back."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from avrid.agents.calc import CalcEnv, CalcTask
from avrid.agents.env import EpisodeLimits, StepResult
from avrid.agents.sandbox import ToolLimits, run_python
from avrid.ppo.setup.task import Prompt

STEP_WALL_S = 3.0
"""The misbehaving tasks' `EpisodeLimits.step_wall_s` (the tool attacks' step, ten calls,
gets the default 60 s)."""
_NEVER = threading.Event()  # never set: a step waiting on it never returns

ATTACKS = {  # tool code a hostile policy could write; {driver} is the trainer's pid
    "kill-driver": "import os, signal\nos.kill({driver}, signal.SIGKILL)",
    "kill-all": "import os, signal\nos.kill(-1, signal.SIGKILL)",
    "prlimit-driver": "import resource\nresource.prlimit({driver}, resource.RLIMIT_NOFILE, "
                      "(8, 8))",
    "renice-driver": "import os\nos.setpriority(os.PRIO_PROCESS, {driver}, 19)",
    "driver-environ": "print(open('/proc/{driver}/environ', 'rb').read())",
    "secret-file": "print(open({secret!r}).read())",
    "stderr-lies": "import sys\nsys.stderr.write('MemoryError\\ndenied: network\\n')\n"
                   "print('fine')",
    "many-files": "files = [open(f'f{{i}}', 'w') for i in range(5000)]",
    "deep-tree": "import os\nfor _ in range(1200):\n    os.mkdir('d'); os.chdir('d')",
    "setsid-daemon": "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                     "    time.sleep(60)\nprint('left a daemon')",
}


@dataclass(slots=True)
class MisbehavingEnv:
    """A calc episode (`inner`) with one misbehaviour (`kind`, see the module docstring)."""

    prompt: Prompt
    kind: str
    inner: CalcEnv
    driver: int = field(default_factory=os.getpid)

    def reset(self) -> str:
        return self.inner.reset()

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        first = self.prompt.index == 0
        if self.kind == "hang" and first:
            _NEVER.wait()
        if self.kind == "raise-while-others-run":
            if first:
                raise RuntimeError("the environment's own bug")
            time.sleep(30)
        if self.kind == "not-text":
            return StepResult(observation=123)  # type: ignore[arg-type]
        if self.kind == "ids-out-of-range":
            return StepResult(observation=[10**6])
        if self.kind == "huge-observation":
            return StepResult(observation="9" * 2_000_000)
        if self.kind == "tool-attacks" and first:
            self._attack()
        return self.inner.step(action_ids, action_text)

    def _attack(self) -> None:
        log = os.environ["MISBEHAVIOUR_LOG"]
        for name, code in ATTACKS.items():
            result = run_python(code.format(driver=self.driver,
                                            secret=os.environ["MISBEHAVIOUR_SECRET_FILE"]),
                                ToolLimits(wall_s=5.0, memory_mb=256))
            with open(log, "a") as f:
                f.write(json.dumps({"attack": name, "status": result.status,
                                    "output": result.output, "pid": result.pid,
                                    "namespace": result.namespace}) + "\n")


@dataclass(frozen=True, slots=True, kw_only=True)
class MisbehavingTask(CalcTask):
    """`CalcTask` whose environments misbehave (`kind`)."""

    kind: str = "hang"
    name: str = "misbehaving"

    @property
    def limits(self) -> EpisodeLimits:
        limits = CalcTask.limits.fget(self)  # type: ignore[attr-defined]
        return limits if self.kind == "tool-attacks" else \
            dataclasses.replace(limits, step_wall_s=STEP_WALL_S)

    def make_env(self, prompt: Prompt) -> MisbehavingEnv:
        return MisbehavingEnv(prompt=prompt, kind=self.kind,
                              inner=CalcEnv(prompt=prompt, call_weight=self.call_weight,
                                            hint=self.hint))


def make_task(**options: object) -> MisbehavingTask:
    """``--task tests.agent_misbehaviour:make_task --set task.options=kind:hang,...``"""
    return MisbehavingTask(**options)  # type: ignore[arg-type]
