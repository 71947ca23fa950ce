"""Chapter 5 — the order of the trained roles' setups in `Trainer.start`.

A critic colocated with the policy on a GPU where the policy starts a vLLM engine sets up
after the policy (`placement.critic_after_engine`): vLLM sizes its KV cache from the GPU
memory it finds free while profiling. Everywhere else (CPU runs above all) the two setups
run at once. The decision is checked on configs; the order itself is observed on the
in-process backend (its calls run in threads, as Ray's run in processes), with the
decision forced either way and the setups wrapped to record when they start and end.

Not here: vLLM's memory profiling itself (the vllm tier).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest

from avrid.ppo.driver import trainer as trainer_module
from avrid.ppo.driver.placement import critic_after_engine
from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

pytestmark = pytest.mark.chapter(5)

GPU_PPO = ["algo.name=ppo"]  # qwen-gsm8k: CUDA, vLLM, critic colocated; PPO has a critic


@pytest.mark.parametrize(("extra", "waits"), [
    (GPU_PPO, True),
    ([*GPU_PPO, "placement.colocate_critic=false"], False),  # a GPU of its own
    ([*GPU_PPO, "rollout.engine=torch"], False),  # sizes nothing at start
    ([], False),  # GRPO: no critic
])
def test_a_colocated_critic_waits_only_for_a_vllm_engine_on_cuda(extra: list[str],
                                                                 waits: bool) -> None:
    assert critic_after_engine(with_overrides(preset("qwen-gsm8k"), extra)) is waits


def test_cpu_presets_set_up_both_roles_at_once() -> None:
    for name in ("tiny-ppo", "tiny-ppo-vllm", "small-cpu", "pipeline-cpu"):
        assert not critic_after_engine(preset(name)), name


@pytest.mark.parametrize("serial", [True, False])
def test_the_trainer_follows_the_decision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          serial: bool) -> None:
    from avrid.ppo.driver.trainer import Trainer

    events: list[str] = []
    critic_started = threading.Event()

    def recorded(cls: type, name: str) -> None:
        original = cls.setup

        @functools.wraps(original)
        def setup(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            events.append(f"{name} start")
            if name == "critic":
                critic_started.set()
            elif not serial:  # at once: the critic starts while the policy is still busy
                events.append(f"critic seen: {critic_started.wait(60)}")
            out = original(self, *args, **kwargs)
            events.append(f"{name} end")
            return out

        monkeypatch.setattr(cls, "setup", setup)

    recorded(PolicyWorker, "policy")
    recorded(CriticWorker, "critic")
    monkeypatch.setattr(trainer_module, "critic_after_engine", lambda config: serial)
    cfg = with_overrides(preset("tiny-ppo"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.progress=false", f"train.out_dir={tmp_path}"])
    with Trainer(cfg) as trainer:
        trainer.start()
    if serial:
        assert events == ["policy start", "policy end", "critic start", "critic end"]
    else:
        assert events[:2] == ["policy start", "critic start"] or events[:2] == [
            "critic start", "policy start"], events
        assert "critic seen: True" in events and events.index("critic start") < events.index(
            "policy end"), events
