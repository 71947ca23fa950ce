"""A learned reward model as a role: transformers' scores, its three placements, its phase.

The reward model is a tiny random `Qwen2ForSequenceClassification` (num_labels=1) built from a
config and saved with its own character tokenizer (a vocabulary unlike the policy's, with a
BOS token the policy's has not), so every test checks the re-tokenization too. Training runs
use the in-process backend and one step; the Ray test starts the module's one cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.roles.reward_model import RewardModelWorker, padded_micro_batches
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.reward_functions import Sample
from avrid.ppo.setup.reward_model import RewardModelConfig
from avrid.ppo.setup.task import Prompt
from avrid.ppo.setup.tokenizer import response_text
from avrid.workers import WorkerIdentity

pytestmark = pytest.mark.chapter(5)

CHARS = "0123456789=+-*/ abcdefghijklmnopqrstuvwxyz:"


def save_reward_model(path: Path, *, num_labels: int = 1, pad: bool = True,
                      hidden: int = 32, classifier: bool = True) -> Path:
    """A random Qwen2 sequence classifier and its character tokenizer (BOS added) at `path`."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, processors
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
    )

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    raw = RawTokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))  # no merges: chars
    raw.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    raw.decoder = decoders.BPEDecoder()
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(str(path))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         num_labels=num_labels, pad_token_id=0 if pad else None,
                         max_position_embeddings=128)
    cls = Qwen2ForSequenceClassification if classifier else Qwen2ForCausalLM
    cls(config).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm"))


def transformers_scores(path: Path, texts: list[str]) -> torch.Tensor:
    """What transformers gives each text alone: ``model(**tokenizer(text)).logits``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([model(**tok(t, return_tensors="pt")).logits[0, 0] for t in texts])


def tiny(out: Path, *extra: str) -> PPOConfig:
    """One in-process step of 4 prompts x 4 responses."""
    return with_overrides(preset("tiny-ppo"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "train.steps=1", "train.prompts_per_step=4", "algo.responses_per_prompt=4",
        "train.mini_batch_size=16", "train.val_prompts=4", "train.progress=false",
        f"train.out_dir={out}", *extra])


@pytest.mark.parametrize("pad", [True, False])
def test_scores_equal_transformers_on_texts_of_different_lengths(tmp_path: Path,
                                                                 pad: bool) -> None:
    path = save_reward_model(tmp_path, pad=pad)
    # A budget of 40 tokens cuts these into several padded forwards of mixed lengths.
    config = RewardModelConfig(path=str(path), micro_batch_tokens=40)
    worker = RewardModelWorker(WorkerIdentity(role="reward_model", rank=0, world_size=1),
                               config=config, device="cpu",
                               reader={"task_name": "digits", "task_options": {},
                                       "task_path": None, "tokenizer": None})
    texts = ["12=21", "7=", "123456=654321 abc", "0", "99=99 9", "x" * 30]
    ours = worker.forward(worker.encode(texts))
    assert worker.encode(["1"]) == [[1, 4]]  # the RM's own tokenizer, its BOS added
    assert (ours - transformers_scores(path, texts)).abs().max() < 1e-5


def test_a_text_longer_than_the_reward_model_keeps_its_last_tokens(tmp_path: Path,
                                                                   rm_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    worker = RewardModelWorker(WorkerIdentity(role="reward_model", rank=0, world_size=1),
                               config=RewardModelConfig(path=str(rm_path)), device="cpu",
                               reader={"task_name": "digits", "task_options": {},
                                       "task_path": None, "tokenizer": None})
    assert worker.max_length == 128  # the checkpoint's max_position_embeddings
    long = "ab" * 100 + "=12"  # 204 tokens with BOS
    (ids,) = worker.encode([long])
    assert len(ids) == 128 and ids == worker.tokenize([long])[0][-128:]
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0, 0]
    assert abs(float(worker.forward([ids])[0]) - float(want)) < 1e-5
    short = RewardModelWorker(WorkerIdentity(role="reward_model", rank=0, world_size=1),
                              config=RewardModelConfig(path=str(rm_path), max_length=5),
                              device="cpu", reader={"task_name": "digits", "task_options": {},
                                                    "task_path": None, "tokenizer": None})
    assert short.encode(["1234567"]) == [[6, 7, 8, 9, 10]]  # the last five characters
    assert short.encode(["12"]) == [[1, 4, 5]]  # shorter: untouched, BOS and all


def test_padded_micro_batches_respect_the_budget() -> None:
    lengths = [3, 9, 4, 8, 20, 1]
    groups = padded_micro_batches(lengths, 16)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 16


def decoded(trainer: Trainer, batch) -> list[tuple[Prompt, str]]:  # noqa: ANN001 - a Batch
    """Every row's prompt and decoded response, read here on the driver."""
    prompts = trainer.task.train_prompts()
    out = []
    for i in range(len(batch)):
        row = batch.packed["tokens"].row(i)[int(batch.prompt_lens[i]):].tolist()
        out.append((prompts[int(batch.scalars["prompt_index"][i])],
                    response_text(row, trainer.tokenizer)))
    return out


@pytest.mark.parametrize("placement", ["critic", "pool", "policy"])
def test_ppo_trains_with_a_reward_model_in_each_placement(tmp_path: Path, rm_path: Path,
                                                          placement: str) -> None:
    config = tiny(tmp_path, f"reward_model.path={rm_path}",
                  f"reward_model.placement={placement}", "reward_model.weight=2.0",
                  "reward_model.rule_weight=0.5")
    with Trainer(config) as trainer:
        trainer.start()
        metrics, batch = trainer.train_step(0)
        model, rows = batch.scalars["model_score"], decoded(trainer, batch)
        expected = transformers_scores(rm_path, [p.text + r for p, r in rows])
        assert (model - expected).abs().max() < 1e-5
        # score = rule_weight x rule + weight x model
        rule = torch.tensor([trainer.task.reward(p, r) for p, r in rows])
        assert torch.allclose(batch.scalars["score"], 0.5 * rule + 2.0 * model, atol=1e-6)
        assert metrics["reward/model_score"] == pytest.approx(float(model.mean()), abs=1e-6)
        assert "actor/pg_loss" in metrics and "critic/loss" in metrics
        # Its own phase: a driver span and each rank's compute span on the timeline.
        names = {(lane.group, s.name) for lane in trainer.timeline.lanes for s in lane.spans}
        assert ("driver", "reward_model") in names and ("reward_model", "reward_model") in names
        assert "time/reward_model" in metrics
        assert "val/model_score" in trainer.validate()


def test_rule_weight_zero_scores_with_the_reward_model_alone(tmp_path: Path,
                                                             rm_path: Path) -> None:
    config = tiny(tmp_path, f"reward_model.path={rm_path}", "reward_model.rule_weight=0",
                  "algo.name=grpo")
    with Trainer(config) as trainer:
        trainer.start()
        metrics, batch = trainer.train_step(0)
    assert torch.equal(batch.scalars["score"], batch.scalars["model_score"])
    assert "time/reward" not in metrics and "reward/score" not in metrics


def test_each_placement_puts_the_reward_model_where_it_says(rm_path: Path) -> None:
    base = with_overrides(preset("tiny-ppo"), [f"reward_model.path={rm_path}"])
    where = {}
    for placement, extra in (("critic", ["placement.colocate_critic=false"]),
                             ("pool", ["reward_model.dp=3"]), ("policy", [])):
        config = with_overrides(base, [f"reward_model.placement={placement}", *extra])
        trainer = Trainer(config)
        plan = trainer.placement()
        where[placement] = sorted({(s.pool, s.bundle) for s in plan.slots
                                   if s.role == "reward_model"})
    assert where == {"critic": [("critic", 0), ("critic", 1)],
                     "pool": [("reward_model", 0), ("reward_model", 1), ("reward_model", 2)],
                     "policy": [("policy", 0), ("policy", 1)]}


@pytest.mark.parametrize(("setting", "message"), [
    ("reward_model.template={prompt}", "has no {response}"),
    ("reward_model.template={prompt}{answer}{response}", "unknown field {answer}"),
    ("reward_model.placement=judge", "unknown placement 'judge'; allowed: critic, pool, policy"),
])
def test_bad_reward_model_settings_fail_in_one_line(setting: str, message: str) -> None:
    with pytest.raises(ValueError, match="reward_model") as err:
        with_overrides(preset("tiny-ppo"), [setting])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_critic_placement_without_a_critic_is_refused(rm_path: Path) -> None:
    with pytest.raises(ValueError, match="grpo has no critic; use 'pool' or 'policy'"):
        with_overrides(preset("tiny-grpo"), [f"reward_model.path={rm_path}",
                                             "reward_model.placement=critic"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"classifier": False}, "is a Qwen2ForCausalLM, not a sequence classifier"),
    ({"num_labels": 3}, "has num_labels=3; a reward model has one output"),
])
def test_a_checkpoint_that_is_no_reward_model_is_refused(tmp_path: Path, kwargs: dict,
                                                         message: str) -> None:
    path = save_reward_model(tmp_path, **kwargs)
    config = with_overrides(preset("tiny-ppo"), [f"reward_model.path={path}"])
    with pytest.raises(ValueError, match="reward_model.path") as err:
        Trainer(config)
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no local directory"):
        Trainer(with_overrides(config, [f"reward_model.path={tmp_path / 'nothing'}"]))


def test_estimate_memory_counts_the_reward_model_where_it_is_placed(
        tmp_path: Path, rm_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from avrid.cli import main
    from avrid.ppo.setup.memory_estimate import estimate

    main(["ppo", "--preset", "tiny-ppo", "--set", f"reward_model.path={rm_path}",
          "--estimate-memory"])
    out = capsys.readouterr().out
    assert "reward model (pool):" in out and "per rank (placement.device=cpu: host memory): " \
        "reward_model rank (one of 1)" in out
    wide = save_reward_model(tmp_path / "wide", hidden=64)
    rm_bytes = {}
    for path in (rm_path, wide):
        config = with_overrides(preset("tiny-ppo"), [f"reward_model.path={path}",
                                                     "reward_model.placement=policy"])
        est = estimate(config)
        # Resident in every phase of the policy's rank; its own phase adds a forward.
        assert all(p.parts["rm"] > 0 for p in est.phases if p.gpu == "policy")
        own = next(p for p in est.phases if p.name == "reward model")
        assert own.gpu == "policy" and own.parts["activ"] > 0
        rm_bytes[path] = own.parts["rm"]
    # fp32 on CPU: 4 bytes per parameter of the trunk and the one-output head.
    small = sum(p.numel() for p in transformers_model(rm_path).parameters())
    assert rm_bytes[rm_path] == pytest.approx(4 * small, rel=0.02)
    assert rm_bytes[wide] > 2 * rm_bytes[rm_path]
    assert "rm" not in estimate(preset("tiny-ppo")).phases[0].parts or \
        estimate(preset("tiny-ppo")).phases[0].parts["rm"] == 0


def transformers_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path)


@pytest.mark.slow
def test_on_ray_a_pool_of_two_ranks_scores_as_transformers(tmp_path: Path, rm_path: Path,
                                                           ray_cluster: None) -> None:
    # OpenRLHF's layout on Ray: two reward model ranks in bundles of their own; the batch is
    # split over them by the token-aware plan and merged back in order. (The colocated
    # layouts' bundles: `test_each_placement_puts_the_reward_model_where_it_says`.)
    config = tiny(tmp_path, "placement.backend=ray", f"reward_model.path={rm_path}",
                  "reward_model.placement=pool", "reward_model.dp=2")
    with Trainer(config) as trainer:
        trainer.start()
        assert trainer.reward_model.world_size == 2
        metrics, batch = trainer.train_step(0)
        rows = decoded(trainer, batch)
        expected = transformers_scores(rm_path, [p.text + r for p, r in rows])
        assert (batch.scalars["model_score"] - expected).abs().max() < 1e-5
        ranks = {lane.label for lane in trainer.timeline.lanes if lane.group == "reward_model"}
        assert len(ranks) == 2 and "actor/pg_loss" in metrics


def test_a_reward_model_beside_a_multi_turn_task_is_refused(rm_path: Path) -> None:
    from avrid.agents.trainer import AgentTrainer

    config = with_overrides(preset("tiny-agent"), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        f"reward_model.path={rm_path}"])
    with pytest.raises(ValueError, match="a reward model would never be called; drop "
                                         "reward_model.path"):
        AgentTrainer(config)


def test_a_chat_template_builds_the_user_and_assistant_turns(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = save_reward_model(tmp_path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }} "
                         "{% endfor %}")
    tok.save_pretrained(str(path))
    config = RewardModelConfig(path=str(path), chat_template=True)
    worker = RewardModelWorker(WorkerIdentity(role="reward_model", rank=0, world_size=1),
                               config=config, device="cpu",
                               reader={"task_name": "digits", "task_options": {},
                                       "task_path": None, "tokenizer": None})
    sample = Sample(sample_id=0, prompt=Prompt(index=0, text="12=", answer="21"),
                    response="21")
    (text,) = worker.texts([sample])
    assert text == "u:12= a:21 "
    # The template holds its special tokens: none added (no BOS here, unlike a plain text).
    assert worker.encode([text])[0] == tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.gpu(count=1, duration_s=60, memory_gb=2)
def test_on_a_gpu_the_reward_model_runs_in_bf16_as_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = save_reward_model(tmp_path)
    worker = RewardModelWorker(WorkerIdentity(role="reward_model", rank=0, world_size=1),
                               config=RewardModelConfig(path=str(path), micro_batch_tokens=40),
                               device="cuda", reader={"task_name": "digits",
                                                      "task_options": {}, "task_path": None,
                                                      "tokenizer": None})
    assert next(worker.model.parameters()).dtype == torch.bfloat16  # the default on a GPU
    texts = ["12=21", "7=", "123456=654321 abc", "99=99 9"]
    ours = worker.forward(worker.encode(texts))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        theirs = torch.stack([model(**tok(t, return_tensors="pt").to("cuda")).logits[0, 0]
                              for t in texts]).float().cpu()
    assert ours.device.type == "cpu" and (ours - theirs).abs().max() < 2e-2
