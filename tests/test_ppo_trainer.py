"""The PPO/GRPO loop end to end on tiny budgets: determinism, resume, backends, plug-ins, errors.

Runs use the in-process backend (one rank per role) unless a test is about Ray, so each takes
a couple of seconds; the Ray test uses the leak-checked `ray_cluster` fixture.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from avrid.ppo.driver.run import train
from avrid.ppo.outputs.checkpoint import latest_checkpoint, load_checkpoint
from avrid.ppo.outputs.shards import read_model_weights
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.task import Prompt
from tests.helpers import child_env

pytestmark = pytest.mark.chapter(5)

ROOT = Path(__file__).resolve().parents[1]

# Keys that measure the machine, not the algorithm: never compared between runs.
MACHINE = ("time/", "perf/", "sync/")


def tiny(out: Path, *extra: str, algo: str = "ppo") -> PPOConfig:
    """A seconds-long run: in-process, one rank per role, 8 prompts x 4 responses per step."""
    return with_overrides(preset("tiny-ppo"), [
        f"algo.name={algo}", "placement.backend=inprocess", "placement.actor_dp=1",
        "placement.critic_dp=1", "train.steps=3", "train.prompts_per_step=8",
        "algo.responses_per_prompt=4", "train.mini_batch_size=16", "train.val_prompts=16",
        "train.val_every=2", "train.progress=false", f"train.out_dir={out}", *extra])


def algorithmic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MACHINE)} for r in rows]


def test_two_runs_with_the_same_seed_give_identical_metrics(tmp_path: Path) -> None:
    a = train(tiny(tmp_path / "a"))
    b = train(tiny(tmp_path / "b"))
    assert len(a.rows) == 4  # step 0 (untrained validation) + 3 steps
    assert algorithmic(a.rows) == algorithmic(b.rows)
    c = train(tiny(tmp_path / "c", "train.seed=1"))
    assert algorithmic(c.rows) != algorithmic(a.rows)


def test_rollout_logprobs_equal_trainer_logprobs_in_a_run(tmp_path: Path) -> None:
    summary = train(tiny(tmp_path / "r"))
    for row in summary.rows[1:]:
        assert row["rollout/logprob_gap"] < 1e-5
        assert row["rollout/logprob_gap_max"] < 1e-4


def test_a_resumed_run_matches_an_uninterrupted_one(tmp_path: Path) -> None:
    full = train(tiny(tmp_path / "full", "train.steps=4"))
    out = tmp_path / "split"
    train(tiny(out, "train.steps=2"))
    resumed = train(tiny(out, "train.steps=4", "train.resume=true"))
    # Step 2's row differs only by the extra validation the shorter run did at its end.
    assert algorithmic(resumed.rows)[3:] == algorithmic(full.rows)[3:]
    assert [r["step"] for r in resumed.rows] == [0, 1, 2, 3, 4]
    a = load_checkpoint(latest_checkpoint(tmp_path / "full" / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    assert a.step == b.step == 4
    for model in ("actor", "critic"):
        wa, wb = read_model_weights(a.sharded[model]), read_model_weights(b.sharded[model])
        for name, t in wa.items():
            assert t.equal(wb[name]), f"{model}.{name} differs after resume"


def test_resume_refuses_a_changed_algorithm_setting(tmp_path: Path) -> None:
    train(tiny(tmp_path, "train.steps=1"))
    with pytest.raises(ValueError, match="algo.clip_high"):
        train(tiny(tmp_path, "train.steps=2", "train.resume=true", "algo.clip_high=0.3"))


@pytest.mark.slow
def test_ray_gives_the_same_metrics_as_in_process(tmp_path: Path, ray_cluster: None) -> None:
    local = train(tiny(tmp_path / "local", "train.steps=2"))
    on_ray = train(tiny(tmp_path / "ray", "train.steps=2", "placement.backend=ray"))
    assert algorithmic(on_ray.rows) == algorithmic(local.rows)


@pytest.mark.parametrize("extra", [
    ("algo.name=grpo",),
    ("algo.name=grpo", "algo.grpo_norm_by_std=false", "algo.loss_agg=seq-mean-token-sum-norm"),
    ("algo.kl_coef=0.01", "algo.kl_in=reward", "algo.kl_kind=k1"),
    ("algo.kl_coef=0.01", "algo.kl_in=loss", "algo.kl_kind=k3", "algo.entropy_coef=0.01"),
    ("algo.loss_agg=seq-mean-token-mean", "algo.dual_clip=none", "algo.value_clip=none"),
])
def test_algorithm_variants_run_every_phase_they_need(tmp_path: Path, extra: tuple) -> None:
    rows = train(tiny(tmp_path, "train.steps=1", *extra)).rows
    step = rows[1]
    assert all(math.isfinite(v) for v in step.values() if isinstance(v, float))
    has_critic = "algo.name=grpo" not in extra
    assert ("time/values" in step) == has_critic
    assert ("time/ref_logp" in step) == any("kl_coef" in e for e in extra)
    assert "time/weight_sync" in step and "time/actor_update" in step


# ---- plugging in a task -----------------------------------------------------------------------

class EchoFirstTask:
    """A custom task: answer with the first character of the prompt."""

    name = "echo-first"
    max_response_tokens = 2
    alphabet = "abc="

    def train_prompts(self) -> list[Prompt]:
        return [Prompt(index=i, text=f"{x}{y}=", answer=x)
                for i, (x, y) in enumerate((x, y) for x in "abc" for y in "abc")]

    def val_prompts(self) -> list[Prompt]:
        return self.train_prompts()[:3]

    def reward(self, prompt: Prompt, response: str) -> float:
        return 1.0 if response[:1] == prompt.answer else 0.0


class NanTask(EchoFirstTask):
    """Returns NaN for one prompt: the loop must stop and name it."""

    def reward(self, prompt: Prompt, response: str) -> float:
        return float("nan") if prompt.index == 4 else 0.0


def make_echo_task() -> EchoFirstTask:
    return EchoFirstTask()


def make_nan_task() -> NanTask:
    return NanTask()


def test_a_custom_task_plugs_in_by_module_and_factory(tmp_path: Path) -> None:
    summary = train(tiny(tmp_path, "task.name=tests.test_ppo_trainer:make_echo_task",
                         "task.options=", "train.steps=2"))
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].endswith("=") for s in samples)
    for s in samples:  # the reward the run logged is the custom task's
        assert s["reward"] == (1.0 if s["response"][:1] == s["prompt"][0] else 0.0)
    assert "val/reward" in summary.rows[-1]


def test_a_non_finite_user_reward_stops_the_step_naming_the_sample(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"sample \d+: task 'echo-first' returned reward nan "
                                        r"for prompt 4"):
        train(tiny(tmp_path, "task.name=tests.test_ppo_trainer:make_nan_task", "task.options=",
                   "train.val_prompts=2"))
    ckpts = tmp_path / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir()), "no checkpoint may be left behind"


# ---- bad configuration fails at start ---------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (["algo.name=reinforce"], "algo.name"),
    (["train.prompts_per_step=0"], "train.prompts_per_step"),
    (["train.mini_batch_size=0"], "train.mini_batch_size"),
    (["algo.clip_low=1.5"], "algo.clip_low"),
    (["algo.clip_high=-0.1"], "algo.clip_high"),
    (["algo.dual_clip=0.5"], "algo.dual_clip"),
    (["algo.kl_kind=k9"], "algo.kl_kind"),
    (["algo.loss_agg=sum-of-means"], "algo.loss_agg"),
    (["task.name=gsm8k"], "task.path"),
    (["placement.backend=inprocess", "placement.actor_dp=2"], "placement.backend"),
])
def test_bad_config_names_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        with_overrides(preset("tiny-ppo"), overrides)


@pytest.mark.parametrize("overrides, field", [
    (["model.path=/nonexistent/model"], "model.path"),
    (["task.name=gsm8k", "task.path=/nonexistent/gsm8k.jsonl"], "task.path"),
    (["train.micro_batch_tokens=4"], "train.micro_batch_tokens"),
])
def test_bad_config_fails_before_any_worker_starts(tmp_path: Path, overrides: list[str],
                                                  field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        train(tiny(tmp_path, *overrides))
    assert not (tmp_path / "checkpoints").exists()


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: tiny-ppo"):
        preset("huge")


# ---- the command -------------------------------------------------------------------------------

def _avrid(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "avrid.cli", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)


def test_the_command_trains_and_writes_its_outputs(tmp_path: Path) -> None:
    done = _avrid("ppo", "--algo", "grpo", "--backend", "inprocess", "--steps", "2",
                  "--out", str(tmp_path), "--set", "train.prompts_per_step=8",
                  "--set", "train.progress=false")
    assert done.returncode == 0, done.stderr
    assert "grpo finished" in done.stdout
    for name in ("metrics.jsonl", "samples.jsonl", "reward.png", "phases.png", "timeline.png",
                 "timeline.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_000002"


@pytest.mark.slow
def test_the_command_rejects_bad_input_with_a_message() -> None:
    done = _avrid("ppo", "--preset", "huge")
    assert done.returncode == 2 and "unknown preset 'huge'" in done.stderr
    done = _avrid("ppo", "--set", "train.steps=0")
    assert done.returncode == 2 and "train.steps" in done.stderr
