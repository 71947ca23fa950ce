"""Chapter 5 — a whole training run: resume, loop, validate, log, checkpoint, plot.

`train(config)` is what ``avrid ppo`` calls. Per step it calls `Trainer.train_step`, then
writes one JSON line of metrics (``metrics.jsonl``), a few rollout samples
(``samples.jsonl``) and, on schedule, a validation and an atomic checkpoint. At the end it
draws the reward curve, the per-phase times and the chapter 3 timeline of the last step, and
exports the final policy in Hugging Face format (`export.py`).

Output directory (``train.out_dir``)::

    metrics.jsonl        one line per step; step 0 is the untrained validation
    samples.jsonl        prompt, response, reward of a few rollouts per step, spread over
                         the step's prompts (`spread_rows`)
    checkpoints/         step_000050/ {actor,critic}/{model,optim}/ (each rank's shards),
                         state.json, extra.pt, manifest.json (see saving.py, checkpoint.py)
    reward.png phases.png timeline.png timeline.json
    export/              the final policy: config.json, model.safetensors, generation_config.json
                         and the tokenizer (see export.py); loads with from_pretrained, serves
                         with vLLM
    tensorboard/         with train.tensorboard=true
    wandb/ wandb_id.txt  with train.wandb_project: W&B's local files, and the id of the W&B run
                         that a resumed run continues

On screen: one line while Ray and the workers start, the untrained validation, then a progress
bar whose clock starts with the first step (`avrid.ppo.outputs.progress`).

Nothing a run wrote is lost by starting another one:

- the run holds an exclusive lock on ``out_dir`` (``.avrid.lock``, see `outdir.py`) from
  start to end, so a second run on the same directory is refused, naming the holder's pid;
- before anything is written or any worker starts, ``out_dir`` and ``checkpoints/`` are
  checked to be writable, and leftovers of a save that was killed midway are removed;
- a fresh run (no resume) refuses a directory that already holds an earlier run's metrics or
  checkpoints: continue it with ``--resume``, or write to another (or empty) ``--out``;
- a checkpoint is written every ``train.checkpoint_every`` steps (default 50) and at the
  end, the newest ``train.keep_checkpoints`` kept.

Resume (``train.resume=true``; ``avrid ppo --resume --out DIR`` starts from the config the
run recorded, `saving.saved_config`) loads the latest checkpoint, refuses a config that changes
anything but the schedule, drops metric lines after the checkpoint and continues; since every
random draw of the loop derives from (seed, step), the resumed run matches an uninterrupted
one, and the driver's global RNGs (torch, Python's `random`, numpy) are restored too, for a
plug-in task that draws from them. A pipelined run's checkpoint (chapter 6) also holds what
its pipeline held between the two steps (`Trainer.pipeline_state`: batches generated ahead,
weight versions), so it resumes exactly too. With no checkpoint to resume from it refuses,
truncating nothing; a run whose checkpoint has reached ``train.steps`` is complete: it says
so in one line and starts nothing (it writes ``export/`` only if that is missing). A damaged
latest checkpoint is refused naming the newest intact one; ``train.resume_from=<step
directory>`` resumes from that one (or any other) instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from avrid.ppo.driver.saving import restore_rng_states, resume_weights, save
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.outputs.checkpoint import (
    Checkpoint,
    CorruptCheckpointError,
    latest_checkpoint,
    load_checkpoint,
)
from avrid.ppo.outputs.export import export_checkpoint
from avrid.ppo.outputs.metrics import (
    MetricsLogger,
    SampleDump,
    format_step,
    read_metrics,
    require_backends,
)
from avrid.ppo.outputs.outdir import OutDirError, OutDirLock, preflight, remove_stale_temp_dirs
from avrid.ppo.outputs.plots import write_plots
from avrid.ppo.outputs.progress import Progress
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.config_file import config_to_dict
from avrid.ppo.setup.tokenizer import response_text

SCHEDULE_FIELDS = ("steps", "resume", "resume_from", "progress", "val_every",
                   "checkpoint_every", "keep_checkpoints", "out_dir", "samples_per_step",
                   "tensorboard", "wandb_project", "wandb_name", "wandb_mode", "call_timeout_s",
                   "setup_timeout_s", "collective_timeout_s", "gradient_checkpointing")
"""`train` fields a resumed run may change; any other difference is refused."""
WHERE_FIELDS = ("ray_address", "strategy")
"""`placement` fields a resumed run may change too: where it runs, not what it computes."""
MEMORY_FIELDS = ("gpu_memory_utilization",)
"""`rollout` fields a resumed run may change too: how much GPU memory the engine takes."""


FINAL_METRICS = {"actor/pg_loss": "policy loss", "reward/overlong_penalty": "overlong penalty"}
"""Metric -> its name in `RunSummary.finished_line`, each the value of the last step logging
it (a critic warm-up step has no policy loss; the penalty is logged only when it is on)."""


class NoCheckpointError(OutDirError):
    """A resume was asked for, but the output directory holds no checkpoint."""


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
    already_complete: bool = False
    """True: a resume found the run at train.steps already, so nothing was started."""

    def finished_line(self, algo: str, *, lora: bool = False) -> str:
        """The line `avrid ppo` ends a run with: its time, the validation reward before and
        after, the last step's policy loss (`actor/pg_loss`) and overlong penalty (when
        `algo.overlong_buffer` is on), and where the outputs are (a `lora` run's policy is
        in `export/merged/`, beside its adapter)."""
        last = {k: v for row in self.rows for k, v in row.items() if v is not None}
        shown = [f"{name} {last[key]:.4g}" for key, name in FINAL_METRICS.items() if key in last]
        return (f"{algo} finished in {self.seconds:.0f} s; validation reward "
                f"{self.initial_val_reward:.3f} -> {self.final_val_reward:.3f}; "
                + (f"last step: {', '.join(shown)}; " if shown else "")
                + f"outputs in {self.out_dir}/ (the policy in Hugging Face format: "
                f"{self.out_dir}/export/{'merged/' if lora else ''})")


def train(config: PPOConfig, *, log: Callable[[str], None] | None = None,
          make_trainer: Callable[[PPOConfig], Trainer] = Trainer) -> RunSummary:
    """Run (or resume) training as configured; see the module docstring. `make_trainer`
    builds the trainer (chapter 6's `avrid.pipeline.make_trainer` picks one per
    `pipeline.mode`; this default runs the synchronous loop only).

    Raises:
        OutDirError: (a ValueError) the output directory is busy, holds an earlier run that
            this one would overwrite, or has no checkpoint to resume from.
        avrid.ppo.outputs.outdir.WriteError: (an OSError) an output path cannot be written.
    """
    started = time.time()
    t = config.train
    out = Path(t.out_dir)
    ckpt_root = out / "checkpoints"
    # A logger asked for but not installed fails here, before anything is created.
    require_backends(tensorboard="train.tensorboard=true" if t.tensorboard else None,
                     wandb=f"train.wandb_project={t.wandb_project}" if t.wandb_project else None)
    if (t.resume or t.resume_from) and not out.is_dir():  # a typo must not make a directory
        raise NoCheckpointError(f"cannot resume: there is no directory {out} (nothing was "
                                f"created); point --out at the directory of the run to "
                                f"continue, or drop --resume to start a new run")
    # Held until the export is written: nothing below may interleave with another run.
    with OutDirLock(out):
        preflight(out, ckpt_root)
        ck = _resume_point(config, out, ckpt_root)
        for directory in (ckpt_root, out):  # any temporary dir here is a dead save's
            remove_stale_temp_dirs(directory)
        if ck is not None and ck.step >= t.steps:  # nothing to train: start nothing
            return _already_complete(config, ck, started, log)
        return _train(config, out, ckpt_root, ck, started, log, make_trainer)


def _already_complete(config: PPOConfig, ck: Checkpoint, started: float,
                      log: Callable[[str], None] | None) -> RunSummary:
    """A resume of a run whose checkpoint has reached train.steps: say so in one line, and
    write its export only if it is missing (a run stopped after its last checkpoint)."""
    out = Path(config.train.out_dir)
    if not (out / "export").is_dir():
        export_checkpoint(ck.path, out / "export", overwrite=True)
    if log:
        log(f"{out} is already complete: its checkpoint {ck.path.name} has reached "
            f"train.steps={config.train.steps}, so there is nothing to train (outputs in "
            f"{out}/; raise --steps to train further)")
    rows = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
    return _summary(out, rows, started, already_complete=True)


def _train(config: PPOConfig, out: Path, ckpt_root: Path, ck: Checkpoint | None,
           started: float, log: Callable[[str], None] | None,
           make_trainer: Callable[[PPOConfig], Trainer]) -> RunSummary:
    """The run proper, once the output directory is locked and checked."""
    t = config.train
    first, weights, optimizers, held = 0, None, None, None
    if ck is not None:
        first, (weights, optimizers) = ck.step, resume_weights(ck)
        held = ck.extra.get("pipeline")  # a pipelined run's queue and versions (chapter 6)
        if log:
            log(f"resuming from {ck.path} (step {first}){_pipeline_note(config, ck)}")
    resume_step = first if ck is not None else None
    with (make_trainer(config) as trainer,
          metrics_logger(config, resume_step) as mlog,
          SampleDump(out / "samples.jsonl", resume_step=resume_step) as samples,
          Progress(t.steps, initial=first, enabled=t.progress) as bar):
        if log:  # starting Ray and the workers takes a while: say so, in a plain line
            where = "on Ray" if config.placement.backend == "ray" else "in this process"
            log(f"starting {len(trainer.placement().slots)} workers {where} ...")
        trainer.start(weights, optimizers, step=first, pipeline_state=held)
        if ck is not None:  # after start: in-process workers share (and seed) these RNGs
            restore_rng_states(ck.extra)
        if first == 0:
            val = trainer.validate()
            mlog.log(0, val)
            if log:
                log(format_step(0, val, ["val/reward"]))
        bar.start()  # its clock starts with the first step: the start-up above is not one
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
        bar.close()  # the steps are done: the bar's last rate is theirs, not the plots'
        rows = read_metrics(out / "metrics.jsonl")
        write_plots(rows, out, timeline=trainer.timeline)
    # After the workers are gone: reads the last checkpoint's actor weights back (page cache)
    # and writes one safetensors file; replaces the export of an earlier, resumed run.
    export_checkpoint(ckpt_root, out / "export", overwrite=True)
    return _summary(out, rows, started)


def _summary(out: Path, rows: list[dict[str, Any]], started: float, *,
             already_complete: bool = False) -> RunSummary:
    """The `RunSummary` of a run whose metrics are `rows`, begun at time `started`."""
    vals = [r["val/reward"] for r in rows if r.get("val/reward") is not None]
    return RunSummary(out_dir=out, rows=rows, initial_val_reward=vals[0] if vals else float("nan"),
                      final_val_reward=vals[-1] if vals else float("nan"),
                      seconds=time.time() - started, already_complete=already_complete)


def metrics_logger(config: PPOConfig, resume_step: int | None) -> MetricsLogger:
    """The run's `MetricsLogger`: ``metrics.jsonl`` in ``train.out_dir``, plus TensorBoard
    (``tensorboard/`` there) and W&B as configured: named `train.wandb_name` or after the
    output directory, in `train.wandb_mode` (else WANDB_MODE); a resumed run continues it."""
    t = config.train
    out = Path(t.out_dir)
    return MetricsLogger(out / "metrics.jsonl", resume_step=resume_step,
                         tensorboard_dir=out / "tensorboard" if t.tensorboard else None,
                         wandb_project=t.wandb_project,
                         wandb_name=t.wandb_name or out.resolve().name,
                         wandb_mode=t.wandb_mode or os.environ.get("WANDB_MODE") or None,
                         run_config=config_to_dict(config))


def _pipeline_note(config: PPOConfig, ck: Checkpoint) -> str:
    """What the resume line adds for a pipelined run: whether it goes on exactly."""
    if not config.pipeline.disaggregated:
        return ""  # the synchronous loop: the models and (seed, step) are all it needs
    held = ck.extra.get("pipeline")
    if held is None:
        return ("; the checkpoint holds no pipeline state (an older avrid wrote it): the "
                "queue starts empty, so the steps after it differ from an uninterrupted run's")
    ran = ck.state.get("config", {}).get("train", {}).get("steps", config.train.steps)
    if config.train.steps > ran and held["next_gen"] >= ran:
        return (f"; its pipeline state is restored, but its run was set for {ran} steps and "
                f"generated no batch past them: batches it would otherwise have generated "
                f"by now come from newer weights, so from step {ran} on this run may differ "
                f"from one set for {config.train.steps} steps from the start")
    return "; its pipeline state (queued batches, weight versions) is restored"


def _resume_point(config: PPOConfig, out: Path, ckpt_root: Path) -> Checkpoint | None:
    """The checkpoint to resume from (None: a fresh run), after refusing what would lose
    data: a resume with nothing to resume, a fresh run over an earlier run's outputs."""
    t = config.train
    if t.resume_from:
        given = Path(t.resume_from)
        step_dir = given if given.is_dir() else ckpt_root / given
        if not (step_dir / "manifest.json").is_file():
            raise NoCheckpointError(f"train.resume_from={t.resume_from!r}: {step_dir} is not "
                                    f"a checkpoint step directory (one with manifest.json); "
                                    f"give a path like {ckpt_root / 'step_000050'}")
        ck = load_checkpoint(step_dir)
    elif t.resume:
        try:
            if latest_checkpoint(ckpt_root) is None:
                raise NoCheckpointError(
                    f"cannot resume: {ckpt_root} holds no checkpoint, so there is nothing "
                    f"to continue (nothing was changed). Run without --resume to start a new "
                    f"run (in another or empty --out if {out} holds outputs you want to "
                    f"keep), or point --out at the directory of the run you meant")
            ck = load_checkpoint(ckpt_root)
        except CorruptCheckpointError as e:
            if e.intact is None:
                raise
            raise CorruptCheckpointError(
                f"{e}; to resume from it: avrid ppo --resume --set "
                f"train.resume_from={e.intact}", path=e.path, intact=e.intact) from e
    else:
        if earlier := _earlier_outputs(out, ckpt_root):
            raise OutDirError(
                f"{out} already holds an earlier run ({', '.join(earlier)}); a new run "
                f"would overwrite it. Continue that run with --resume (train.resume=true), "
                f"or start a new one in another or empty directory with --out "
                f"(train.out_dir); delete {out} first if you no longer need it")
        return None
    _check_resumable(ck.state["config"], config_to_dict(config))
    return ck


def _earlier_outputs(out: Path, ckpt_root: Path) -> list[str]:
    """What in `out` a fresh run would destroy: non-empty logs, any checkpoint."""
    found = [name for name in ("metrics.jsonl", "samples.jsonl")
             if (out / name).is_file() and (out / name).stat().st_size > 0]
    # Any step directory counts, complete or not: a damaged checkpoint is still the user's.
    steps = sorted(ckpt_root.glob("step_*")) if ckpt_root.is_dir() else []
    if steps:
        found.append(f"{len(steps)} checkpoint(s) in {ckpt_root.name}/, the last "
                     f"{steps[-1].name}")
    return found


def _check_resumable(saved: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]) -> None:
    # A field the checkpoint's config lacks is newer than it: the checkpoint's run had that
    # field's default behaviour, so compare with the default.
    default = config_to_dict(PPOConfig())
    was = {sec: {**default.get(sec, {}), **saved.get(sec, {})} for sec in now}
    diffs = [f"{sec}.{k}: {was[sec].get(k)!r} -> {v!r}"
             for sec, values in now.items() for k, v in values.items()
             if not (sec == "train" and k in SCHEDULE_FIELDS)
             and not (sec == "placement" and k in WHERE_FIELDS)
             and not (sec == "rollout" and k in MEMORY_FIELDS) and sec not in ("memory", "tools")
             and was[sec].get(k) != v]
    if diffs:
        raise ValueError("cannot resume: the config differs from the checkpoint's in "
                         + "; ".join(diffs) + f" (only train.{{{', '.join(SCHEDULE_FIELDS)}}} "
                         f"placement.{{{', '.join(WHERE_FIELDS)}}} and "
                         f"rollout.{{{', '.join(MEMORY_FIELDS)}}} and the memory and tools "
                         f"sections may change; `avrid ppo --resume --out DIR` without "
                         f"--preset or --config resumes with the run's own config)")


def _samples(trainer: Trainer, batch, count: int) -> list[dict[str, Any]]:  # noqa: ANN001
    """`count` rows of the step's batch to dump, spread over its prompts."""
    rows = []
    for i in spread_rows(batch.scalars["group"].tolist(), count):
        tokens = batch.packed["tokens"].row(i).tolist()
        p = int(batch.prompt_lens[i])
        prompt = trainer.train_set.prompts[int(batch.scalars["prompt_index"][i])]
        rows.append({"prompt": prompt.text, "answer": prompt.answer,
                     "response": response_text(tokens[p:], trainer.tokenizer),
                     "reward": float(batch.scalars["score"][i])})
    return rows


def spread_rows(groups: list[int], count: int) -> list[int]:
    """Up to `count` row positions, as many prompts as possible: the first response of every
    group (prompt) in batch order, then the second of every group, and so on. The responses
    of a prompt sit next to each other, so the first `count` rows would show one prompt.

    Example:
        >>> spread_rows([0, 0, 0, 1, 1, 1, 2, 2, 2], 4)
        [0, 3, 6, 1]
    """
    seen: dict[int, int] = {}
    order = []
    for pos, group in enumerate(groups):
        order.append((seen.get(group, 0), pos))  # (its rank within its group, its position)
        seen[group] = seen.get(group, 0) + 1
    return [pos for _, pos in sorted(order)[:count]]
