"""Chapter 5 — the trainer's configuration: typed, validated once, never mutated.

One `PPOConfig` holds eleven small sections (`task` is in `task_config.py`, `algo` in
`algo.py`, `rollout` in `rollout.py`, `memory` in `memory.py`, `lora` in `lora.py`,
`reward_model` in `reward_model.py`, chapter 6's `pipeline` in `pipeline.py`, chapter 7's `tools` in
`tools.py`). Every field has a docstring, a default
that runs on a laptop, and a check in `__post_init__` that names the field and the allowed
range, so a bad value fails when the config is made — before Ray starts or any worker
loads a model.

Two kinds of sizes, never mixed:

- algorithmic sizes are GLOBAL and define the experiment: `prompts_per_step`,
  `responses_per_prompt`, `mini_batch_size` (sequences per optimizer step). Changing the number
  of workers does not change them.
- performance sizes are PER WORKER and only change speed/memory: `micro_batch_tokens` (the
  token budget of one forward/backward on one worker). Nothing has to divide anything: the
  dispatcher balances tokens over workers and the last mini-batch may be smaller.

Fields that must agree with each other (GRPO and its group size, a colocated critic and the
policy's bundles, the micro-batch and the longest sequence) are checked together by
`validate.py`, which `PPOConfig` runs when it is made.

Configs are frozen; `overrides.with_overrides(config, ["algo.name=grpo"])` returns a new,
re-validated config (the command line's ``--set``). Presets live in `presets.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from avrid.ppo.setup.algo import AlgoConfig
from avrid.ppo.setup.lora import LoraConfig
from avrid.ppo.setup.memory import MemoryConfig
from avrid.ppo.setup.pipeline import PipelineConfig
from avrid.ppo.setup.reward_model import RewardModelConfig
from avrid.ppo.setup.rollout import RolloutConfig
from avrid.ppo.setup.task_config import TaskConfig
from avrid.ppo.setup.tools import ToolsConfig
from avrid.ppo.setup.validate import finite, need, one_of, positive, validate
from avrid.workers.placement import Strategy

# The allowed values of each choice, declared once: the field's type, its check and the
# command line's parsing all read these.
Backend = Literal["ray", "inprocess"]
Device = Literal["cpu", "cuda"]
Dtype = Literal["float32", "bfloat16"]
LrSchedule = Literal["constant", "linear", "cosine"]
WandbMode = Literal["online", "offline", "disabled"]
"""How both learning rates move after the warm-up (see `TrainConfig.lr_schedule`)."""
ReferencePlacement = Literal["policy", "pool"]
"""Where the reference's log-probs are computed (`PlacementConfig.reference`)."""
RewardPlacement = Literal["policy", "critic", "pool"]
"""Where the rule reward's worker sits (`PlacementConfig.reward`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Which policy/critic to train. Without `path`, a tiny model is built from the fields
    below (random init, no download); with `path`, a local transformers checkpoint is read."""

    path: str | None = None
    """Local directory of a transformers causal LM (e.g. Qwen2.5-0.5B-Instruct); None = tiny."""
    critic_path: str | None = None
    """Local checkpoint for the critic's trunk; None = the policy's (`path`) or a tiny model."""
    tokenizer: str | None = None
    """"char" (the task's alphabet, one token per character) or a local tokenizer directory;
    None = "char" for a tiny model, `path` otherwise."""
    chat_template: bool | Literal["auto"] = False
    """Wrap each prompt as one user message with the tokenizer's chat template: true (the
    tokenizer must have one), false, or "auto" (where the tokenizer has one; a data file's
    chat prompt, task.name=file, is that one message)."""
    hidden_size: int = 64
    """Tiny model: width."""
    num_layers: int = 2
    """Tiny model: decoder layers."""
    num_heads: int = 4
    """Tiny model: attention heads (hidden_size must be divisible by it)."""
    dtype: Dtype = "float32"
    """Compute dtype of training and the dtype the rollout engine and reference hold. Trained
    weights and optimizer state stay fp32 either way (bf16 = FSDP2 mixed precision)."""

    def __post_init__(self) -> None:
        finite("model", self)
        positive("model", hidden_size=self.hidden_size, num_layers=self.num_layers,
                 num_heads=self.num_heads)
        need(self.hidden_size % self.num_heads == 0, "model.hidden_size",
             f"{self.hidden_size} is not divisible by num_heads={self.num_heads}")
        one_of("model.dtype", self.dtype, Dtype, "dtype")
        need(self.chat_template in (True, False, "auto"), "model.chat_template",
             f"must be true, false or 'auto', got {self.chat_template!r}")
        need(self.path is not None or self.tokenizer in (None, "char"), "model.tokenizer",
             "a tiny model (no model.path) uses the 'char' tokenizer")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """Schedule, optimisation and the run's outputs."""

    steps: int = 150
    """Training steps (one step = generate, score, learn, sync)."""
    prompts_per_step: int = 32
    """GLOBAL prompts per step; each gets `algo.responses_per_prompt` responses."""
    mini_batch_size: int = 128
    """GLOBAL sequences per optimizer step; the step's batch is cut into ceil(n / this)."""
    ppo_epochs: int = 1
    """Passes over the step's batch."""
    micro_batch_tokens: int = 4096
    """PER WORKER token budget of one forward/backward (speed/memory only)."""
    actor_lr: float = 1e-3
    """Actor AdamW learning rate."""
    critic_lr: float = 1e-3
    """Critic AdamW learning rate."""
    lr_warmup_steps: int = 0
    """Steps over which both learning rates rise linearly to their value: step k < warm-up
    trains at lr x (k + 1) / lr_warmup_steps. 0 = no warm-up. (Not `critic_warmup_steps`,
    which trains the critic alone first.)"""
    lr_schedule: LrSchedule = "constant"
    """After the warm-up: "constant", or a "linear" or "cosine" decay that reaches
    min_lr_ratio x lr at the last step. A function of the step alone, so a resumed run
    continues the same curve."""
    min_lr_ratio: float = 0.0
    """Where a decaying schedule ends, as a fraction of the learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (clip_grad_norm_ over all DP shards)."""
    gradient_checkpointing: bool | None = None
    """Activation checkpointing in the actor's and critic's updates: each decoder layer keeps
    only its input and recomputes its activations in the backward pass (about a third more
    compute; activation memory no longer grows with the layers). Changes no result. None =
    on when a checkpoint is read (model.path or model.critic_path), off for the tiny models."""
    critic_warmup_steps: int = 0
    """Steps at the start that train only the critic (PPO)."""
    concurrent_phases: bool = False
    """Issue each phase of a step as soon as the phases it reads from have finished and its
    workers are free (`driver/concurrent.py`, by the graph `avrid ppo --print-graph` prints):
    with the critic on a pool of its own its values run beside the policy's log-probs, its
    update beside the actor's. The same metrics, samples and weights bit for bit; only the
    time changes. Roles that share devices (colocate_critic=true) then compute on them at
    once: more memory at a time, little to gain. Off: one phase after another, as chapter 5
    reads them."""
    seed: int = 0
    """Seeds model init, data order and sampling: same seed, same metrics. 0 <= seed < 2**32
    (each step's sampling seed is derived from it and must fit 64 bits)."""
    val_every: int = 25
    """Validate every this many steps (and at step 0 and the last step)."""
    val_prompts: int = 200
    """Held-out prompts scored at each validation."""
    out_dir: str = "runs/ppo"
    """Where metrics.jsonl, samples.jsonl, plots and checkpoints go."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many steps and at the end (0 = only at the end, so an
    interrupted run cannot resume). Pick it so that a checkpoint is minutes, not hours, of
    work apart; `keep_checkpoints` bounds the disk they take."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (older ones are pruned after a new one lands)."""
    resume: bool = False
    """Continue from the latest checkpoint in out_dir (same config required). Without it, a
    run refuses an out_dir that holds an earlier run's metrics or checkpoints."""
    resume_from: str | None = None
    """Resume from this step directory instead of the latest (implies `resume`): a path, or
    a name in out_dir/checkpoints such as "step_000050". For when the latest is damaged."""
    progress: bool = True
    """Show progress: a bar on a terminal; where stderr is not one (a CI log, a batch job),
    a plain line every 10 steps or 60 s, and at the last step."""
    samples_per_step: int = 4
    """Rollout samples written to samples.jsonl each step."""
    tensorboard: bool = False
    """Also log to tensorboard (needs `pip install tensorboard`)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (needs `pip install wandb`). A resumed
    run continues the same W&B run (its id is kept in out_dir/wandb_id.txt)."""
    wandb_name: str | None = None
    """The W&B run's name; None: the output directory's name."""
    wandb_mode: WandbMode | None = None
    """W&B mode: "online", "offline" (local files under out_dir/wandb; upload them later with
    `wandb sync`) or "disabled"; None: W&B's default, which follows WANDB_MODE."""
    call_timeout_s: float = 3600.0
    """Longest wait for one worker call (one phase on one group: generate, reward, an update,
    a checkpoint gather). Past it the run stops with an error naming the role, the rank, the
    method and the wait, instead of hanging on a stuck reward function or worker. Generous by
    default (long chains of thought on a big model generate for many minutes); lower it for
    small runs, where a phase takes seconds."""
    setup_timeout_s: float = 900.0
    """Longest wait for the workers to start and build their models (a vLLM engine or a large
    checkpoint takes minutes on a busy machine)."""
    collective_timeout_s: float = 600.0
    """Longest wait of one torch.distributed collective among a role's ranks (NCCL/gloo). The
    first one waits for every rank's checkpoint load and vLLM's start-up (compile, CUDA
    graphs), so it is minutes on a large model (verl uses >= 600 s); past it a missing or stuck
    rank fails the run instead of hanging it."""

    def __post_init__(self) -> None:
        finite("train", self)
        need(0 <= self.seed < 2**32, "train.seed", f"must be in [0, 2**32), got {self.seed}")
        positive("train", steps=self.steps, prompts_per_step=self.prompts_per_step,
                 mini_batch_size=self.mini_batch_size, ppo_epochs=self.ppo_epochs,
                 micro_batch_tokens=self.micro_batch_tokens, actor_lr=self.actor_lr,
                 critic_lr=self.critic_lr, grad_clip=self.grad_clip,
                 val_every=self.val_every, val_prompts=self.val_prompts,
                 call_timeout_s=self.call_timeout_s, setup_timeout_s=self.setup_timeout_s,
                 collective_timeout_s=self.collective_timeout_s)
        one_of("train.lr_schedule", self.lr_schedule, LrSchedule, "schedule")
        if self.wandb_mode is not None:
            one_of("train.wandb_mode", self.wandb_mode, WandbMode, "mode")
        need(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio",
             f"must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("weight_decay", "critic_warmup_steps", "checkpoint_every", "lr_warmup_steps",
                     "samples_per_step"):
            need(getattr(self, name) >= 0, f"train.{name}",
                 f"must be >= 0, got {getattr(self, name)}")
        need(self.gradient_checkpointing is None or isinstance(self.gradient_checkpointing, bool),
             "train.gradient_checkpointing",
             f"must be true, false or null (automatic), got {self.gradient_checkpointing!r}")
        need(isinstance(self.concurrent_phases, bool), "train.concurrent_phases",
             f"must be true or false, got {self.concurrent_phases!r}")
        positive("train", keep_checkpoints=self.keep_checkpoints)
        need(bool(self.out_dir), "train.out_dir", "must be a directory path")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementConfig:
    """Where the roles run. Actor and reference share processes, and in sync mode so does
    the rollout engine (the hybrid engine: no weight copy crosses a process); the critic
    shares their bundles or gets its own; the reference and the rule reward may get pools of
    their own. (`pipeline.rollout_dp`: the rollout pool.)"""

    backend: Backend = "ray"
    """"ray" (one process per worker) or "inprocess" (threads; debugging, dp = 1 only)."""
    device: Device = "cpu"
    """Where models run; "cuda" trains with NCCL and can use vLLM."""
    actor_dp: int = 2
    """Data-parallel ranks of the actor (+ reference + rollout); FSDP2 shards over them."""
    critic_dp: int = 2
    """Data-parallel ranks of the critic."""
    colocate_critic: bool = True
    """Critic in the actor's bundles (True) or in a pool of its own."""
    reference: ReferencePlacement = "policy"
    """Where the frozen reference computes its log-probs (with algo.kl_coef > 0): "policy"
    in the policy's own ranks (a copy beside the actor; with LoRA the actor with its
    adapters off), "pool" on `reference_dp` ranks of a pool of their own, each holding a
    whole frozen copy of the initial weights (with LoRA: the base weights), so its pass can
    run beside the actor's (train.concurrent_phases)."""
    reference_dp: int = 1
    """Ranks of reference="pool" (data-parallel; each holds the whole frozen model)."""
    reward: RewardPlacement = "policy"
    """Where the rule reward's worker sits: "policy" (a 0.1-CPU share of the first policy
    bundle), "critic" (the same share of the first critic bundle; PPO), or "pool" (a bundle
    of `cpus_per_worker` CPUs of its own). It holds no model; a learned reward model has its
    own setting, reward_model.placement."""
    cpus_per_worker: float = 1.0
    """CPUs in each bundle (the torch threads of a worker)."""
    strategy: Strategy = "PACK"
    """How the policy's bundles (and a separate critic's) are laid over the cluster's nodes:
    "PACK" (as few nodes as fit), "SPREAD" (as many as it can), "STRICT_PACK" (one node or
    fail), "STRICT_SPREAD" (a node per bundle or fail). Only matters on a multi-node cluster."""
    ray_address: str | None = None
    """The Ray cluster to run on (`avrid ppo --address`): None = the RAY_ADDRESS environment
    variable if set, else a new local Ray; "auto" = the cluster `ray start --head` started on
    this machine; "host:port" = that head node; "local" = always a new local Ray. Every node
    needs the same avrid and Python installed."""

    def __post_init__(self) -> None:
        finite("placement", self)
        one_of("placement.strategy", self.strategy, Strategy, "strategy")
        need(self.ray_address is None or (bool(self.ray_address.strip())
                                           and self.ray_address == self.ray_address.strip()),
             "placement.ray_address", f"must be 'auto', 'local', 'host:port' or None, got "
             f"{self.ray_address!r}")
        one_of("placement.backend", self.backend, Backend, "backend")
        one_of("placement.device", self.device, Device, "device")
        one_of("placement.reference", self.reference, ReferencePlacement, "placement")
        one_of("placement.reward", self.reward, RewardPlacement, "placement")
        positive("placement", actor_dp=self.actor_dp, critic_dp=self.critic_dp,
                 reference_dp=self.reference_dp, cpus_per_worker=self.cpus_per_worker)


@dataclass(frozen=True, slots=True, kw_only=True)
class PPOConfig:
    """The whole run. Made once, checked once, passed everywhere, never changed."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    def __post_init__(self) -> None:
        validate(self)  # the rules that tie fields of different sections together

    @property
    def checkpoints_activations(self) -> bool:
        """Whether the trained models checkpoint activations (`train.gradient_checkpointing`;
        where it is None, whether the run reads a checkpoint: the tiny models keep their
        speed, real ones their memory)."""
        if self.train.gradient_checkpointing is not None:
            return self.train.gradient_checkpointing
        return self.model.path is not None or self.model.critic_path is not None
