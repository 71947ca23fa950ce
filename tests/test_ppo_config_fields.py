"""Config fields of issue 27: the collective timeout, the rollout's GPU share, seed mode and
tensor parallelism — each checked when made (an error naming the field), documented in
``--help-config``, and the timeout carried to where the process group is made.

Not here: what the engine does with the seed mode (tests/test_ppo_vllm.py, the vllm tier).
"""

from __future__ import annotations

import math

import pytest
import torch

from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.setup.config import PPOConfig, RolloutConfig, TrainConfig
from avrid.ppo.setup.field_help import help_config
from avrid.workers import Worker, WorkerIdentity

pytestmark = pytest.mark.chapter(5)


class Joined(Exception):
    """Raised by the fake `init_distributed`: setup got as far as joining the group."""


def test_the_collective_timeout_reaches_init_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_init_distributed(self: Worker, backend: str = "gloo",
                              timeout_s: float = 60.0) -> None:
        seen.update(backend=backend, timeout_s=timeout_s)
        raise Joined

    monkeypatch.setattr(Worker, "init_distributed", fake_init_distributed)
    threads = torch.get_num_threads()  # a worker sets its own thread count: put it back
    try:
        config = PPOConfig(train=TrainConfig(collective_timeout_s=1234.5))
        worker = CriticWorker(WorkerIdentity(role="critic", rank=0, world_size=2),
                              config=config, vocab_size=16, pad_id=0)
        with pytest.raises(Joined):
            worker.setup()
    finally:
        torch.set_num_threads(threads)
    assert seen == {"backend": "gloo", "timeout_s": 1234.5}


def test_the_collective_timeout_is_checked() -> None:
    assert TrainConfig().collective_timeout_s == 600.0  # verl's order: minutes, not 60 s
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"'train\.collective_timeout_s'"):
            TrainConfig(collective_timeout_s=bad)


def test_tensor_parallelism_is_refused_naming_the_field_and_why() -> None:
    with pytest.raises(ValueError, match=r"'rollout\.tensor_parallel_size': only 1 is "
                                         r"supported, got 2: .*external_launcher"):
        PPOConfig(rollout=RolloutConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"'rollout\.tensor_parallel_size': must be > 0"):
        RolloutConfig(tensor_parallel_size=0)
    PPOConfig(rollout=RolloutConfig(tensor_parallel_size=1))  # allowed


def test_the_gpu_share_is_automatic_unless_given() -> None:
    from avrid.ppo.setup.rollout import gpu_memory_share

    auto = RolloutConfig(engine="vllm")
    assert auto.gpu_memory_utilization is None
    assert gpu_memory_share(auto, colocated=True) == 0.4  # beside the trainer: as before
    assert gpu_memory_share(auto, colocated=False) == 0.85  # a rollout pool's own GPU
    for given in (0.3, 1.0):
        mine = RolloutConfig(gpu_memory_utilization=given)
        assert gpu_memory_share(mine, colocated=True) == given
        assert gpu_memory_share(mine, colocated=False) == given
    for bad in (0.0, 1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match=r"'rollout\.gpu_memory_utilization'"):
            RolloutConfig(gpu_memory_utilization=bad)


def test_the_seed_mode_is_a_known_choice() -> None:
    assert RolloutConfig().seed_mode == "request"  # today's behaviour unless asked
    assert RolloutConfig(seed_mode="batch").seed_mode == "batch"
    with pytest.raises(ValueError, match=r"'rollout\.seed_mode': unknown seed mode 'step'; "
                                         r"allowed: request, batch"):
        RolloutConfig(seed_mode="step")  # type: ignore[arg-type]


def test_the_new_fields_are_in_help_config() -> None:
    text = help_config()
    for line in ('train.collective_timeout_s: float = 600.0',
                 'rollout.gpu_memory_utilization: float | null = null',
                 'rollout.seed_mode: "request" | "batch" = "request"',
                 'rollout.tensor_parallel_size: int = 1'):
        assert line in text
    assert "external_launcher" in help_config("rollout")  # the docstring says why only 1


def test_a_resume_may_change_the_memory_share_and_the_timeout_but_not_the_math() -> None:
    from avrid.ppo.driver.run import _check_resumable
    from avrid.ppo.setup.config_file import config_to_dict
    from avrid.ppo.setup.overrides import with_overrides

    # A checkpoint written before gpu_memory_utilization became automatic held 0.4.
    saved = config_to_dict(with_overrides(PPOConfig(), ["rollout.gpu_memory_utilization=0.4"]))
    now = with_overrides(PPOConfig(), ["train.resume=true", "train.collective_timeout_s=900"])
    _check_resumable(saved, config_to_dict(now))  # where and how long, not what: allowed
    hotter = with_overrides(now, ["rollout.temperature=0.5"])
    with pytest.raises(ValueError, match="cannot resume: .*rollout.temperature: 1.0 -> 0.5"):
        _check_resumable(saved, config_to_dict(hotter))
