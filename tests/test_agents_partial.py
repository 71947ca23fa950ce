"""Chapter 7's partial rollouts: a weight push that lands while episodes are generated.

- `WeightMailbox` alone (threads): a delivery during a generation waits for the next engine
  call and is installed there; with no generation it installs at once; the end of a
  generation installs what waits; failures and timeouts reach the receiving side.
- The async pipeline (in process, the rollout rank's "weights" lane; TorchEngine, and vLLM's
  CPU build in the vllm tier): a generation whose
  episodes are held at their first tool step until a push has arrived takes the new weights
  between its turns; every policy token's recorded log-prob is the one its recorded version's
  weights give (the first turn: the initial weights; the second: the trainer's after one
  update), and the batch trains at staleness 1, nothing dropped.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from avrid.agents.calc import CalcTask
from avrid.agents.env import StepResult
from avrid.agents.partial import WeightMailbox
from avrid.agents.pipelined import AgentRolloutWorker
from avrid.ppo.setup.task import Prompt

pytestmark = pytest.mark.chapter(7)


# ---- the mailbox ------------------------------------------------------------------------


def test_a_delivery_during_a_generation_loads_at_the_next_engine_call() -> None:
    box, loaded, got = WeightMailbox(version=0), [], []
    box.begin(0, timeout_s=1)
    receiver = threading.Thread(target=lambda: got.append(
        box.deliver(1, lambda: loaded.append("v1") or "sums", timeout_s=10)))
    receiver.start()
    deadline = time.monotonic() + 10
    while box.waiting is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert box.waiting == 1 and loaded == [] and box.version == 0  # the engine is untouched
    assert box.poll() == 1 and loaded == ["v1"]  # the boundary: loaded on this thread
    receiver.join(10)
    assert got == ["sums"] and box.waiting is None
    box.end()


def test_with_no_generation_a_delivery_loads_at_once_and_the_end_installs_what_waits() -> None:
    box = WeightMailbox()
    with pytest.raises(RuntimeError, match="no weights received yet"):
        box.poll()
    assert box.deliver(0, lambda: "now", timeout_s=1) == "now" and box.poll() == 0
    box.begin(0, timeout_s=1)
    got = []
    receiver = threading.Thread(target=lambda: got.append(box.deliver(
        3, lambda: "at the end", timeout_s=10)))
    receiver.start()
    while box.waiting is None:
        time.sleep(0.001)
    box.end()  # the generation ended before another engine call
    receiver.join(10)
    assert got == ["at the end"] and box.version == 3


def test_a_generation_launched_after_a_push_starts_from_its_weights() -> None:
    # On Ray the receive runs on the "weights" lane, so the generation launched after the
    # push may start before it loaded (seen: a batch launched at version 1 made by 0).
    box = WeightMailbox(version=0)
    receiver = threading.Timer(0.2, lambda: box.deliver(1, lambda: None, timeout_s=10))
    receiver.start()
    box.begin(1, timeout_s=10)  # waits for the push, then the generation runs
    assert box.poll() == 1
    box.end()
    receiver.join()
    with pytest.raises(TimeoutError, match="push of version 2, which did not load within"):
        box.begin(2, timeout_s=0.05)


def test_an_install_error_reaches_the_receiver_and_a_late_boundary_times_out() -> None:
    box, errors = WeightMailbox(version=0), []

    def bad() -> None:
        raise ValueError("checksum mismatch")

    def receive() -> None:
        try:
            box.deliver(1, bad, timeout_s=10)
        except ValueError as e:
            errors.append(str(e))

    box.begin(0, timeout_s=1)
    receiver = threading.Thread(target=receive)
    receiver.start()
    while box.waiting is None:
        time.sleep(0.001)
    assert box.poll() == 0  # the load failed: the engine keeps version 0
    receiver.join(10)
    assert errors == ["checksum mismatch"]
    with pytest.raises(TimeoutError, match="reached no engine-call boundary within 0.05 s"):
        box.deliver(2, lambda: None, timeout_s=0.05)
    assert box.waiting is None and box.poll() == 0  # withdrawn, not loaded later
    box.end()


# ---- the pipeline: a push lands between two turns ---------------------------------------


class _Gate:
    """Holds the second training generation's episodes at their first tool step until a
    push waits in the rollout rank's mailbox (so it lands mid-generation, every time)."""

    box: WeightMailbox | None = None
    hold = False
    generations = 0


GATE = _Gate()


@dataclass(slots=True)
class HeldEnv:
    """Two turns: the first always gets an observation (after the gate, if held), the
    second is the answer, scored by digit credit (so advantages are not all zero)."""

    prompt: Prompt
    turns: int = 0

    def reset(self) -> str:
        return self.prompt.text

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            deadline = time.monotonic() + 60
            while GATE.hold and GATE.box.waiting is None:
                assert time.monotonic() < deadline, "no push arrived during the generation"
                time.sleep(0.005)
            return StepResult(observation="1;", tool_calls=1)
        answer = self.prompt.answer
        credit = sum(a == b for a, b in zip(answer, action_text, strict=False)) / len(answer)
        return StepResult(observation="", reward=credit, done=True)


class HeldCalc(CalcTask):
    """The calc task's prompts and limits with `HeldEnv` episodes."""

    def make_env(self, prompt: Prompt) -> HeldEnv:
        return HeldEnv(prompt=prompt)


def make_task(**options: object) -> HeldCalc:
    return HeldCalc(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", [
    "torch",
    # vLLM's CPU build (the vllm tier): 2 heads of 64, the head size its attention supports.
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(600)])])
def test_a_push_lands_mid_generation_and_each_token_keeps_its_versions_weights(
        monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    from avrid.agents import AgentPipelinedTrainer
    from avrid.ppo.engines.models import initial_policy
    from avrid.ppo.setup.overrides import with_overrides
    from avrid.ppo.setup.presets import preset
    from tests.helpers import trainer_logprobs

    generate = AgentRolloutWorker.generate

    @functools.wraps(generate)  # the worker group checks the method by its name
    def counted(self: AgentRolloutWorker, shard, **kw):  # noqa: ANN001, ANN202
        if not kw["greedy"]:  # training batches (validation is greedy)
            GATE.generations += 1
        GATE.box, GATE.hold = self.mailbox, GATE.generations == 2 and not kw["greedy"]
        try:
            return generate(self, shard, **kw)
        finally:
            GATE.hold = False

    monkeypatch.setattr(AgentRolloutWorker, "generate", counted)
    monkeypatch.setattr(GATE, "generations", 0)
    cfg = with_overrides(preset("tiny-agent"), [
        "task.name=tests.test_agents_partial:make_task", "placement.backend=inprocess",
        "placement.actor_dp=1", "placement.critic_dp=1", "pipeline.mode=async",
        "pipeline.max_staleness=2", "pipeline.rollout_dp=1", "train.prompts_per_step=4",
        "algo.responses_per_prompt=4", "train.mini_batch_size=16", "train.val_prompts=8",
        "train.steps=2", "rollout.agent_schedule=turn_sync", "train.actor_lr=0.01",
        f"rollout.engine={engine}",
        *(["model.hidden_size=128", "model.num_heads=2"] if engine == "vllm" else [])])
    with AgentPipelinedTrainer(cfg) as tr:
        tr.start()
        assert tr.pushes_mid_generation
        tr.train_step(0)  # its update is version 1, pushed while step 1's episodes run
        metrics, batch = tr.train_step(1)
        tok = tr.tokenizer
    mask = batch.packed["action_mask"].values == 1
    versions = batch.packed["token_version"].values
    assert set(versions[mask].tolist()) == {0, 1} and len(batch) == 16  # none dropped
    assert batch.scalars["version"].tolist() == [0] * 16  # each sample's oldest token
    assert metrics["pipeline/staleness_token_max"] == 1.0
    assert 0.0 < metrics["pipeline/staleness_token_mean"] < 1.0
    assert metrics["pipeline/spanning_share"] == 1.0  # every episode took the push mid-way
    for half in ("short", "long"):  # every episode has tokens of both versions
        assert 0.0 < metrics[f"pipeline/staleness_token_mean_{half}"] < 1.0
    # Every token's log-prob is its version's: version 1 is what the trainer holds now (the
    # batch's old_logp), version 0 the initial weights.
    rollout, old = batch.packed["rollout_logp"].values, batch.packed["old_logp"].values
    new = mask & (versions == 1)
    assert (rollout[new] - old[new]).abs().max() < 1e-4
    assert (rollout[mask & (versions == 0)] - old[mask & (versions == 0)]).abs().max() > 1e-3
    model = initial_policy(cfg, vocab_size=tok.vocab_size, eos_id=tok.eos_token_id,
                           pad_id=tok.pad_token_id)
    rows = [(batch.packed["tokens"].row(i).tolist(), int(batch.prompt_lens[i]))
            for i in range(len(batch))]
    initial = torch.cat(trainer_logprobs(model.eval(), [r[:c] for r, c in rows],
                                         [r[c:] for r, c in rows],
                                         temperature=cfg.rollout.temperature,
                                         pad_id=tok.pad_token_id))
    first = mask & (versions == 0)
    assert (rollout[first] - initial[first]).abs().max() < 1e-4
    # Along each sample, versions never go back: the first turn is version 0, the rest 1.
    for i in range(len(batch)):
        row = batch.packed["token_version"].row(i)
        acts = row[batch.packed["action_mask"].row(i) == 1].tolist()
        assert acts == sorted(acts) and acts[0] == 0 and acts[-1] == 1


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("engine", [
    "torch", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(900)])])
def test_async_episodes_on_ray_take_pushes_on_the_weights_lane(engine: str) -> None:
    # On Ray the lane is an actor concurrency group: the push is received while `generate`
    # runs, and a generation launched after a push starts from it (the driver's stamp check,
    # `check_stamps`, would raise otherwise). Timing decides where pushes land, so this checks
    # what holds wherever they do; a token of the trainer's own version has its log-prob.
    from avrid.agents import AgentPipelinedTrainer
    from avrid.ppo.setup.overrides import with_overrides
    from avrid.ppo.setup.presets import preset

    cfg = with_overrides(preset("tiny-agent"), [
        "placement.backend=ray", "placement.actor_dp=1", "placement.critic_dp=1",
        "pipeline.mode=async", "pipeline.max_staleness=2", "pipeline.rollout_dp=1",
        "rollout.agent_segment_tokens=2", "train.prompts_per_step=4",
        "algo.responses_per_prompt=4", "train.mini_batch_size=16", "train.val_prompts=8",
        "train.steps=6", "train.progress=false", f"rollout.engine={engine}",
        *(["model.hidden_size=128", "model.num_heads=2"] if engine == "vllm" else [])])
    with AgentPipelinedTrainer(cfg) as tr:
        tr.start()
        steps = [tr.train_step(step) for step in range(cfg.train.steps)]
    for step, (metrics, batch) in enumerate(steps):
        assert metrics["pipeline/staleness_token_max"] <= 2 and len(batch) == 16
        mask = batch.packed["action_mask"]
        versions = batch.packed["token_version"]
        for i in range(len(batch)):
            acts = versions.row(i)[mask.row(i) == 1].tolist()
            assert acts == sorted(acts) and acts[0] == int(batch.scalars["version"][i])
            assert acts[-1] <= step  # never newer than the trainer when it trained
        # Tokens made by the weights the step trains with (version `step`: one update per
        # step) have the trainer's log-prob, wherever in the generation that version loaded.
        now = (mask.values == 1) & (versions.values == step)
        gap = (batch.packed["rollout_logp"].values - batch.packed["old_logp"].values)[now]
        assert gap.numel() == 0 or float(gap.abs().max()) < 1e-4, (step, float(gap.abs().max()))
