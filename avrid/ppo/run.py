"""Chapter 5 — a whole training run: resume, loop, validate, log, checkpoint, plot.

`train(config)` is what ``avrid ppo`` calls. Per step it calls `Trainer.train_step`, then
writes one JSON line of metrics (``metrics.jsonl``), a few rollout samples
(``samples.jsonl``) and, on schedule, a validation and an atomic checkpoint. At the end it
draws the reward curve, the per-phase times and the chapter 3 timeline of the last step, and
exports the final policy in Hugging Face format (`export.py`).

Output directory (``train.out_dir``)::

    metrics.jsonl        one line per step; step 0 is the untrained validation
    samples.jsonl        prompt, response, reward of a few rollouts per step
    checkpoints/         step_000050/ {actor,critic}.safetensors, *.optim.pt, state.json
    reward.png phases.png timeline.png timeline.json
    export/              the final policy: config.json, model.safetensors, generation_config.json
                         and the tokenizer (see export.py); loads with from_pretrained, serves
                         with vLLM

Resume (``train.resume=true``) loads the latest checkpoint, refuses a config that changes
anything but the schedule, drops metric lines after the checkpoint and continues; since every
random draw derives from (seed, step), the resumed run matches an uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from avrid.ppo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from avrid.ppo.config import PPOConfig
from avrid.ppo.critic_worker import CriticWorker
from avrid.ppo.export import export_checkpoint, tokenizer_record
from avrid.ppo.metrics import MetricsLogger, Progress, SampleDump, format_step, read_metrics
from avrid.ppo.plots import write_plots
from avrid.ppo.policy_worker import PolicyWorker
from avrid.ppo.reward_worker import response_text
from avrid.ppo.trainer import Trainer

SCHEDULE_FIELDS = ("steps", "resume", "progress", "val_every", "checkpoint_every",
                   "keep_checkpoints", "out_dir", "samples_per_step", "tensorboard",
                   "wandb_project")
"""`train` fields a resumed run may change; any other difference is refused."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    """What a finished run reports."""

    out_dir: Path
    rows: list[dict[str, Any]]
    """Every metrics line, as read back from metrics.jsonl."""
    initial_val_reward: float
    final_val_reward: float
    seconds: float
    """Wall time of this invocation (a resumed run counts only its own part)."""


def config_dict(config: PPOConfig) -> dict[str, dict[str, Any]]:
    """The config as plain JSON-able nested dicts (for state.json and loggers)."""
    return {s.name: {f.name: (dict(v) if isinstance(v := getattr(getattr(config, s.name),
                                                                     f.name), Mapping) else v)
                     for f in fields(getattr(config, s.name))}
            for s in fields(config)}


def train(config: PPOConfig, *, log: Callable[[str], None] | None = None) -> RunSummary:
    """Run (or resume) training as configured; see the module docstring."""
    started = time.time()
    t = config.train
    out = Path(t.out_dir)
    ckpt_root = out / "checkpoints"
    first, weights, optimizers = 0, None, None
    if t.resume and (latest := latest_checkpoint(ckpt_root)) is not None:
        ck = load_checkpoint(latest)
        _check_resumable(ck.state["config"], config_dict(config))
        first, weights, optimizers = ck.step, ck.weights, ck.optimizers
        if log:
            log(f"resuming from {latest} (step {first})")
    out.mkdir(parents=True, exist_ok=True)
    resume_step = first if weights is not None else None
    tb = str(out / "tensorboard") if t.tensorboard else None
    with (Trainer(config) as trainer,
          MetricsLogger(out / "metrics.jsonl", resume_step=resume_step, tensorboard_dir=tb,
                        wandb_project=t.wandb_project, run_config=config_dict(config)) as mlog,
          SampleDump(out / "samples.jsonl", resume_step=resume_step) as samples,
          Progress(t.steps, initial=first, enabled=t.progress) as bar):
        trainer.start(weights, optimizers)
        if first == 0:
            val = trainer.validate()
            mlog.log(0, val)
            if log:
                log(format_step(0, val, ["val/reward"]))
        for step in range(first, t.steps):
            metrics, batch = trainer.train_step(step)
            done = step + 1
            if done % t.val_every == 0 or done == t.steps:
                metrics.update(trainer.validate())
            mlog.log(done, metrics)
            samples.write(done, _samples(trainer, batch, t.samples_per_step))
            if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps:
                save(trainer, ckpt_root, done)
            bar.update(done, metrics)
            if log and not t.progress:
                log(format_step(done, metrics))
        rows = read_metrics(out / "metrics.jsonl")
        write_plots(rows, out, timeline=trainer.timeline)
    # After the workers are gone: reads the last checkpoint's actor weights back (page cache)
    # and writes one safetensors file; replaces the export of an earlier, resumed run.
    export_checkpoint(ckpt_root, out / "export", overwrite=True)
    vals = [r["val/reward"] for r in rows if r.get("val/reward") is not None]
    return RunSummary(out_dir=out, rows=rows, initial_val_reward=vals[0] if vals else float("nan"),
                      final_val_reward=vals[-1] if vals else float("nan"),
                      seconds=time.time() - started)


def save(trainer: Trainer, root: Path, step: int) -> Path:
    """Gather weights (rank 0) and per-rank optimizer states, write them atomically."""
    cfg = trainer.config
    weights, optimizers = {}, {}
    roles: list[tuple[str, Any, Any]] = [("actor", trainer.policy, PolicyWorker.state)]
    if trainer.critic is not None:
        roles.append(("critic", trainer.critic, CriticWorker.state))
    for name, group, method in roles:
        states = group.call(method)
        weights[name] = states[0]["weights"]
        optimizers[name] = [s["optimizer"] for s in states]
    # Every random draw is seeded from (train.seed, step), so the step IS the RNG state and
    # the data position; the driver's torch RNG is saved too for code that draws from it.
    state = {"step": step, "data_position": step * cfg.train.prompts_per_step,
             "rng": {"seed": cfg.train.seed, "derived_from": "(seed, step)"},
             "config": config_dict(cfg), "tokenizer": tokenizer_record(trainer.tokenizer)}
    return save_checkpoint(root, step, weights=weights, optimizers=optimizers, state=state,
                           extra={"torch_rng": torch.get_rng_state()},
                           keep_last=cfg.train.keep_checkpoints)


def _check_resumable(saved: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]) -> None:
    diffs = [f"{sec}.{k}: {saved.get(sec, {}).get(k)!r} -> {v!r}"
             for sec, values in now.items() for k, v in values.items()
             if not (sec == "train" and k in SCHEDULE_FIELDS)
             and saved.get(sec, {}).get(k) != v]
    if diffs:
        raise ValueError("cannot resume: the config differs from the checkpoint's in "
                         + "; ".join(diffs) + f" (only train.{{{', '.join(SCHEDULE_FIELDS)}}} "
                         "may change)")


def _samples(trainer: Trainer, batch, count: int) -> list[dict[str, Any]]:  # noqa: ANN001
    rows = []
    for i in range(min(count, len(batch))):
        tokens = batch.packed["tokens"].row(i).tolist()
        p = int(batch.prompt_lens[i])
        prompt = trainer.train_set.prompts[int(batch.scalars["prompt_index"][i])]
        rows.append({"prompt": prompt.text, "answer": prompt.answer,
                     "response": response_text(tokens[p:], trainer.tokenizer),
                     "reward": float(batch.scalars["score"][i])})
    return rows
