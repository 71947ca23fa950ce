"""Each call carries only the columns its method reads (the roles' ``*_READS``), and
nothing changes.

The driver sends `batch.only(*reads)` to every worker method. If a list missed a column the
method reads, the worker would fail (a `KeyError`) — or, for the one column read with a
default (``loss_mask``), silently train on every sample. So each run below is made twice,
once as shipped and once with `Batch.only` sending every column, and must give the same
metrics bit for bit: under PPO, GRPO, the KL in the loss, masked truncations, an off-policy
correction, and chapter 6's one-step-off pipeline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from avrid.dispatch import Batch
from avrid.pipeline import make_trainer
from avrid.ppo.driver.run import train
from avrid.ppo.roles.policy import actor_update_reads
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

pytestmark = pytest.mark.chapter(5)

MACHINE = ("time/", "perf/", "sync/", "pipeline/overlap", "pipeline/queue")

CASES = {
    "ppo": [],
    "grpo": ["algo.name=grpo"],
    "kl in the loss": ["algo.kl_coef=0.05", "algo.kl_in=loss"],
    "masked truncations": ["algo.truncation=mask", "rollout.max_response_tokens=2"],
    "tis correction": ["pipeline.correction=tis"],
    "one step off": ["pipeline.mode=one_step_off"],
}


def run(out: Path, sets: list[str]) -> list[dict]:
    config = with_overrides(preset("tiny-ppo"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.steps=2", "train.prompts_per_step=4", "algo.responses_per_prompt=4",
        "train.mini_batch_size=8", "train.val_every=2", "train.val_prompts=8",
        "train.progress=false", f"train.out_dir={out}", *sets])
    rows = train(config, make_trainer=make_trainer).rows  # chapter 6's trainer per mode
    return [{k: v for k, v in r.items() if not k.startswith(MACHINE)} for r in rows]


@pytest.mark.parametrize("case", list(CASES))
def test_sending_only_what_a_method_reads_changes_nothing(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    only = run(tmp_path / "only", CASES[case])
    monkeypatch.setattr(Batch, "only", lambda self, *names: self)  # every column, every call
    everything = run(tmp_path / "all", CASES[case])
    assert len(only) == 3 and only == everything


def test_only_keeps_the_named_columns_and_names_an_unknown_one() -> None:
    batch = Batch.from_rows(sample_ids=[4, 2], prompt_lens=[1, 2], response_lens=[1, 0],
                            packed={"tokens": [torch.tensor([1, 2]), torch.tensor([3, 4])],
                                    "old_logp": [torch.tensor([0.5]), torch.tensor([])]},
                            scalars={"score": torch.tensor([1.0, 0.0]),
                                     "loss_mask": torch.ones(2)})
    kept = batch.only("tokens", "loss_mask")
    assert (list(kept.packed), list(kept.scalars)) == (["tokens"], ["loss_mask"])
    assert kept.packed["tokens"] is batch.packed["tokens"]  # shared, not copied
    assert torch.equal(kept.sample_ids, batch.sample_ids)
    with pytest.raises(KeyError, match=r"no column \['returns'\].*old_logp"):
        batch.only("tokens", "returns")


def test_the_actor_reads_what_its_loss_needs_under_each_config() -> None:
    base = preset("tiny-ppo")
    assert actor_update_reads(base) == ("tokens", "loss_mask", "old_logp", "advantages")
    kl = with_overrides(base, ["algo.kl_coef=0.1", "algo.kl_in=loss",
                               "pipeline.mode=one_step_off"])
    assert set(actor_update_reads(kl)) == {"tokens", "loss_mask", "old_logp", "advantages",
                                           "rollout_logp", "ref_logp"}
