"""Chapter 5 — the `reward_model` section of the config: a learned reward model as a role.

With `path` set, a local Hugging Face sequence classifier (``num_labels=1``, e.g. a
``Qwen2ForSequenceClassification`` reward model) scores every response in a phase of its
own ("reward_model"), run by `roles/reward_model.py`'s `RewardModelWorker` ranks. A sample's
score is then

    score = rule_weight x rule_score + weight x model_score

where `rule_score` is what the rule rewards give — the task's own reward, or the weighted
sum of `task.reward`/`task.rewards` (their weights apply inside it) — and `model_score` is
the classifier's logit. ``rule_weight=0`` trains on the reward model alone: the rule reward
is then not computed at all (its phase is skipped), so a dataset without answers works.

Where its ranks run (`placement`), the three layouts of the literature:

    critic   on the critic's bundles, one rank per critic rank (NeMo-Aligner's layout;
             needs PPO's critic)
    pool     a pool of its own, `dp` ranks, one bundle each (OpenRLHF's)
    policy   on the policy's bundles, one rank per policy rank, beside the actor and a
             colocated critic: everything on the same devices (DeepSpeed-Chat's)

This file declares and checks the section; `check_checkpoint` reads the checkpoint's
config.json (before any worker starts). It does not load the model (`roles/reward_model.py`)
or place it (`driver/placement.py`).
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from avrid.ppo.setup.validate import need, one_of, positive

RmPlacement = Literal["critic", "pool", "policy"]
"""Where the reward model's ranks run (see the module docstring)."""
RmDtype = Literal["float32", "bfloat16"]
TEMPLATE_FIELDS = ("prompt", "response")
"""The fields a `template` may name; {response} is required."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardModelConfig:
    """A learned reward model scoring responses beside (or instead of) the rule rewards."""

    path: str | None = None
    """Local directory of a transformers sequence-classification checkpoint with one label
    (num_labels=1), with its own tokenizer beside it; None = no reward model."""
    weight: float = 1.0
    """score = rule_weight x rule_score + weight x model_score."""
    rule_weight: float = 1.0
    """The rule rewards' share (the task's reward, or task.reward/task.rewards); 0 = the
    reward model alone (the rule reward is then not computed)."""
    template: str = "{prompt}{response}"
    """How the prompt's text and the decoded response make the text the reward model reads
    (Python format fields {prompt} and {response}; {response} is required). Tokenized with
    the reward model's own tokenizer (its special tokens added as it adds them)."""
    chat_template: bool = False
    """Build the text with the reward model tokenizer's chat template instead of `template`:
    the prompt as the user's message, the response as the assistant's."""
    placement: RmPlacement = "pool"
    """"critic" (NeMo-Aligner), "pool" (OpenRLHF: its own `dp` bundles) or "policy"
    (DeepSpeed-Chat: everything on the policy's bundles)."""
    dp: int = 1
    """Ranks of placement="pool" (the colocated placements take one per bundle)."""
    micro_batch_tokens: int = 4096
    """PER RANK token budget of one forward, padding included (speed/memory only)."""
    max_length: int | None = None
    """The longest text the reward model reads, in its own tokens; a longer one keeps its
    LAST max_length tokens (the response's end, where the score is read) and is counted in
    reward/model_truncated. None = the checkpoint's max_position_embeddings (positions past
    it are ones the model never learned)."""
    dtype: RmDtype | None = None
    """The reward model's weights and compute; None = bfloat16 on cuda, float32 on cpu."""

    def __post_init__(self) -> None:
        need(isinstance(self.weight, int | float) and math.isfinite(self.weight),
             "reward_model.weight", f"must be a finite number, got {self.weight!r}")
        need(isinstance(self.rule_weight, int | float) and math.isfinite(self.rule_weight),
             "reward_model.rule_weight", f"must be a finite number, got {self.rule_weight!r}")
        one_of("reward_model.placement", self.placement, RmPlacement, "placement")
        if self.dtype is not None:
            one_of("reward_model.dtype", self.dtype, RmDtype, "dtype")
        positive("reward_model", dp=self.dp, micro_batch_tokens=self.micro_batch_tokens)
        if self.max_length is not None:
            positive("reward_model", max_length=self.max_length)
        need(self.path is None or bool(self.path), "reward_model.path",
             "must be a local checkpoint directory, or None for no reward model")
        check_template(self.template)

    @property
    def enabled(self) -> bool:
        """Whether the run has a reward model."""
        return self.path is not None

    def torch_dtype(self, device: str) -> str:
        """The dtype it runs in on `device` ("cpu"/"cuda"): `dtype`, else bf16 on a GPU."""
        return self.dtype or ("bfloat16" if device == "cuda" else "float32")


def check_template(template: str) -> None:
    """`template` must be a format string naming {response} and at most {prompt} besides."""
    allowed = ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        need(False, "reward_model.template", f"{e} in {template!r}; a template is text with "
                                             f"the fields {allowed}")
    bad = [n for n in names if n not in TEMPLATE_FIELDS]
    need(not bad, "reward_model.template",
         f"unknown field {{{bad[0] if bad else ''}}} in {template!r}; allowed: {allowed}")
    need("response" in names, "reward_model.template",
         f"{template!r} has no {{response}}: the reward model would not see the response; "
         f"allowed fields: {allowed}")


def check_checkpoint(path: str) -> None:
    """The reward model at `path` must be a local sequence-classification checkpoint with
    one label; one-line ValueError naming what is wrong otherwise (read from config.json,
    so nothing is loaded)."""
    where = f"{path!r}"
    need(Path(path).is_dir(), "reward_model.path",
         f"no local directory at {where} (nothing is downloaded; point it at a local "
         f"sequence-classification checkpoint)")
    file = Path(path) / "config.json"
    need(file.is_file(), "reward_model.path", f"{where} has no config.json; a transformers "
                                             f"checkpoint saved with save_pretrained is needed")
    config = json.loads(file.read_text())
    archs = config.get("architectures") or []
    need(any(a.endswith("ForSequenceClassification") for a in archs), "reward_model.path",
         f"{where} is a {', '.join(archs) or 'model without architectures'}, not a "
         f"sequence classifier; allowed: a *ForSequenceClassification checkpoint (num_labels=1)")
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    need(labels == 1, "reward_model.path",
         f"{where} has num_labels={labels}; a reward model has one output (num_labels=1)")
