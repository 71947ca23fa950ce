"""Chapter 5 — `avrid eval`: score a checkpoint, an export or the initial model on a task.

An evaluation is validation made thorough, and it runs on the trainer's own pieces: the
`Trainer` starts the same workers on the same placement (Ray or in process, either rollout
engine), loads the target as a resume does (`eval_target.py`), and each pass makes the
calls `Trainer.validate` makes (`scored_responses`): the policy ranks generate
(`Trainer.generator`), the reward worker scores (`Trainer.score`, with a reward model too
where the run has one). Two passes over the same prompts:

    greedy    one response per prompt, greedy, with validation's seed: on the validation
              prompts of a checkpoint's run this is the ``val/reward`` the run logged at
              that step, exactly (same prompts, same call, same weights; validation is
              greedy unless the run set ``rollout.val_greedy=false``)
    sampled   `samples` responses per prompt at ``rollout.temperature`` (and top-k/top-p),
              for pass@k with the unbiased estimator (`algo/pass_at_k.py`) and the mean reward

A response passes when its reward is >= `EvalOptions.pass_threshold` (default 1.0: the built-in
tasks score 1 for a fully right answer and give partial credit below it). Reported: the mean
reward and pass@1 of the greedy pass; the mean reward and pass@k of the sampled one; response
lengths in tokens (mean, median, max) and the share cut off at the response budget.

What evaluation does not run is switched off in its config (`eval_config`): the reference
model (``algo.kl_coef`` = 0) and chapter 6's pipeline (the policy's own engine generates).
A PPO run's critic is not started: evaluation runs under an estimator without one.

Not here: which paths are targets (`eval_target.py`), the files it writes
(`outputs/eval_files.py`), the command line (`avrid/commands/eval.py`).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from avrid.dispatch import Batch
from avrid.ppo.algo.pass_at_k import mean_pass_at_k
from avrid.ppo.data.columns import with_responses
from avrid.ppo.data.prompts import TRAIN, VAL, PromptSet, prompt_batch
from avrid.ppo.driver.eval_target import EvalTarget
from avrid.ppo.driver.trainer import Trainer, step_seed
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.pipeline import PipelineConfig
from avrid.ppo.setup.tokenizer import response_text
from avrid.results import run_shards

SPLITS = ("val", "train")
"""The prompt splits an evaluation reads."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalOptions:
    """What to evaluate on and how (`avrid eval`'s flags)."""

    split: str = "val"
    """"val" (the task's validation prompts) or "train"."""
    prompts: int | None = None
    """How many of the split's prompts, from its first; None: ``train.val_prompts``."""
    samples: int = 8
    """Sampled responses per prompt (n of pass@k); 0: the greedy pass only."""
    ks: tuple[int, ...] = (1, 4, 8)
    """The k of each pass@k reported; each <= `samples`."""
    pass_threshold: float = 1.0
    """A response passes when its reward is >= this."""
    seed: int | None = None
    """The sampled pass's seed; None: one derived from ``train.seed`` (not validation's)."""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"--split {self.split!r} is not a split; allowed: "
                             f"{', '.join(SPLITS)}")
        if self.prompts is not None and self.prompts < 1:
            raise ValueError(f"--prompts must be >= 1, got {self.prompts}")
        if self.samples < 0:
            raise ValueError(f"--samples must be >= 0 (0: greedy only), got {self.samples}")
        if self.samples and (bad := [k for k in self.ks if not 1 <= k <= self.samples]):
            raise ValueError(f"pass@k needs 1 <= k <= --samples ({self.samples}); --k has "
                             f"{', '.join(map(str, bad))}: raise --samples or lower --k")


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalReport:
    """What an evaluation found: one row per prompt and the summary."""

    rows: list[dict[str, Any]]
    """Per prompt: index, text, answer, the greedy response and every sampled one (text,
    reward, length in tokens, truncated), and how many samples passed."""
    summary: dict[str, Any]
    """The metrics and what was evaluated (see the module docstring)."""


def eval_config(config: PPOConfig, target: EvalTarget, options: EvalOptions) -> PPOConfig:
    """`config` as the evaluation runs it: the target loaded (`EvalTarget.prepared`), no
    reference model, the synchronous loop, and ``train.val_prompts`` = `options.prompts`."""
    config = target.prepared(config)
    t = config.train
    if options.prompts is not None:
        t = dataclasses.replace(t, val_prompts=options.prompts)
    # Evaluation reads no values: a PPO run is evaluated under an estimator without a critic
    # (nor groups), so no critic is placed, built or loaded. Generation and reward are the same.
    name = "reinforce_plus_plus" if config.algo.uses_critic else config.algo.name
    return dataclasses.replace(config, algo=dataclasses.replace(config.algo, kl_coef=0.0,
                                                                name=name),
                               pipeline=PipelineConfig(), train=t)


def evaluate(config: PPOConfig, target: EvalTarget, options: EvalOptions) -> EvalReport:
    """Evaluate `target` under `config` (`eval_config`'s) with `options`; the workers are
    started and stopped here.

    Raises:
        ValueError: the config, the task or the target do not fit together (a char
            tokenizer's alphabet that is not the task's, a multi-turn task, a model that
            does not load), as training would refuse them.
    """
    with Trainer(config) as trainer:
        # Chapter 7's multi-turn tasks (`avrid.agents.env.is_agent_task`: a layer above this
        # one) run episodes with tools, which this single-turn evaluation does not.
        if hasattr(trainer.task, "make_env"):
            raise ValueError(f"task {config.task.name!r} is a multi-turn (agent) task; avrid "
                             f"eval scores single-turn tasks (one response per prompt)")
        alphabet = getattr(trainer.tokenizer, "alphabet", None)
        if target.char_alphabet is not None and alphabet != target.char_alphabet:
            raise ValueError(f"the {target.kind}'s char tokenizer has the alphabet "
                             f"{target.char_alphabet!r}, the task's is {alphabet!r}: "
                             f"evaluate it on a task with that alphabet (--set task.*)")
        trainer.start(target.weights, step=target.step or 0)
        pset, split = ((trainer.val_set, VAL) if options.split == "val"
                       else (trainer.train_set, TRAIN))
        count = min(len(pset), options.prompts or config.train.val_prompts)
        if count == 0:
            raise ValueError(f"the task has no {options.split} prompts to evaluate on")
        # The greedy pass is validation's, to the letter (`Trainer.validate`).
        greedy = scored_responses(
            trainer, prompt_batch(pset, range(count), repeats=1, first_id=0, split=split),
            greedy=True, seed=step_seed(config, -1))
        sampled = None
        if options.samples:
            seed = step_seed(config, -1) + 1 if options.seed is None else options.seed
            sampled = scored_responses(
                trainer, prompt_batch(pset, range(count), repeats=options.samples,
                                      first_id=count, split=split), greedy=False, seed=seed)
        rows = _rows(trainer, pset, count, greedy, sampled, options)
    return EvalReport(rows=rows, summary=_summary(config, target, options, greedy, sampled,
                                                  [r["passed"] for r in rows]))


def scored_responses(trainer: Trainer, prompts: Batch, *, greedy: bool, seed: int) -> Batch:
    """`prompts` with the trainer's policy's responses (one per row, up to its response
    budget) and their "score" column: the two calls `Trainer.validate` makes, with its
    arguments (tests/test_eval.py checks that the greedy pass gives its reward)."""
    gen = run_shards(*trainer.generator(), prompts, None, max_new_tokens=trainer.max_response,
                     greedy=greedy, seed=seed)
    return trainer.score(with_responses(prompts, gen.batch))[0]


def _responses(trainer: Trainer, batch: Batch, threshold: float) -> list[dict[str, Any]]:
    """Each row of a scored batch as text, reward, length, truncated and passed."""
    out = []
    for i in range(len(batch)):
        tokens = batch.packed["tokens"].row(i).tolist()
        reward = float(batch.scalars["score"][i])
        out.append({"response": response_text(tokens[int(batch.prompt_lens[i]):],
                                               trainer.tokenizer),
                    "reward": reward, "length": int(batch.response_lens[i]),
                    "truncated": bool(batch.scalars["truncated"][i]),
                    "passed": reward >= threshold})
    return out


def _rows(trainer: Trainer, pset: PromptSet, count: int, greedy: Batch, sampled: Batch | None,
          options: EvalOptions) -> list[dict[str, Any]]:
    """One row per prompt; a prompt's samples sit next to each other in `sampled`."""
    first = _responses(trainer, greedy, options.pass_threshold)
    drawn = [] if sampled is None else _responses(trainer, sampled, options.pass_threshold)
    n = options.samples
    rows = []
    for p in range(count):
        prompt = pset.prompts[p]
        mine = drawn[p * n:(p + 1) * n]
        rows.append({"index": prompt.index, "prompt": prompt.text, "answer": prompt.answer,
                     "greedy": first[p], "samples": mine,
                     "passed": sum(s["passed"] for s in mine)})
    return rows


def _lengths(batch: Batch, prefix: str) -> dict[str, float]:
    lengths = batch.response_lens.tolist()
    return {f"{prefix}/response_len": sum(lengths) / len(lengths),
            f"{prefix}/response_len_p50": float(statistics.median(lengths)),
            f"{prefix}/response_len_max": float(max(lengths)),
            f"{prefix}/truncation_rate": float(batch.scalars["truncated"].float().mean())}


def _summary(config: PPOConfig, target: EvalTarget, options: EvalOptions, greedy: Batch,
             sampled: Batch | None, passed: list[int]) -> dict[str, Any]:
    scores = greedy.scalars["score"]
    out: dict[str, Any] = {
        "target": None if target.path is None else str(target.path), "kind": target.kind,
        "step": target.step, "task": config.task.name, "split": options.split,
        "prompts": len(greedy), "samples": options.samples,
        "temperature": config.rollout.temperature, "pass_threshold": options.pass_threshold,
        "greedy/reward": float(scores.mean()),
        "greedy/pass@1": float((scores >= options.pass_threshold).float().mean()),
        **_lengths(greedy, "greedy")}
    if "model_score" in greedy.scalars:  # with a reward model: its share, as validation logs
        out["greedy/model_score"] = float(greedy.scalars["model_score"].mean())
    if sampled is not None:
        out["sampled/reward"] = float(sampled.scalars["score"].mean())
        for k in options.ks:
            out[f"sampled/pass@{k}"] = mean_pass_at_k(passed, options.samples, k)
        out.update(_lengths(sampled, "sampled"))
    return out


def summary_line(summary: dict[str, Any]) -> str:
    """The one line `avrid eval` prints: what was evaluated and its main numbers."""
    what = {"checkpoint": f"step {summary['step']} of {summary['target']}",
            "export": f"the export {summary['target']}",
            "initial": "the initial model"}[summary["kind"]]
    line = (f"{what} on {summary['prompts']} {summary['split']} prompts of {summary['task']}: "
            f"greedy reward {summary['greedy/reward']:.3f}, pass@1 "
            f"{summary['greedy/pass@1']:.3f}")
    if "sampled/reward" in summary:
        ks = [key for key in summary if key.startswith("sampled/pass@")]
        line += (f"; {summary['samples']} samples at temperature {summary['temperature']:g}: "
                 f"reward {summary['sampled/reward']:.3f}, "
                 + ", ".join(f"{k.removeprefix('sampled/')} {summary[k]:.3f}" for k in ks))
    return (line + f"; greedy response length {summary['greedy/response_len']:.1f} tokens "
            f"(max {summary['greedy/response_len_max']:.0f}, "
            f"{summary['greedy/truncation_rate']:.0%} cut off)")
