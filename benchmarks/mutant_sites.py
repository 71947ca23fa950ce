"""The mutation check's sites (`mutants.py`): each names one line of the RL math, the roles or
the output code, a small change to it, and the fast tests that should notice.

Kept apart from the runner so that the list, which grows with every held-out audit, reads as
data: `Site` and `site` say what an entry holds, `SITES` is the list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The tests each kind of site needs (fast, in-process, no Ray).
MATH = ("tests/test_ppo_math.py", "tests/test_ppo_math_limits.py")
OFF = ("tests/test_off_policy.py",)
ROLE = ("tests/test_role_formulas.py",)
OFF_UPDATE = ("tests/test_off_policy_update.py",)
UPDATES = ("tests/test_ppo_updates.py",)
TRUNC = ("tests/test_ppo_truncation.py",)
DYN = tuple(f"tests/test_dynamic_sampling.py::{t}" for t in (
    "test_a_group_varies_only_if_its_scores_differ",
    "test_the_batch_is_exact_and_every_kept_group_varies"))
DP = ("tests/test_ppo_dp_equivalence.py",)
READS = ("tests/test_ppo_reads.py::test_the_actor_reads_what_its_loss_needs_under_each_config",)
POLICY = "avrid/ppo/roles/policy.py"
CRITIC = "avrid/ppo/roles/critic.py"
FORWARD = "avrid/ppo/roles/forward.py"
TRAINED = "avrid/ppo/roles/trained.py"
LOSSES = "avrid/ppo/algo/losses.py"
ADV = "avrid/ppo/algo/advantages.py"
OFF_POLICY = "avrid/ppo/algo/off_policy.py"
LOGPROBS = "avrid/ppo/algo/logprobs.py"
CREDIT = "avrid/ppo/data/credit.py"
DYNAMIC = "avrid/ppo/data/dynamic_sampling.py"
REGISTRY = "avrid/ppo/algo/registry.py"
EPISODES = "avrid/agents/episodes.py"
EXPORT_DEST = "avrid/ppo/outputs/export_dest.py"
REFERENCE = "avrid/ppo/roles/reference.py"
EPISODE_LIMITS = ("tests/test_agents_episode_limits.py",)
EDGES = ("tests/test_ppo_estimator_edges.py",)


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """One mutation: in `file`, `anchor` (exactly once there) becomes `replace`, or, with
    `replace=None`, the whole line holding it is deleted; `tests` are the pytest node ids
    (run in the copy) that should notice; `why` explains a survivor that cannot matter."""

    name: str
    file: str
    anchor: str
    replace: str | None
    tests: tuple[str, ...]
    why: str = ""

    def mutation(self) -> str:
        """What the change is, for the table."""
        return "delete line" if self.replace is None else f"-> `{' '.join(self.replace.split())}`"

    def apply(self, text: str) -> str:
        """`text` (the file's source) with the change made; the anchor must be found once."""
        if text.count(self.anchor) != 1:
            raise ValueError(f"site {self.name!r}: anchor found {text.count(self.anchor)} "
                             f"times in {self.file} (expected exactly once)")
        if self.replace is not None:
            return text.replace(self.anchor, self.replace)
        start = text.rindex("\n", 0, text.index(self.anchor)) + 1
        end = text.index("\n", start) + 1
        return text[:start] + text[end:]


def site(name: str, file: str, anchor: str, replace: str | None, tests: tuple[str, ...],
         why: str = "") -> Site:
    return Site(name=name, file=file, anchor=anchor, replace=replace, tests=tests, why=why)


SITES: tuple[Site, ...] = (
    # ---- the actor's loss (roles/policy.py) ----
    site("is_weights", POLICY, "per_token = per_token * iw.weights", None,
         OFF_UPDATE + ROLE),
    site("is_args_swapped", POLICY,
         'importance_weights(padded(mb, "old_logp"), padded(mb, "rollout_logp"),',
         'importance_weights(padded(mb, "rollout_logp"), padded(mb, "old_logp"),', OFF_UPDATE),
    site("is_cap_ignored", POLICY, "correction=correction, cap=q.is_cap)",
         "correction=correction, cap=1e9)", OFF_UPDATE),
    site("auto_unresolved", POLICY, "correction = q.applied_correction",
         'correction = "none"', OFF_UPDATE),
    site("actor_agg_weights", POLICY, "loss = (per_token * w).sum()",
         "loss = per_token.sum()", ROLE),
    site("kl_loss_coef", POLICY, "loss = loss + a.kl_coef * (kl * w).sum()",
         "loss = loss + 0 * (kl * w).sum()", ROLE),
    site("kl_loss_detached", POLICY, 'kl = kl_estimate(logp, padded(mb, "ref_logp")',
         'kl = kl_estimate(logp.detach(), padded(mb, "ref_logp")', ROLE),
    site("kl_loss_kind", POLICY, 'padded(mb, "ref_logp"), a.kl_kind)',
         'padded(mb, "ref_logp"), "k3")', ROLE),
    site("kl_loss_switch", POLICY, 'kl_loss = a.kl_coef > 0 and a.kl_in == "loss"',
         "kl_loss = False", ROLE),
    site("entropy_sign", POLICY, "loss = loss - a.entropy_coef * (ent * w).sum()",
         "loss = loss + a.entropy_coef * (ent * w).sum()", ROLE),
    site("entropy_weights", POLICY, "a.entropy_coef * (ent * w).sum()",
         "a.entropy_coef * (ent * mask).sum()", ROLE),
    site("clip_swapped", REGISTRY, "clip_low=a.clip_low, clip_high=a.clip_high,",
         "clip_low=a.clip_high, clip_high=a.clip_low,", ROLE),
    site("dual_clip_off", REGISTRY, "dual_clip=a.dual_clip)", "dual_clip=None)", ROLE),
    site("update_temperature", POLICY,
         "logp, ent = response_logprobs(self.model, x, self.config.rollout.temperature,",
         "logp, ent = response_logprobs(self.model, x, 1.0,", ROLE),
    site("old_logp_temperature", POLICY,
         "    temperature=self.config.rollout.temperature,\n                           packed=",
         "    temperature=1.0,\n                           packed=", ROLE),
    site("ref_pool_temperature", REFERENCE,
         "temperature=self.config.rollout.temperature, packed=",
         "temperature=1.0, packed=", ("tests/test_placement_pools.py",)),
    site("reads_rollout_logp", POLICY, 'reads += ("rollout_logp",)', "reads += ()", READS),
    site("reads_ref_logp", POLICY, 'reads += ("ref_logp",)', "reads += ()", READS),
    # ---- the critic's loss (roles/critic.py) ----
    site("critic_agg_weights", CRITIC, "return (out.per_token * w).sum()",
         "return out.per_token.sum()", ROLE),
    site("value_clip_off", CRITIC, "clip=a.value_clip)", "clip=None)", ROLE),
    site("critic_old_values", CRITIC, 'out = value_loss(values, padded(mb, "values"),',
         "out = value_loss(values, values.detach(),", ROLE),
    # ---- the update walk (roles/forward.py, roles/trained.py) ----
    site("agg_mode_ignored", FORWARD, "w = token_weights(mask, agg,",
         'w = token_weights(mask, "token-mean",', ROLE),
    site("dp_weight", FORWARD, "norm_len=totals.norm_len) * world_size",
         "norm_len=totals.norm_len)", DP),
    site("dp_loss_metric", FORWARD, "value = float(loss.detach()) / world_size",
         "value = float(loss.detach())", DP),
    site("sample_loss_mask", FORWARD,
         "mask = x.action_mask * sample_loss_mask(on_device)[:, None]",
         "mask = x.action_mask", UPDATES),
    site("grad_clip", FORWARD, "clip_grad_norm_(model.parameters(), grad_clip)",
         "clip_grad_norm_(model.parameters(), 1e9)", ROLE),
    site("entropy_temperature_forward", LOGPROBS, "entropy_from_logits(logits, temperature))",
         "entropy_from_logits(logits))", ROLE),
    site("lr_warmup", TRAINED, "return lr * (step + 1) / train.lr_warmup_steps",
         "return lr * step / train.lr_warmup_steps", UPDATES),
    site("lr_set", TRAINED, 'group["lr"] = lr', 'group["lr"] = self.lr', UPDATES),
    # ---- losses (algo/losses.py) ----
    site("k2_half", LOSSES, "return 0.5 * d * d", "return d * d", MATH + (LOSSES,)),
    site("k3_cap", LOSSES, "return (torch.exp(neg) - neg - 1.0).clamp(max=_MAX_K3)",
         "return torch.exp(neg) - neg - 1.0", MATH + (LOSSES,)),
    site("tw_token_mean", LOSSES, "return m / max(tokens, 1)", "return m", MATH + (LOSSES,)),
    site("tw_seq_sum", LOSSES, "return m / max(seqs, 1)", "return m",
         MATH + (LOSSES,)),
    site("tw_seq_mean", LOSSES, "return m / m.sum(1, keepdim=True).clamp(min=1) / max(seqs, 1)",
         "return m / max(seqs, 1)", MATH + (LOSSES,)),
    site("tw_norm_len", LOSSES, "return m / (int(norm_len) * max(seqs, 1))",
         "return m / max(seqs, 1)", MATH + (LOSSES,)),
    site("pg_pessimistic", LOSSES, "per_token = torch.maximum(unclipped, clipped)",
         "per_token = torch.minimum(unclipped, clipped)", MATH + (LOSSES,)),
    site("pg_clip_high", LOSSES, "ratio.clamp(1.0 - clip_low, 1.0 + clip_high)",
         "ratio.clamp(1.0 - clip_low, 1.0 + clip_low)", MATH + (LOSSES,)),
    site("pg_dual_only_negative", LOSSES, "dual_flags = (adv < 0) & (per_token > cap)",
         "dual_flags = per_token > cap", MATH + (LOSSES,)),
    site("pg_clipfrac_strict", LOSSES, "clip_flags = clipped > unclipped\n    if dual_clip",
         "clip_flags = clipped >= unclipped\n    if dual_clip", MATH + (LOSSES,)),
    site("k3_inner_clamp", LOSSES, "neg = (-d).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)",
         "neg = -d", MATH + (LOSSES,)),
    site("pg_targets_detached", LOSSES, "old, adv = old.detach(), adv.detach()",
         "old, adv = old, adv", MATH + OFF),
    site("pg_log_ratio_clamp", LOSSES,
         "log_ratio = (lp - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)",
         "log_ratio = lp - old", MATH + (LOSSES,)),
    site("vl_clip", LOSSES, "v_clip = v.clamp(old - clip, old + clip)", "v_clip = v",
         MATH + (LOSSES,)),
    site("vl_pessimistic", LOSSES, "per_token = 0.5 * torch.maximum(unclipped, clipped)",
         "per_token = 0.5 * torch.minimum(unclipped, clipped)", MATH + (LOSSES,)),
    site("vl_half", LOSSES, "per_token = 0.5 * unclipped", "per_token = unclipped",
         MATH + (LOSSES,)),
    site("vl_targets_detached", LOSSES, "old, ret = old.detach(), ret.detach()",
         "old, ret = old, ret", MATH),
    # ---- advantages (algo/advantages.py) ----
    site("gae_gamma", ADV, "delta = r[:, t] + gamma * next_v - v[:, t]",
         "delta = r[:, t] + next_v - v[:, t]", MATH + (ADV,)),
    site("gae_lam", ADV, "running = delta + gamma * lam * running",
         "running = delta + gamma * running", MATH + (ADV,)),
    site("gae_returns", ADV, "returns = torch.where(m, adv + v, 0.0)",
         "returns = torch.where(m, adv, 0.0)", MATH + (ADV,)),
    site("grpo_bessel", ADV, "std = (sq / (n - 1).clamp(min=1)).sqrt()",
         "std = (sq / n).sqrt()", MATH + (ADV,)),
    site("grpo_std", ADV, "adv = centred / (std[inv] + eps)", "adv = centred",
         MATH + (ADV,)),
    site("kl_reward_sign", ADV, "rewards = torch.where(m, -kl_coef * _check_like(",
         "rewards = torch.where(m, kl_coef * _check_like(", MATH + (ADV,)),
    site("score_last_token", ADV, "* m).argmax(dim=1)", "* m).argmin(dim=1)",
         MATH + (ADV,)),
    site("whiten_bessel", ADV, "var = torch.where(m, (x - mean) ** 2, 0.0).sum() / (n - 1)",
         "var = torch.where(m, (x - mean) ** 2, 0.0).sum() / n", MATH + (ADV,)),
    site("whiten_eps", ADV, "torch.rsqrt(var + eps)", "torch.rsqrt(var)", MATH + (ADV,)),
    site("whiten_keep_mean", ADV, "out = out + mean", "out = out", MATH + (ADV,)),
    # ---- the off-policy weights (algo/off_policy.py) ----
    site("tis_cap", OFF_POLICY, "weights = raw.clamp(max=cap)", "weights = raw",
         OFF + (OFF_POLICY,)),
    site("decoupled_drop", OFF_POLICY, "weights = torch.where(capped, 0.0, raw)",
         "weights = raw.clamp(max=cap)", OFF + (OFF_POLICY,)),
    site("is_ratio_direction", OFF_POLICY, "log_ratio = (old - rollout).clamp(",
         "log_ratio = (rollout - old).clamp(", OFF + (OFF_POLICY,)),
    site("capped_strict", OFF_POLICY, "capped = (raw > cap) & m", "capped = (raw >= cap) & m",
         OFF + (OFF_POLICY,)),
    site("none_is_one", OFF_POLICY, "weights = m.float()", "weights = raw", OFF),
    site("is_detached", OFF_POLICY, "return torch.where(mask, t.detach().float(), 0.0)",
         "return torch.where(mask, t.float(), 0.0)", OFF),
    # ---- log-probs and entropy (algo/logprobs.py) ----
    site("logp_temperature", LOGPROBS, "scaled = logits.float() / temperature",
         "scaled = logits.float()", ROLE + (LOGPROBS,)),
    site("entropy_formula_sign", LOGPROBS, "return -(logp.exp() * logp).sum(-1)",
         "return (logp.exp() * logp).sum(-1)", ROLE + (LOGPROBS,)),
    site("entropy_temperature", LOGPROBS,
         "logp = torch.log_softmax(logits.float() / temperature, dim=-1)",
         "logp = torch.log_softmax(logits.float(), dim=-1)", ROLE + (LOGPROBS,)),
    # ---- the advantages the trainer computes (data/credit.py, algo/registry.py) ----
    site("truncation_penalty", CREDIT, "scores = scores - a.truncation_penalty * truncated",
         "scores = scores", ROLE + TRUNC),
    site("truncation_mask", CREDIT,
         'kept = {"loss_mask": 1.0 - cut if a.truncation == "mask" else',
         'kept = {"loss_mask": 1.0 + 0 * cut if a.truncation == "mask" else',
         ROLE + TRUNC),
    site("kl_reward_args", CREDIT,
         'kl = kl_estimate(at(padded(batch, "old_logp")), at(padded(batch, "ref_logp")),',
         'kl = kl_estimate(at(padded(batch, "ref_logp")), at(padded(batch, "old_logp")),',
         ROLE),
    site("kl_reward_mask", CREDIT, "a.kl_kind) * actions", "a.kl_kind)", ROLE + TRUNC,
         why="equivalent: `padded` fills both log-prob columns with 0 on padding, so d = 0 "
             "there and k1, k2 and k3 are all exactly 0 (what `* mask` would give); "
             "`kl_penalized_rewards` masks again. Defence in depth, not a formula."),
    site("kl_reward_coef", CREDIT,
         "kl_penalized_rewards(scores, kl, actions, kl_coef=a.kl_coef)",
         "kl_penalized_rewards(scores, kl, actions, kl_coef=0.0)", ROLE),
    site("gae_args", REGISTRY, "gamma=x.algo.gamma, lam=x.algo.lam)",
         "gamma=x.algo.lam, lam=x.algo.gamma)", ROLE),
    site("whiten_call", REGISTRY, "adv = whiten(adv, x.mask)", "adv = adv", ROLE),
    site("grpo_kl_in_score", CREDIT, "scores=scores - a.kl_coef * kl.sum(1)",
         "scores=scores", ROLE),
    # ---- dynamic sampling (data/dynamic_sampling.py) ----
    site("varied_not_strict", DYNAMIC, "return (high > low)[inv]", "return (high >= low)[inv]",
         DYN),
    site("fill_one_group_too_many", DYNAMIC, "batch.take(torch.nonzero(dense < groups)",
         "batch.take(torch.nonzero(dense <= groups)", DYN),
    site("grpo_norm_choice", REGISTRY, "norm_by_std=x.algo.grpo_norm_by_std)",
         "norm_by_std=True)", ROLE),
    # ---- issue 44's held-out audit: each survived until its test was written ----
    site("lora_unseeded", "avrid/ppo/roles/lora.py", "    with seeded_init(seed):\n",
         "    with torch.random.fork_rng(devices=[]):\n",
         ("tests/test_ppo_lora.py::test_the_adapters_start_from_the_seed_whatever_was_"
          "drawn_before",)),
    site("episode_cap_ignored", EPISODES,
         "budget = min(limits.turn_tokens - used, limits.max_tokens - len(ep.traj.ids))",
         "budget = limits.turn_tokens - used", EPISODE_LIMITS),
    site("stop_not_ending_turn", EPISODES, "stopped = bool(ids) and ids[-1] in stops",
         "stopped = False", EPISODE_LIMITS),
    site("calc_last_call", "avrid/agents/calc.py", "self._calls[0]", "self._calls[-1]",
         ("tests/test_agents_calc.py::test_the_shaped_reward_credits_the_first_call_not_a_"
          "later_one",)),
    site("export_root_unprotected", EXPORT_DEST, "protected.append(step.parent)", "pass",
         ("tests/test_ppo_export_dest.py",)),
    site("export_extra_folders", EXPORT_DEST, "folders <= {ADAPTER_DIR} and (", "(",
         ("tests/test_ppo_export_dest.py",)),
    site("by_value_submodules", "avrid/workers/call_wire.py",
         'module == name or module.startswith(name + ".")', "module == name",
         ("tests/test_call_wire.py::test_a_submodule_of_a_by_value_package_goes_the_"
          "ordinary_way",)),
    site("gspo_uncapped", "avrid/ppo/algo/policy_losses.py",
         ".clamp(max=_GSPO_MAX_LOG_RATIO)", "", EDGES),
    site("rpp_baseline_singleton", "avrid/ppo/algo/estimators.py",
         "centred = torch.where(n > 1, s - total / n, s)", "centred = s - total / n", EDGES),
    site("packed_default_scale", "avrid/ppo/engines/packed_attention.py",
         "is_causal=True, scale=scaling, dropout_p", "is_causal=True, dropout_p",
         ("tests/test_packed_attention.py",)),
    site("held_scales_a", "avrid/ppo/engines/vllm_lora.py",
         'cast * scaling if ".lora_B." in key', 'cast * scaling if ".lora_A." in key',
         ("tests/test_ppo_lora_adapter_sync.py",)),
    site("chunks_not_checkpointed", LOGPROBS, "        if keep_graph:\n",
         "        if False:\n", ("tests/test_ppo_packed_logprobs.py",)),
)
