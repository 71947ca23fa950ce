"""Chapter 6 — what a pipelined run holds between two steps, in the form a checkpoint keeps.

Between two steps the synchronous loop holds nothing but its models: a checkpoint of them
and of (seed, step) resumes it exactly. A pipelined run holds more, and the steps after a
resume depend on all of it:

    queue            the batches generated ahead, each with the weight version that made it
                     and its generate call's metrics (the step that trains it reports them)
    next_gen         the next step whose batch is to be generated
    trainer_version  the actor updates so far
    rollout_version  the version the engines hold; the next push happens where it is older
                     than the trainer's, exactly where the uninterrupted run makes it
    pushes           the pushes checked since the last step, which the next step reports
                     (the seconds each cost the trainer ranks)

`PipelineState.to_extra` turns it into plain ints, floats, strings, lists, dicts and tensors,
which `save_checkpoint` writes into the checkpoint's ``extra.pt`` with `torch.save` (tensors
bit for bit, no class of avrid pickled, so a renamed class cannot break a checkpoint), and
`PipelineState.from_extra` reads that back and checks it.

Not here: collecting the generation still in flight before a save, and what a resumed
driver does with the state (`PipelinedTrainer.pipeline_state` and `start`, in driver.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from avrid.dispatch import Batch, Packed
from avrid.pipeline.staleness import Rollout
from avrid.results import Merged, Metric

FORMAT = 1
"""The layout of the saved dict; `from_extra` refuses any other."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineState:
    """Everything a pipelined run holds between two steps (see the module docstring)."""

    trainer_version: int
    rollout_version: int
    next_gen: int
    queue: tuple[Rollout, ...]
    """In step order; each `Rollout.generation` is needed for its metrics only."""
    pushes: tuple[float, ...]
    """One entry per push checked since the last step: the seconds it cost the trainer."""

    def to_extra(self) -> dict[str, Any]:
        """The state as plain values and tensors, for `torch.save`."""
        return {"format": FORMAT, "trainer_version": self.trainer_version,
                "rollout_version": self.rollout_version, "next_gen": self.next_gen,
                "pushes": list(self.pushes),
                "queue": [{"step": r.step, "version": r.version, "batch": batch_dict(r.batch),
                           "metrics": [_metric_dict(m) for m in r.generation.metrics.values()]}
                          for r in self.queue]}

    @classmethod
    def from_extra(cls, saved: Mapping[str, Any]) -> PipelineState:
        """Read back what `to_extra` returned (after a `torch.save` and `torch.load`)."""
        if saved.get("format") != FORMAT:
            raise ValueError(f"the checkpoint's pipeline state has format "
                             f"{saved.get('format')!r}; this avrid reads format {FORMAT}")
        queue = []
        for item in saved["queue"]:
            batch = batch_from_dict(item["batch"])
            metrics = {m["name"]: Metric(**m) for m in item["metrics"]}
            # Only its metrics are read again; its workers' spans belong to the saved run.
            generation = Merged(batch=batch, metrics=metrics, results=())
            queue.append(Rollout(step=int(item["step"]), version=int(item["version"]),
                                 batch=batch, generation=generation))
        return cls(trainer_version=int(saved["trainer_version"]),
                   rollout_version=int(saved["rollout_version"]),
                   next_gen=int(saved["next_gen"]), queue=tuple(queue),
                   pushes=tuple(float(s) for s in saved["pushes"]))


def batch_dict(batch: Batch) -> dict[str, Any]:
    """A batch as nested dicts of tensors (each cloned: its own storage, no bigger buffer
    it may be a view of goes into the file).

    Example:
        >>> import torch
        >>> b = Batch.from_rows(sample_ids=[7], prompt_lens=[2], response_lens=[1],
        ...                     packed={"tokens": [torch.tensor([5, 6, 9])]},
        ...                     scalars={"version": torch.tensor([3])})
        >>> back = batch_from_dict(batch_dict(b))
        >>> back.packed["tokens"].row(0).tolist(), back.scalars["version"].tolist()
        ([5, 6, 9], [3])
    """
    return {"sample_ids": batch.sample_ids.clone(), "prompt_lens": batch.prompt_lens.clone(),
            "response_lens": batch.response_lens.clone(),
            "packed": {name: {"values": col.values.clone(), "offsets": col.offsets.clone()}
                       for name, col in batch.packed.items()},
            "scalars": {name: col.clone() for name, col in batch.scalars.items()}}


def batch_from_dict(saved: Mapping[str, Any]) -> Batch:
    """The batch `batch_dict` described, checked again as any new `Batch` is."""
    return Batch(sample_ids=saved["sample_ids"], prompt_lens=saved["prompt_lens"],
                 response_lens=saved["response_lens"],
                 packed={name: Packed(values=col["values"], offsets=col["offsets"])
                         for name, col in saved["packed"].items()},
                 scalars=dict(saved["scalars"]))


def _metric_dict(m: Metric) -> dict[str, Any]:
    return {"name": m.name, "reduction": m.reduction, "total": m.total, "weight": m.weight,
            "per_rank": m.per_rank}
