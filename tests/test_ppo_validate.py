"""`validate` owns every rule that ties config fields together, and prompt sets are lazy.

Each rule is broken once through `with_overrides` (the command line's ``--set``) and must be
refused naming the field to change. A section alone does not check what spans sections: the
rule runs when the whole `PPOConfig` is made, or with the task when the trainer starts.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from avrid.ppo.data.prompts import PromptSet, prompt_batch, step_indices
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.config import AlgoConfig, PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.task import Prompt
from avrid.ppo.setup.tokenizer import CharTokenizer
from avrid.ppo.setup.validate import validate

pytestmark = pytest.mark.chapter(5)


def inprocess(out: Path, *extra: str) -> PPOConfig:
    return with_overrides(preset("tiny-ppo"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        f"train.out_dir={out}", "train.progress=false", *extra])


@pytest.mark.parametrize("overrides, field, says", [
    (["algo.name=grpo", "algo.responses_per_prompt=1"], "algo.responses_per_prompt",
     "needs >= 2"),
    (["algo.kl_in=loss", "algo.kl_kind=k1"], "algo.kl_kind", "k1 cannot be the KL in the loss"),
    (["placement.backend=inprocess", "placement.ray_address=auto"], "placement.ray_address",
     "backend='ray'"),
    (["placement.backend=inprocess", "placement.actor_dp=2"], "placement.backend",
     "actor_dp=1"),
    (["placement.actor_dp=1", "placement.critic_dp=2"], "placement.critic_dp",
     "critic_dp <= actor_dp"),
    (["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
      "placement.device=cuda"], "placement.device", "ray backend"),
    (["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
      "model.dtype=bfloat16"], "model.dtype", "backend='ray'"),
    (["rollout.engine=vllm", "model.hidden_size=64", "model.num_heads=4"], "model.num_heads",
     "head dim"),
    (["rollout.max_response_tokens=100", "train.micro_batch_tokens=150"],
     "train.micro_batch_tokens", r"64 \+ the response budget 100"),
])
def test_each_cross_field_rule_names_the_field(overrides: list[str], field: str,
                                               says: str) -> None:
    with pytest.raises(ValueError, match=rf"config field '{field}': .*{says}"):
        with_overrides(preset("tiny-ppo"), overrides)


def test_a_section_alone_does_not_check_what_spans_sections() -> None:
    lonely = AlgoConfig(name="grpo", responses_per_prompt=1)  # fine until it joins a config
    with pytest.raises(ValueError, match="algo.responses_per_prompt"):
        PPOConfig(algo=lonely)
    # The GPU preset is valid as a whole though it breaks in-process rules piece by piece.
    validate(preset("qwen-gsm8k"))


def test_rules_that_need_the_task_run_with_it() -> None:
    # No response budget in the config: the digit task's (length + 1 = 4) decides.
    config = with_overrides(preset("tiny-ppo"), ["rollout.max_prompt_tokens=8",
                                                 "train.micro_batch_tokens=11"])
    task = load_task("digits", length=3)
    validate(config)  # nothing to compare yet
    with pytest.raises(ValueError, match=r"train.micro_batch_tokens.*8 \+ the response "
                                         r"budget 4"):
        validate(config, task)
    validate(with_overrides(config, ["train.micro_batch_tokens=12"]), task)


def test_a_char_tokenizer_needs_the_tasks_alphabet() -> None:
    class NoAlphabet:
        name, alphabet, max_response_tokens = "words", None, 4

    with pytest.raises(ValueError, match="'model.tokenizer': task 'words' needs a real"):
        validate(preset("tiny-ppo"), NoAlphabet())  # type: ignore[arg-type]


def test_missing_local_paths_fail_when_the_trainer_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'model.path': no local directory"):
        Trainer(inprocess(tmp_path, "model.path=/nonexistent/model"))


# ---- prompt sets read only what a step needs -----------------------------------------------


def test_a_ten_million_prompt_task_starts_without_listing_its_prompts(tmp_path: Path) -> None:
    """The digit task computes its prompts (a keyed permutation of all digit strings); the
    prompt set tokenizes only the prompts a step reads, so 10**7 of them cost nothing."""
    trainer = Trainer(inprocess(tmp_path, "task.options=length:7,num_val:50",
                                "train.val_prompts=50"))
    assert len(trainer.train_set) == 10**7 - 50
    indices = step_indices(0, 4, len(trainer.train_set), seed=0)
    batch = prompt_batch(trainer.train_set, indices, repeats=2, first_id=0, split=0)
    assert batch.prompt_lens.tolist() == [8] * 8  # 7 digits and "="
    text = trainer.train_set.prompts[indices[0]].text
    assert list(trainer.train_set.token_ids(indices[0])) == trainer.tokenizer.encode(text)


def test_the_reward_worker_scores_a_hundred_million_prompt_task_without_listing_it() -> None:
    """The reward worker reads the task's splits by index, as the trainer does: building it
    for 8-digit strings (10**8 prompts) must not list them (it once took 15 GB and minutes)."""
    from avrid.ppo.roles.reward import RewardWorker
    from avrid.workers import WorkerIdentity

    started = time.monotonic()
    worker = RewardWorker(WorkerIdentity(role="reward", rank=0, world_size=1),
                          task_name="digits", task_options={"op": "reverse", "length": 8},
                          task_path=None, tokenizer=CharTokenizer("0123456789="))
    assert time.monotonic() - started < 5
    assert len(worker.splits[0]) > 9 * 10**7
    prompt = worker.splits[0][len(worker.splits[0]) - 1]  # the last one, computed
    assert len(prompt.text) == 9 and prompt.answer == prompt.text[:8][::-1]


def test_a_too_long_training_prompt_fails_when_read_naming_it() -> None:
    prompts = [Prompt(index=0, text="12=", answer="21"), Prompt(index=1, text="1234567=",
                                                                 answer="7654321")]
    s = PromptSet(prompts, CharTokenizer("0123456789="), max_tokens=4, split="train")
    assert s.token_ids(0) == tuple(CharTokenizer("0123456789=").encode("12="))
    with pytest.raises(ValueError, match=r"train prompt 1 \('1234567='\) has 8 tokens; "
                                         r"rollout.max_prompt_tokens allows 1..4"):
        s.token_ids(1)


def test_a_too_long_validation_prompt_fails_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="val prompt .* rollout.max_prompt_tokens allows 1..2"):
        Trainer(inprocess(tmp_path, "rollout.max_prompt_tokens=2"))  # "47=" has 3
