"""Chapter 6 — asynchronous RL: generation overlapped with training, staleness bounded.

A layer above `avrid.ppo`: it reuses chapter 5's step (`Trainer.learn`) and roles, and adds
a rollout pool of its own, the weight push between the two pools, and a driver that keeps
the rollout pool generating ahead of the trainer by at most K weight versions.

Read in this order:

1. staleness.py  the admission rule (trainer version - engine version <= K) and the bounded
                 queue of generated batches
2. overlap.py    how much of a step generation and training ran at the same time
3. transfer.py   the trainer's FSDP2 shards into whole engines in other processes
                 (chapter 4's plan across two pools), over a process group of their own
4. learner.py    `LearnerWorker`: chapter 5's policy rank without an engine, that pushes
5. rollout.py    `RolloutWorker`: an engine in its own bundle that stamps each sample
                 with the weight version that made it
6. placement.py  chapter 5's placement plus the rollout pool
7. report.py     what a pipelined step reports: staleness, importance weights, pushes,
                 overlap, its timeline
8. resume.py     what the pipeline holds between two steps, as a checkpoint keeps it
9. driver.py     `PipelinedTrainer`: the one_step_off and async modes, and their exact
                 resume

`make_trainer(config)` gives the trainer of `config.pipeline.mode` (chapter 5's `Trainer`
for sync); `train(config)` runs a whole run with it, as ``avrid ppo`` does.
"""

from __future__ import annotations

from collections.abc import Callable

from avrid.pipeline.driver import PipelinedTrainer
from avrid.pipeline.staleness import Rollout, RolloutQueue, StalenessError, StalenessGate
from avrid.ppo.driver.run import RunSummary
from avrid.ppo.driver.run import train as _train
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.config import PPOConfig


def make_trainer(config: PPOConfig) -> Trainer:
    """The trainer that runs `config.pipeline.mode`: `Trainer` (sync) or `PipelinedTrainer`."""
    return PipelinedTrainer(config) if config.pipeline.disaggregated else Trainer(config)


def train(config: PPOConfig, *, log: Callable[[str], None] | None = None) -> RunSummary:
    """`avrid.ppo.driver.run.train` in any pipeline mode (what ``avrid ppo`` calls)."""
    return _train(config, log=log, make_trainer=make_trainer)


__all__ = ["PipelinedTrainer", "Rollout", "RolloutQueue", "StalenessError", "StalenessGate",
           "make_trainer", "train"]
