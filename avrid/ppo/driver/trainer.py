"""Chapter 5 — the single-controller PPO/GRPO loop.

One driver process owns the loop; the workers own the models. A step is this explicit
sequence of named, timed phases, each one dispatch (chapter 2) and one canonical result
(chapter 3) — read `train_step` top to bottom and you have read the algorithm:

    generate       policy ranks sample `responses_per_prompt` responses per prompt
    reward         the reward worker scores every response (task.reward)
    (reward_model) with reward_model.path: its ranks score them too (`scoring.py`)
    (resample)     with algo.dynamic_sampling only: all-alike groups dropped, more generated
    old_logp       policy ranks recompute log-probs with the trainer's forward pass
    ref_logp       ... and under the frozen reference (only with a KL term; its ranks:
                   the policy's, or a pool of its own, `reference.py`)
    values         critic ranks: V(s_t) per response token (PPO only)
    advantages     on the driver: GAE (PPO) or group-normalised scores (GRPO)
    critic_update  mini-batches of the clipped value loss (PPO only)
    actor_update   mini-batches of the clipped policy loss
    weight_sync    actor shards -> each rank's rollout engine (chapter 4), checked

`train_step` is generate, then `learn` (reward to actor_update), then weight_sync: chapter
6's `PipelinedTrainer` reuses `learn` unchanged and replaces the two ends (generation by a
rollout pool running ahead, the sync by a push across pools).

Around it: validation on held-out prompts, metrics as JSON lines, rollout samples, atomic
checkpoints with exact resume, plots at the end (`run.py` wires those to the command line).
Everything random derives from (seed, step), so the same seed gives the same metrics and a
resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from avrid.dispatch import Batch, DispatchConfig
from avrid.ppo.algo.losses import kl_estimate
from avrid.ppo.algo.registry import resolve_estimator, resolve_policy_loss
from avrid.ppo.data.columns import Totals, action_mask, add_columns, padded, reads, with_responses
from avrid.ppo.data.credit import compute_advantages, shaped_scores, shaping_metrics
from avrid.ppo.data.dynamic_sampling import FillStats, fill_groups, round_prompts, round_seed
from avrid.ppo.data.prompts import (
    TRAIN,
    VAL,
    PromptSet,
    mini_batches,
    prompt_batch,
    step_indices,
    step_seed,
)
from avrid.ppo.driver import reward_stream
from avrid.ppo.driver.concurrent import learn_concurrently
from avrid.ppo.driver.placement import build_placement, critic_after_engine
from avrid.ppo.driver.reference import reference_logprobs
from avrid.ppo.driver.scoring import Phase, score_batch
from avrid.ppo.driver.stopping import keep_own_sigterm
from avrid.ppo.roles.critic import CRITIC_UPDATE_READS, VALUES_READS, CriticWorker
from avrid.ppo.roles.policy import LOGPROBS_READS, PolicyWorker, actor_update_reads
from avrid.ppo.roles.reward import RewardWorker
from avrid.ppo.roles.reward_model import RewardModelWorker
from avrid.ppo.roles.trained import TrainedWorker, TrainerState
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.reward_model import check_checkpoint
from avrid.ppo.setup.task import Task
from avrid.ppo.setup.tokenizer import make_tokenizer
from avrid.ppo.setup.validate import check_paths, validate
from avrid.results import Merged, Phases, Timeline, WorkerResult, merge_metrics, run_shards
from avrid.workers import Cluster, InProcessBackend, PlacementPlan, WorkerGroup


class Trainer:
    """Builds the cluster for `config` and runs steps; use as a context manager."""

    policy_worker: type[PolicyWorker] = PolicyWorker
    """The "policy" role's worker class (chapter 6's has no engine; `streaming_worker`)."""

    def __init__(self, config: PPOConfig) -> None:
        if config.pipeline.disaggregated and type(self) is Trainer:
            # Never run another mode than the one asked for (verl #4449: a "sync" mode that
            # silently ran one step off).
            raise ValueError(f"pipeline.mode={config.pipeline.mode!r} is run by "
                             f"avrid.pipeline.PipelinedTrainer (chapter 6); this Trainer runs "
                             f"the synchronous loop (pipeline.mode='sync') only")
        self.config = config
        self.policy_worker = reward_stream.streaming_worker(config, self.policy_worker)
        check_paths(config)
        if config.reward_model.enabled:  # a wrong checkpoint fails now, not in a worker
            check_checkpoint(config.reward_model.path)
        t = config.task
        self.task: Task = load_task(t.name, **t.kwargs)
        validate(config, self.task)  # the rules that need the task: response budget, alphabet
        # A user's estimator or loss ("module:function") is imported and checked now, so a
        # typo fails in one line before any worker starts.
        resolve_estimator(config.algo.name)
        resolve_policy_loss(config.algo.policy_loss)
        self.tokenizer = make_tokenizer(config, self.task)
        r = config.rollout
        self.max_response = r.max_response_tokens or self.task.max_response_tokens
        # Prompts are tokenized when a step first reads them (a split may hold 10**8); the
        # validation split is read whole at every validation, so check it now.
        self.train_set = PromptSet(self.task.train_prompts(), self.tokenizer,
                                   max_tokens=r.max_prompt_tokens, split="train")
        val = list(self.task.val_prompts())[:config.train.val_prompts]
        self.val_set = PromptSet(val, self.tokenizer, max_tokens=r.max_prompt_tokens,
                                 split="val")
        for i in range(len(self.val_set)):
            self.val_set.token_ids(i)
        # FSDP ranks must run the same number of forward passes: same_micro_count.
        self.dispatch = DispatchConfig(micro_batch_tokens=config.train.micro_batch_tokens,
                                       same_micro_count=True)
        self.cluster: Cluster | None = None
        self.timeline: Timeline | None = None
        self._driver_threads: int | None = None  # torch threads before start() (Ray only)
        self.fill_stats: FillStats | None = None  # the last step's dynamic sampling

    # ---- lifecycle -------------------------------------------------------------------------

    def placement(self) -> PlacementPlan:
        """Where each role runs (`placement.build_placement` with this run's response budget)."""
        plan = build_placement(self.config, self.tokenizer, max_response_tokens=self.max_response)
        return reward_stream.with_policy_worker(plan, self.policy_worker)

    def start(self, weights: dict | None = None, optimizers: dict | None = None, *,
              step: int = 0, pipeline_state: dict | None = None) -> None:
        """Start the workers and build (or restore: `saving.resume_weights`) the models;
        `step`: the step the run (re)starts at (what the weights have been trained for).
        `pipeline_state` is chapter 6's (`pipeline_state()`); this loop has none."""
        if pipeline_state is not None:
            raise ValueError("the checkpoint holds a pipelined run's queue; resume it with "
                             "its own pipeline.mode (this Trainer runs the synchronous loop)")
        plan = self.placement()
        t = self.config.train
        # Every call the driver makes waits at most `call_timeout_s`: a stuck reward function
        # or worker ends the run with an error naming role, rank and method, never a hang.
        if self.config.placement.backend == "ray":
            from avrid.workers import RayBackend, start_ray

            # The driver's tensors are bookkeeping (ids, offsets, advantages), too small to
            # gain from threads, and idle OpenMP threads spin after each parallel region:
            # on one thread the driver leaves the cores to the workers (measured on
            # pipeline-cpu: 0.30 -> 0.12 cores of driver CPU). Restored by close().
            self._driver_threads = torch.get_num_threads()
            torch.set_num_threads(1)
            with keep_own_sigterm():  # Ray's start replaces a SIGTERM handler (stopping.py)
                start_ray(self.config.placement.ray_address)  # None: RAY_ADDRESS or local Ray
            backend = RayBackend(start_timeout_s=t.setup_timeout_s,
                                 call_timeout_s=t.call_timeout_s)
        else:
            backend = InProcessBackend(concurrent=True, call_timeout_s=t.call_timeout_s)
        self.cluster = backend.launch(plan)
        self.policy = self.cluster.group("policy", self.policy_worker)
        self.reward = self.cluster.group("reward", RewardWorker)
        self.reward_stream = reward_stream.for_groups(self.policy, self.reward)  # or None
        self.reward_model = (self.cluster.group("reward_model", RewardModelWorker)
                             if self.config.reward_model.enabled else None)
        self.critic = (self.cluster.group("critic", CriticWorker)
                       if self.config.algo.uses_critic else None)
        weights, optimizers = weights or {}, optimizers or {}
        groups = [("actor", self.policy, PolicyWorker.setup)]
        if self.critic is not None:
            groups.append(("critic", self.critic, CriticWorker.setup))
        pending = []
        for name, group, setup in groups:
            n = group.world_size
            opt = optimizers.get(name) or [None] * n
            if len(opt) != n:
                raise ValueError(f"the checkpoint's {name} optimizer has {len(opt)} ranks, "
                                 f"this run has {n}; resume with the same placement")
            pending.append(group.submit_per_rank(setup, [weights.get(name)] * n, opt))
            if critic_after_engine(self.config):  # the policy's vLLM takes its GPU share first
                pending.pop().result(t.setup_timeout_s)
        for p in pending:  # else both groups initialise at once (their process groups form)
            p.result(t.setup_timeout_s)

    def pipeline_state(self) -> dict | None:
        """What the loop holds between steps beyond its models, for a checkpoint: nothing
        here (a step starts from the models and (seed, step) alone); chapter 6's trainer
        returns the batches it generated ahead and its weight versions."""
        return None

    def state(self) -> TrainerState:
        """Every trained model's full weights and each of its ranks' optimizer states (tests;
        checkpoints are sharded: `saving.write_shards`). A collective over the trained groups."""
        trained = [("actor", self.policy)] + ([] if self.critic is None
                                              else [("critic", self.critic)])
        states = {name: group.call(TrainedWorker.state) for name, group in trained}
        return TrainerState(weights={n: s[0].weights for n, s in states.items()},
                            optimizers={n: [r.optimizer for r in s] for n, s in states.items()})

    def close(self, *, failed: bool = False) -> None:
        """Stop the workers. After a clean run every rank leaves its process group (all ranks
        at once, bounded by `train.call_timeout_s`). After a failure (`failed=True`) the
        workers are stopped without asking: a dead or stuck rank cannot take part in leaving,
        and waiting for it (up to gloo's timeout) would only bury the error that matters."""
        if self.cluster is None:
            return
        cluster, self.cluster = self.cluster, None
        if self._driver_threads is not None:
            torch.set_num_threads(self._driver_threads)
            self._driver_threads = None
        try:
            if not failed:
                leaving = [self.policy.submit(self.policy_worker.close)]
                if self.critic is not None:
                    leaving.append(self.critic.submit(CriticWorker.close))
                for pending in leaving:
                    pending.result(self.config.train.call_timeout_s)
        finally:
            cluster.close()  # Ray: kill the actors and free the placement groups

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc is None:
            self.close()
            return
        # The error that ended the run stays the one raised; a failure while stopping the
        # workers is attached to it as a note, never put in its place.
        try:
            self.close(failed=True)
        except Exception as cleanup:  # noqa: BLE001 - reported on the original error
            exc.add_note(f"(and stopping the workers afterwards failed: "
                         f"{type(cleanup).__name__}: {cleanup})")

    # ---- one step --------------------------------------------------------------------------

    def train_step(self, step: int) -> tuple[dict[str, float], Batch]:
        """Run step `step` (0-based); returns its metrics and the scored batch."""
        phases = Phases()
        prompts = self.step_prompts(step)
        with phases("generate"):
            gen = phases.add(self.generate_round(prompts, self.sampling(step)))
        batch, merged = self.learn(step, with_responses(prompts, gen.batch), phases)
        if self.updates_actor(step):
            with phases("weight_sync"):  # a call with no batch: only spans and the bytes
                sync = phases.record(self.policy.call(PolicyWorker.sync_weights,
                                                      version=step + 1))
        metrics = self._metrics(batch, [gen, *merged], phases)
        if self.updates_actor(step):
            reduced = merge_metrics(m for r in sync for m in r.metrics)
            metrics.update({name: m.value for name, m in reduced.items()})
        self.timeline = phases.timeline()
        return metrics, batch

    def generate_round(self, prompts: Batch, sampling: dict[str, int | bool]) -> Merged:
        """Generate responses to `prompts` now (a step's batch; dynamic sampling's extra
        rounds). Chapter 6's trainer first brings its rollout pool up to the trainer's
        weights; `rollout.stream_rewards` scores each response meanwhile (`reward_stream`)."""
        if self.reward_stream is not None:
            return self.reward_stream.generate(prompts, sampling)
        return run_shards(*self.generator(), prompts, None, **sampling)

    def generator(self) -> tuple[WorkerGroup, Callable[..., WorkerResult]]:
        """The group and method that generate: the policy's hybrid engine here (chapter 6's
        trainer: its rollout pool)."""
        return self.policy, PolicyWorker.generate

    def step_prompts(self, step: int) -> Batch:
        """The prompts of step `step`, each repeated `responses_per_prompt` times; sample ids
        are unique over the run."""
        cfg, n = self.config, self.config.algo.responses_per_prompt
        indices = step_indices(step, cfg.train.prompts_per_step, len(self.train_set),
                               cfg.train.seed)
        return prompt_batch(self.train_set, indices, repeats=n, split=TRAIN,
                            first_id=step * cfg.train.prompts_per_step * n)

    def sampling(self, step: int, round: int = 0) -> dict[str, int | bool]:
        """The keyword arguments of step `step`'s generate call (its seed depends on the
        step, and dynamic sampling's round, alone, wherever and whenever it runs)."""
        return {"max_new_tokens": self.max_response, "greedy": False,
                "seed": round_seed(step_seed(self.config, step), round)}

    def updates_actor(self, step: int) -> bool:
        """Whether step `step` updates the actor (not during the critic's warm-up)."""
        return step >= self.config.train.critic_warmup_steps

    def learn(self, step: int, batch: Batch, phases: Phases) -> tuple[Batch, list[Merged]]:
        """Everything after generation up to the actor's update, phase by phase (each issued
        once it may run with `train.concurrent_phases`). Returns the scored batch and calls."""
        if self.config.train.concurrent_phases:  # the same phases, each issued when ready
            return learn_concurrently(self, step, batch, phases)
        cfg, a = self.config, self.config.algo
        batch, scored = self.score(batch, phases)  # "reward" (and "reward_model") phases
        done: list[Merged] = [phases.add(m) for m in scored]
        if a.dynamic_sampling:
            with phases("resample"):  # DAPO: drop all-alike groups, generate more prompts
                batch, more, fill = self.fill(step, batch)
            done += [phases.add(m) for m in more]
            self.fill_stats = fill
        with phases("old_logp"):
            old = phases.add(run_shards(self.policy, PolicyWorker.compute_logprobs,
                                        reads(batch, LOGPROBS_READS), self.dispatch))
            batch = add_columns(batch, packed={"old_logp": old.batch.packed["old_logp"]})
        if a.kl_coef > 0:
            with phases("ref_logp"):
                ref = phases.add(reference_logprobs(self, reads(batch, LOGPROBS_READS)))
                batch = add_columns(batch, packed={"ref_logp": ref.batch.packed["ref_logp"]})
        if self.critic is not None:
            with phases("values"):
                val = phases.add(run_shards(self.critic, CriticWorker.compute_values,
                                            reads(batch, VALUES_READS), self.dispatch))
                batch = add_columns(batch, packed={"values": val.batch.packed["values"]})
        with phases("advantages"):
            batch = compute_advantages(batch, cfg, max_response=self.max_response)
        updates: list[Merged] = []
        if self.critic is not None:
            with phases("critic_update"):
                updates += self.train_on(self.critic, CriticWorker.update,
                                         reads(batch, CRITIC_UPDATE_READS), step, phases)
        if self.updates_actor(step):
            with phases("actor_update"):
                updates += self.train_on(self.policy, PolicyWorker.update,
                                         reads(batch, actor_update_reads(cfg)), step, phases)
        return batch, [*done, old, *updates]

    def score(self, batch: Batch, phase: Phase | None = None) -> tuple[Batch, list[Merged]]:
        """`batch` scored (its "score" column: the rule reward, combined with the reward
        model's with `reward_model.path`), and the calls made, each timed by `phase`."""
        return score_batch(batch, config=self.config.reward_model, reward=self.reward,
                           model=self.reward_model, phase=phase, stream=self.reward_stream)

    def fill(self, step: int, batch: Batch) -> tuple[Batch, list[Merged], FillStats]:
        """Dynamic sampling (`data/dynamic_sampling.py`): the step's scored batch, its
        all-alike groups dropped, refilled from extra rounds; and those rounds' calls."""
        cfg, calls = self.config, []

        def draw(r: int) -> Batch:
            prompts = round_prompts(self.train_set, step=step, round=r,
                                    count=cfg.train.prompts_per_step,
                                    repeats=cfg.algo.responses_per_prompt, seed=cfg.train.seed,
                                    max_rounds=cfg.algo.dynamic_sampling_max_rounds)
            gen = self.generate_round(prompts, self.sampling(step, r))
            scored, rewards = self.score(with_responses(prompts, gen.batch))
            calls.extend((gen, *rewards))
            return scored

        batch, stats = fill_groups(batch, groups=cfg.train.prompts_per_step,
                                   max_rounds=cfg.algo.dynamic_sampling_max_rounds, step=step,
                                   draw=draw,
                                   shaped=lambda b: shaped_scores(b, cfg, self.max_response))
        return batch, calls, stats

    def train_on(self, group, method, batch: Batch, step: int,  # noqa: ANN001
                 phases: Phases) -> list[Merged]:
        """`ppo_epochs` passes of shuffled mini-batches, one optimizer step each; `batch`
        holds the columns `method` reads (its role's ``*_READS``)."""
        t = self.config.train
        gen = torch.Generator().manual_seed(step_seed(self.config, step) + 1)
        out = []
        for _ in range(t.ppo_epochs):
            for chunk in mini_batches(len(batch), t.mini_batch_size, group.world_size, gen):
                mb = batch.take(chunk)
                out.append(phases.add(run_shards(group, method, mb, self.dispatch,
                                                 totals=Totals.of(mb, self.max_response),
                                                 step=step)))
        return out

    def _metrics(self, batch: Batch, merged: list[Merged], phases: Phases) -> dict[str, float]:
        sums: dict[str, list[float]] = {}
        for m in merged:
            for k, v in m.metric_values().items():
                sums.setdefault(k, []).append(v)
        # Means over mini-batches, except counts of skipped (non-finite) optimizer steps.
        out = {k: sum(v) if k.endswith("/skipped_steps") else sum(v) / len(v)
               for k, v in sums.items()}
        mask = action_mask(batch).bool()  # observation tokens have no rollout_logp (chapter 7)
        gap = (padded(batch, "old_logp") - padded(batch, "rollout_logp")).abs()[mask]
        out["train/reward"] = float(batch.scalars["score"].mean())
        out.update(shaping_metrics(batch, self.config, self.max_response))
        if self.config.algo.dynamic_sampling:
            out.update(self.fill_stats.metrics())
        out["rollout/logprob_gap"] = float(gap.mean()) if gap.numel() else 0.0
        out["rollout/logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
        if "ref_logp" in batch.packed:
            kl = kl_estimate(padded(batch, "old_logp"), padded(batch, "ref_logp"), "k1")
            out["actor/ref_kl"] = float(kl[mask].mean())
        out.update(phases.times())
        out["perf/tokens_per_s"] = float(batch.total_lens.sum()) / out["time/step"]
        return out

    # ---- validation ------------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Mean reward on the held-out prompts (greedy unless rollout.val_greedy=False)."""
        r = self.config.rollout
        prompts = prompt_batch(self.val_set, range(len(self.val_set)), repeats=1, first_id=0,
                               split=VAL)
        gen = run_shards(*self.generator(), prompts, None, max_new_tokens=self.max_response,
                         greedy=r.val_greedy, seed=step_seed(self.config, -1))
        batch, _ = self.score(with_responses(prompts, gen.batch))
        out = {"val/reward": float(batch.scalars["score"].mean()),
               "val/response_len": float(batch.response_lens.float().mean()),
               "val/truncation_rate": float(batch.scalars["truncated"].float().mean())}
        if "model_score" in batch.scalars:
            out["val/model_score"] = float(batch.scalars["model_score"].mean())
        return out
