"""Joining an existing Ray cluster: `start_ray(address)`, `avrid ppo --address`, and a PPO run
whose policy ranks are spread over two nodes.

The cluster is `ray.cluster_utils.Cluster` on this machine: a head and a second node, each
its own raylet, so Ray schedules over two real nodes — which share one IP, so the tests tell
nodes apart by Ray's node id. These tests run their own cluster, so they stop the session's
Ray first and leave Ray stopped (the `ray_cluster` fixture starts it again for later tests).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from avrid.workers import start_ray

pytestmark = pytest.mark.chapter(1)

NODE_CPUS = 2  # per node: one policy bundle (1 CPU) on each, with room to spare


def _ray_processes() -> set[int]:
    """Pids of this test process's Ray descendants (raylets, GCS, workers)."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def no_ray() -> Iterator[None]:
    """No Ray running in this process, before and after the test."""
    ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture
def two_nodes(no_ray: None) -> Iterator[Cluster]:
    """A head node and a second node of NODE_CPUS each; every process it started is gone
    after the test (checked)."""
    before = _ray_processes()
    # Workers at nice 0, as `start_ray` starts them: at Ray's default 15 they crawl on a
    # machine that is busy with anything else.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": NODE_CPUS, "_system_config": {"worker_niceness": 0}})
    try:
        cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
    # Workers exit once their raylet is gone: give them a moment, then nothing may be left.
    deadline = time.monotonic() + 15
    while (left := _ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {[psutil.Process(p).cmdline() for p in left]}"


def _alive_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]


def test_start_ray_joins_a_cluster_and_leaves_its_resources_alone(
        two_nodes: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    # Joined, not started: two nodes, and the cluster's CPUs, not a local Ray's default 8+.
    start_ray(two_nodes.address)
    assert len(_alive_nodes()) == 2
    assert ray.cluster_resources()["CPU"] == 2 * NODE_CPUS
    ray.shutdown()

    # "auto" finds it too: like `ray start --head`, the cluster recorded its address locally.
    start_ray("auto")
    assert set(_alive_nodes()) == {n.node_id for n in two_nodes.list_all_nodes()}
    ray.shutdown()

    # RAY_ADDRESS does the same; a caller's local-Ray sizing is ignored there (Ray refuses it).
    monkeypatch.setenv("RAY_ADDRESS", two_nodes.address)
    start_ray(num_cpus=16)
    assert ray.cluster_resources()["CPU"] == 2 * NODE_CPUS
    ray.shutdown()

    # ...but next to an explicit address it contradicts the caller: refused, nothing started.
    with pytest.raises(ValueError, match="num_cpus/num_gpus size a new local Ray"):
        start_ray(two_nodes.address, num_cpus=4)
    assert not ray.is_initialized()


def test_start_ray_with_local_ignores_ray_address(no_ray: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing there: joining would fail
    start_ray("local", num_cpus=3)
    assert ray.cluster_resources()["CPU"] == 3


@pytest.mark.parametrize(("address", "cause"), [
    ("127.0.0.1:1", "nothing answers at"),
    ("not-an-address", "Invalid address format"),
])
def test_an_unreachable_cluster_is_one_line_naming_the_address(
        no_ray: None, monkeypatch: pytest.MonkeyPatch, address: str, cause: str) -> None:
    start = time.monotonic()
    with pytest.raises(ConnectionError) as err:
        start_ray(address, connect_timeout_s=3)
    assert time.monotonic() - start < 10  # ray.init alone retries for minutes
    msg = str(err.value)
    assert msg.startswith(f"cannot join the Ray cluster at {address!r}: ") and cause in msg
    assert "\n" not in msg
    assert not ray.is_initialized()

    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(ConnectionError, match=r"\(from RAY_ADDRESS\)"):
        start_ray(connect_timeout_s=3)


def test_the_address_and_strategy_are_config_fields_checked_at_start(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from avrid import cli
    from avrid.ppo.driver.placement import build_placement
    from avrid.ppo.driver.run import _check_resumable
    from avrid.ppo.setup.config import PPOConfig
    from avrid.ppo.setup.config_file import config_to_dict
    from avrid.ppo.setup.overrides import with_overrides
    from avrid.ppo.setup.tokenizer import load_tokenizer

    monkeypatch.setattr(sys, "path", list(sys.path))  # `avrid ppo` adds the working dir
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    cli.main(["ppo", "--address", "auto", "--print-config", "json"])
    assert json.loads(capsys.readouterr().out)["placement"]["ray_address"] == "auto"

    base = PPOConfig()
    spread = with_overrides(base, ["placement.strategy=STRICT_SPREAD",
                                   "placement.colocate_critic=false"])
    plan = build_placement(spread, load_tokenizer("char:0123456789="),
                           max_response_tokens=4)
    assert [(p.name, p.strategy) for p in plan.pools] == [("policy", "STRICT_SPREAD"),
                                                          ("critic", "STRICT_SPREAD")]
    with pytest.raises(ValueError, match="'placement.strategy': unknown strategy 'RANDOM'; "
                                         "allowed: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"):
        with_overrides(base, ["placement.strategy=RANDOM"])
    with pytest.raises(ValueError, match="'placement.ray_address': 'auto' names a Ray cluster, "
                                         "but placement.backend is 'inprocess'"):
        with_overrides(base, ["placement.backend=inprocess", "placement.actor_dp=1",
                              "placement.critic_dp=1", "placement.ray_address=auto"])
    with pytest.raises(ValueError, match="'placement.ray_address': must be"):
        with_overrides(base, ["placement.ray_address= "])
    # Where a run runs is not what it computes: a resumed run may move onto a cluster.
    moved = with_overrides(base, ["placement.ray_address=10.0.0.5:6379",
                                  "placement.strategy=SPREAD"])
    _check_resumable(config_to_dict(base), config_to_dict(moved))


@pytest.mark.slow
def test_avrid_ppo_runs_on_a_two_node_cluster_with_the_policy_spread_over_both(
        two_nodes: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from avrid import cli
    from avrid.ppo.driver.trainer import Trainer

    # Record where the workers landed: their identities, as the backend completed them.
    placed: dict[str, Any] = {}
    start = Trainer.start

    def start_and_record(self: Trainer, *args: object, **kwargs: object) -> None:
        start(self, *args, **kwargs)
        placed["policy"] = self.policy.identities
        placed["critic"] = self.critic.identities
        # Read while the command is connected: it leaves the cluster when it ends.
        placed["nodes"] = tuple(_alive_nodes())
        placed["cpus"] = ray.cluster_resources()["CPU"]

    monkeypatch.setattr(Trainer, "start", start_and_record)
    # `avrid ppo` puts the working directory on sys.path and PYTHONPATH: undo that after.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "run"
    cli.main(["ppo", "--address", two_nodes.address, "--steps", "2", "--out", str(out),
              "--set", "placement.strategy=STRICT_SPREAD",
              "--set", "train.prompts_per_step=4", "--set", "algo.responses_per_prompt=2",
              "--set", "train.mini_batch_size=8", "--set", "train.val_prompts=8",
              "--set", "train.progress=false"])

    # It ran on the cluster it was given (the driver joined it, not a local Ray), and left
    # it when it ended: the command disconnects from the Ray it connected to.
    nodes = set(placed["nodes"])
    assert len(nodes) == 2 and placed["cpus"] == 2 * NODE_CPUS
    assert not ray.is_initialized()
    # One policy rank per node (STRICT_SPREAD), each colocated critic rank beside it.
    policy, critic = placed["policy"], placed["critic"]
    assert {p.node_id for p in policy} == nodes
    assert [c.node_id for c in critic] == [p.node_id for p in policy]
    # Every rank meets at rank 0's node for torch.distributed.
    for group in (policy, critic):
        assert {i.rendezvous.master_addr for i in group} == {group[0].node}

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert "actor/loss" in rows[-1] and "critic/loss" in rows[-1] and "val/reward" in rows[-1]
    assert (out / "export" / "model.safetensors").is_file()
