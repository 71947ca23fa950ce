"""Chapter 6 — `LearnerWorker`: a policy rank that trains but does not generate.

With a rollout pool of its own, the policy's ranks keep chapter 5's actor and reference —
log-probs, updates, checkpoints, all inherited from `PolicyWorker` unchanged — and drop the
rollout engine: its memory (a whole model, and on GPU the KV cache) goes back to training,
and its weight sync is replaced by a push to the rollout pool (`transfer.py`):

    weight_shapes     the actor's whole-tensor shapes, from which the driver plans the push
    transfer_address  rank 0 only: its node's IP and a free port (the push group's TCP store)
    join_transfer     every rank at once: rank 0 joins the push group (trainer rank 0 + the
                      rollout ranks, `PushGroup`), the others only keep the plan
    push_weights      every rank gathers each whole tensor, bucket by bucket, over its FSDP
                      group, and rank 0 posts one broadcast per bucket, at most
                      `transfer.POSTED_BUCKETS` of them unfinished (it waits for the oldest
                      before packing another: a whole model of buckets would not fit beside
                      training at 7B); each rank returns its own shards' partial
                      fingerprints for the driver's check, without waiting for the last
                      broadcasts: they finish while the trainer trains, and rank 0 checks
                      that they did at the next push (or at close), against the push
                      timeout; with LoRA served as adapters (`lora.sync=adapter`, vLLM) the
                      adapters alone, by PEFT key

Not here: when to push (the driver) or how a rollout rank receives (`rollout.py`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from avrid.pipeline.push_group import PushGroup
from avrid.pipeline.transfer import PushBucket, Shapes, post_buckets, push_buckets
from avrid.ppo.roles import lora
from avrid.ppo.roles.adapter_sync import AdapterSync, serves_adapters
from avrid.ppo.roles.policy import PolicyWorker
from avrid.reshard import TransferPlan, layout_checksums
from avrid.workers.outcome import free_port


class LearnerWorker(PolicyWorker):
    """One data-parallel rank of the actor (+ reference), with no engine of its own."""

    _transfer: PushGroup | None = None  # rank 0 only: its member of the push group
    _plan: TransferPlan | None = None
    _buckets: tuple[PushBucket, ...] = ()
    # Rank 0: the last push's broadcasts, posted and not yet known to have finished, with
    # their buffers (kept alive until then), and when they were posted.
    _posted: tuple[tuple[dist.Work, torch.Tensor], ...] = ()
    _deadline = 0.0  # when the last push must have finished (`time.monotonic()`)
    _timeout_s = 0.0  # the push timeout (`join_transfer`)
    _push_failed: Exception | None = None  # rank 0: the last push's error, raised later

    def _make_engine(self, model: torch.nn.Module) -> None:
        """No engine: the rollout pool generates (see the module docstring)."""
        return None

    def weight_shapes(self) -> Shapes:
        """name -> (whole shape, dtype name) of every tensor a push sends, in order: the
        actor's parameters; with LoRA the base model's names (merged weights), or where the
        pool serves adapters (`serves_adapters`), the adapters' PEFT keys alone."""
        if self._adapters() is not None:
            return self._adapters().shapes(self.model)
        return self.served_shapes()

    def _adapters(self) -> AdapterSync | None:
        """What the push needs to send adapters (`lora.sync=adapter` with vLLM), made on
        first use; None when weights are pushed."""
        if self.adapter_sync is None and serves_adapters(self.config):
            self.adapter_sync = AdapterSync(self.model, rank=self.identity.rank,
                                            engine_dtype=self.dtype)
        return self.adapter_sync

    def transfer_address(self) -> tuple[str, int]:
        """Where this rank (rank 0) hosts the push group's TCP store: IP and free port."""
        return self.identity.node or "127.0.0.1", free_port()

    def join_transfer(self, address: str, port: int, plan: TransferPlan,
                      timeout_s: float) -> None:
        """Keep the push plan and its buckets; rank 0 also joins the push group (as its
        rank 0, with the R rollout ranks after it), which every member does at once."""
        self._plan, self._timeout_s = plan, timeout_s
        self._buckets = push_buckets(plan.target, plan.bucket_bytes)
        if self.identity.rank == 0:
            self._transfer = PushGroup(address, port, rank=0, world_size=1 + plan.target_world,
                                       device=self.device, timeout_s=timeout_s)

    def push_weights(self) -> tuple[dict[str, int], float, float]:
        """Gather the actor's weights bucket by bucket and (rank 0) post one broadcast per
        bucket to the rollout ranks, a few at a time (`transfer.post_buckets`), then return
        with the last ones in flight; every trainer and rollout rank at once.
        Returns (this rank's partial fingerprints, start, end): the times for the timeline."""
        start = time.time()
        # The previous push's broadcasts: long delivered by now (or its error, raised first).
        self.finish_push()
        if self._plan is None or (self.identity.rank == 0 and self._transfer is None):
            raise RuntimeError(f"{self.identity.name}: join_transfer() must run before "
                               f"push_weights()")
        # From the start of this push, before any bucket is gathered or posted: no broadcast
        # is older than its deadline's start, so the backend's timeout (later by a margin,
        # `push_group.backend_timeout_s`) never passes first.
        self._deadline = time.monotonic() + self._timeout_s
        # The fingerprints of this rank's own shards, cast as the engine holds them: added
        # up over the ranks (on the driver) they are the whole tensors' — whatever the
        # gather, the buckets and the broadcast did, the engine must end up with those.
        adapters = self._adapters()
        if adapters is not None:  # as the LoRA kernels hold them: B scaled by alpha / r
            shards = adapters.held_local(self.model)
        else:
            shards = {n: t.to(self.dtype) for n, t in self.served_shards().items()}
        sums = layout_checksums(self._plan.source, self.identity.rank, shards)
        del shards
        params = dict(self.model.named_parameters())  # resharded by local_shards above
        adapted = self.config.lora.enabled

        def whole(name: str) -> torch.Tensor:
            """Tensor `name` whole, in the engine's dtype: FSDP2's all-gather of the cast
            shards (every trainer rank calls it, in the buckets' order); with LoRA the
            adapter itself, or the merged weight, merged in fp32 and then cast, as
            `served_shards` does."""
            if adapters is not None:
                return adapters.whole(self.model, name)
            if adapted:
                return lora.merged_whole(self.model, name, params).to(self.dtype)
            cast = params[name].detach().to(self.dtype)
            return cast.full_tensor() if isinstance(cast, DTensor) else cast

        posted, failed = post_buckets(self._buckets, whole, self._transfer, self.device,
                                      deadline=self._deadline,
                                      who=self.identity.name)
        self._posted = tuple(posted)
        if failed is not None and self._transfer is not None:
            # A receiver died or stopped: its own error is the one the driver reports; this
            # one is raised at the next push (or close), if the run gets that far.
            self._transfer.leave()  # no rollout rank waits on a group that failed
            self._transfer, self._push_failed = None, failed
        return sums, start, time.time()

    def finish_push(self) -> None:
        """Rank 0: wait until the last push's broadcasts have really finished — polled
        against the push timeout from the start of that push (`PushGroup.wait`), so a rollout
        rank that died raises `PushTimeout` here instead of hanging or passing as "done" —
        then free their buffers. Other ranks posted nothing. A push that failed while it was
        posted (`post_buckets`) raises its error here."""
        failed, self._push_failed = self._push_failed, None
        if failed is not None:
            raise failed
        posted, self._posted = self._posted, ()
        if not posted or self._transfer is None:
            return
        try:
            self._transfer.wait([work for work, _ in posted],
                                deadline=self._deadline,
                                what=f"{self.identity.name}: the last weight push's "
                                     f"{len(posted)} bucket broadcasts")
        except BaseException:
            self._transfer.leave()  # no rollout rank waits on a group that failed
            self._transfer = None
            raise

    def close(self) -> None:
        """Let the last push's broadcasts finish (the driver has checked that they arrived),
        then chapter 5's close."""
        try:
            self.finish_push()
        finally:
            super().close()
