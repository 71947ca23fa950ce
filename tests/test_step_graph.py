"""The step as a graph (`avrid/ppo/driver/step_graph.py`): for each configuration the graph
derived from the phases' reads and writes is the one a person draws (written out here by
hand, edge by edge, with its reason), a phase list that reads a column before it is written is
refused, `avrid ppo --print-graph` prints and draws it, and the phases `Trainer.train_step`
really runs are the graph's (one in-process step per configuration), so the two cannot drift.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from avrid.cli import main
from avrid.ppo.driver.step_graph import (
    GraphError,
    StepGraph,
    StepPhase,
    build_graph,
    step_graph,
    step_phases,
)
from avrid.ppo.driver.trainer import Trainer
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset

pytestmark = pytest.mark.chapter(5)

GEN = "truncated, group"  # what the advantages read from generation's batch


def config(name: str, *sets: str) -> PPOConfig:
    return with_overrides(preset(name), list(sets))


def drawn(graph: StepGraph) -> dict[str, dict[str, str]]:
    """The graph as printed: each phase -> {phase it waits for: why}."""
    return {p.name: {e.before: e.reason() for e in graph.edges if e.after == p.name}
            for p in graph.phases}


# ---- the graph a person draws, per configuration ----------------------------------------------

PPO = {
    "generate": {},
    "reward": {"generate": "tokens, split, prompt_index"},
    "old_logp": {"generate": "tokens; policy order"},
    "values": {"generate": "tokens"},
    "advantages": {"generate": GEN, "reward": "score", "values": "values"},
    "critic_update": {"generate": "tokens", "values": "values; critic order",
                      "advantages": "loss_mask, returns"},
    "actor_update": {"generate": "tokens", "old_logp": "old_logp; policy order",
                     "advantages": "loss_mask, advantages"},
    "weight_sync": {"actor_update": "policy order"},
}

PPO_KL_IN_LOSS = {
    **PPO,
    "ref_logp": {"generate": "tokens", "old_logp": "policy order"},
    "actor_update": {"generate": "tokens", "old_logp": "old_logp",
                     "ref_logp": "ref_logp; policy order",
                     "advantages": "loss_mask, advantages"},
}

PPO_KL_IN_REWARD = {
    **PPO,
    "ref_logp": {"generate": "tokens", "old_logp": "policy order"},
    "advantages": {"generate": GEN, "reward": "score", "old_logp": "old_logp",
                   "ref_logp": "ref_logp", "values": "values"},
    "actor_update": {"generate": "tokens", "old_logp": "old_logp", "ref_logp": "policy order",
                     "advantages": "loss_mask, advantages"},
}

GRPO = {
    "generate": {},
    "reward": {"generate": "tokens, split, prompt_index"},
    "old_logp": {"generate": "tokens; policy order"},
    "advantages": {"generate": GEN, "reward": "score"},
    "actor_update": {"generate": "tokens", "old_logp": "old_logp; policy order",
                     "advantages": "loss_mask, advantages"},
    "weight_sync": {"actor_update": "policy order"},
}

GRPO_DYNAMIC = {
    "generate": {},
    "reward": {"generate": "tokens, split, prompt_index"},
    # It generates and scores more rounds: after generate on the policy, after reward on the
    # reward group; everything after reads its rows, not generate's.
    "resample": {"generate": "truncated, group; policy order", "reward": "score; reward order"},
    "old_logp": {"resample": "tokens; policy order"},
    "advantages": {"resample": "score, truncated, group"},
    "actor_update": {"resample": "tokens", "old_logp": "old_logp; policy order",
                     "advantages": "loss_mask, advantages"},
    "weight_sync": {"actor_update": "policy order"},
}

# The reference on a pool of its own (placement.reference=pool): ref_logp waits for the
# tokens alone, no longer for old_logp by the policy's order, so the two run at once.
PPO_KL_IN_LOSS_REFERENCE_POOL = {
    **PPO,
    "ref_logp": {"generate": "tokens"},
    "actor_update": {"generate": "tokens", "old_logp": "old_logp; policy order",
                     "ref_logp": "ref_logp", "advantages": "loss_mask, advantages"},
}

PPO_REWARD_MODEL = {
    **PPO,
    "reward_model": {"generate": "tokens, split, prompt_index"},
    "combine_scores": {"reward": "rule_score", "reward_model": "model_score"},
    "advantages": {"generate": GEN, "combine_scores": "score", "values": "values"},
}

CASES = {
    "ppo": (config("tiny-ppo"), PPO),
    "grpo": (config("tiny-grpo"), GRPO),
    "ppo, kl in the loss": (config("tiny-ppo", "algo.kl_coef=0.05"), PPO_KL_IN_LOSS),
    "ppo, kl in the reward": (config("tiny-ppo", "algo.kl_coef=0.05", "algo.kl_in=reward"),
                              PPO_KL_IN_REWARD),
    "grpo, kl_coef=0: no reference": (config("tiny-grpo", "algo.kl_coef=0"), GRPO),
    "grpo, dynamic sampling": (config("tiny-grpo", "algo.dynamic_sampling=true"),
                               GRPO_DYNAMIC),
    # LoRA: the reference is the actor with its adapters off, on the same ranks: the same
    # graph as a reference of its own (the policy group's order chains it the same way).
    "ppo, lora, kl in the loss": (config("tiny-ppo-lora", "algo.kl_coef=0.05"),
                                  PPO_KL_IN_LOSS),
    "ppo, reward model": (config("tiny-ppo", "reward_model.path=rm"), PPO_REWARD_MODEL),
    "ppo, kl in the loss, reference pool": (config("tiny-ppo", "algo.kl_coef=0.05",
                                                   "placement.reference=pool"),
                                            PPO_KL_IN_LOSS_REFERENCE_POOL),
    # LoRA with a reference pool: the pool holds the base weights, the same graph.
    "ppo, lora, kl in the loss, reference pool": (
        config("tiny-ppo-lora", "algo.kl_coef=0.05", "placement.reference=pool"),
        PPO_KL_IN_LOSS_REFERENCE_POOL),
}


@pytest.mark.parametrize("case", CASES)
def test_the_graph_of_each_configuration_is_the_one_drawn_by_hand(case: str) -> None:
    cfg, expected = CASES[case]
    graph = step_graph(cfg)
    assert drawn(graph) == expected
    assert set(graph.names()) == set(expected)


def test_the_order_of_the_phases_is_the_serial_trainers() -> None:
    assert step_graph(config("tiny-ppo", "algo.kl_coef=0.05")).names() == (
        "generate", "reward", "old_logp", "ref_logp", "values", "advantages", "critic_update",
        "actor_update", "weight_sync")


def test_with_lora_the_reference_is_the_adapters_off_actor_on_the_policy_group() -> None:
    graph = step_graph(config("tiny-ppo-lora", "algo.kl_coef=0.05"))
    ref = graph.phase("ref_logp")
    assert (ref.group, ref.model) == ("policy", "actor, adapters off")
    assert graph.phase("actor_update").model == "actor's LoRA adapters"
    plain = step_graph(config("tiny-ppo", "algo.kl_coef=0.05")).phase("ref_logp")
    assert (plain.group, plain.model) == ("policy", "reference")
    pooled = step_graph(config("tiny-ppo-lora", "algo.kl_coef=0.05",
                               "placement.reference=pool")).phase("ref_logp")
    assert (pooled.group, pooled.model) == ("reference", "reference, base weights")


def test_a_reward_model_alone_skips_the_rule_reward() -> None:
    graph = step_graph(config("tiny-ppo", "reward_model.path=rm", "reward_model.rule_weight=0"))
    assert "reward" not in graph.names()
    assert drawn(graph)["combine_scores"] == {"reward_model": "model_score"}
    assert not graph.phase("combine_scores").timed  # driver arithmetic inside score_batch


def test_a_critic_warm_up_step_has_no_actor_update_nor_sync() -> None:
    graph = step_graph(config("tiny-ppo"), updates_actor=False)
    assert drawn(graph) == {k: v for k, v in PPO.items()
                            if k not in ("actor_update", "weight_sync")}


def test_ready_phases_are_what_a_controller_may_issue_together() -> None:
    graph = step_graph(config("tiny-ppo", "algo.kl_coef=0.05"))
    assert graph.ready([]) == ("generate",)
    assert graph.ready(["generate"]) == ("reward", "old_logp", "values")
    assert graph.ready(["generate", "reward", "old_logp", "values"]) == ("ref_logp",
                                                                        "advantages")
    assert graph.ready(["generate", "reward", "old_logp", "values", "advantages"]) == (
        "ref_logp", "critic_update")


@pytest.mark.parametrize("case", CASES)
def test_issuing_the_ready_phases_in_waves_runs_each_once_and_no_group_twice(case: str) -> None:
    graph, done, waves = step_graph(CASES[case][0]), [], []
    while ready := graph.ready(done):
        for name in ready:  # every predecessor finished in an earlier wave
            assert set(graph.waits_for(name)) <= set(done), (name, done)
        busy = [(g, graph.phase(n).lane) for n in ready for g in graph.phase(n).groups
                if g != "driver"]
        assert len(busy) == len(set(busy)), f"{ready} share a worker group's lane"
        waves.append(ready)
        done += ready
    assert sorted(done) == sorted(graph.names())
    if case == "ppo, kl in the loss":  # the waves a person reads off the drawing
        assert waves == [("generate",), ("reward", "old_logp", "values"),
                         ("ref_logp", "advantages"), ("critic_update", "actor_update"),
                         ("weight_sync",)]
    if case == "ppo, kl in the loss, reference pool":  # ref_logp beside old_logp
        assert waves == [("generate",), ("reward", "old_logp", "ref_logp", "values"),
                         ("advantages",), ("critic_update", "actor_update"),
                         ("weight_sync",)]


# ---- the rules: lanes, refusals --------------------------------------------------------------

def test_phases_on_another_lane_of_a_group_are_not_chained_to_it() -> None:
    a = StepPhase("a", "policy", writes=("x",))
    b = StepPhase("b", "policy", lane="weights")
    c = StepPhase("c", "policy", reads=("x",))
    graph = build_graph([a, b, c])
    assert drawn(graph) == {"a": {}, "b": {}, "c": {"a": "x; policy order"}}


def test_a_phase_reading_a_column_written_later_is_refused_naming_both() -> None:
    phases = list(step_phases(config("tiny-ppo")))
    names = [p.name for p in phases]
    # The advantages moved before the values they read: a step that could not run.
    phases.insert(names.index("values"), phases.pop(names.index("advantages")))
    with pytest.raises(GraphError, match=r"phase 'advantages' reads column 'values', but only "
                                         r"values writes it, which runs later\. What each phase "
                                         r"writes: generate: tokens, .*values: values"):
        build_graph(phases)


def test_a_phase_reading_a_column_nobody_writes_is_refused() -> None:
    phases = [*step_phases(config("tiny-grpo")), StepPhase("bonus", "driver", ("critique",))]
    with pytest.raises(GraphError, match="phase 'bonus' reads column 'critique', but no phase "
                                         "writes it"):
        build_graph(phases)


def test_two_phases_of_one_name_are_refused() -> None:
    with pytest.raises(GraphError, match="two phases are called 'a'"):
        build_graph([StepPhase("a", "policy"), StepPhase("a", "critic")])


# ---- the command -----------------------------------------------------------------------------

TINY_PPO_TEXT = """\
generate        on policy (actor's rollout engine)
    reads      -
    writes     tokens, prompt_index, split, group, rollout_logp, truncated
    waits for  -
reward          on reward (task reward)
    reads      tokens, split, prompt_index
    writes     score
    waits for  generate (tokens, split, prompt_index)
old_logp        on policy (actor)
    reads      tokens
    writes     old_logp
    waits for  generate (tokens; policy order)
values          on critic (critic)
    reads      tokens
    writes     values
    waits for  generate (tokens)
advantages      on driver (ppo estimator)
    reads      score, truncated, group, values
    writes     advantages, loss_mask, returns
    waits for  generate (truncated, group), reward (score), values (values)
critic_update   on critic (critic)
    reads      tokens, loss_mask, values, returns
    writes     -
    waits for  generate (tokens), values (values; critic order), advantages (loss_mask, returns)
actor_update    on policy (actor)
    reads      tokens, loss_mask, old_logp, advantages
    writes     -
    waits for  generate (tokens), old_logp (old_logp; policy order), advantages (loss_mask, \
advantages)
weight_sync     on policy (actor -> rollout engine)
    reads      -
    writes     -
    waits for  actor_update (policy order)
"""


def test_print_graph_prints_the_tiny_ppo_step(capsys: pytest.CaptureFixture[str]) -> None:
    main(["ppo", "--print-graph"])
    assert capsys.readouterr().out == TINY_PPO_TEXT


def test_print_graph_file_draws_the_tiny_grpo_step(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    figure = tmp_path / "graph.png"
    main(["ppo", "--preset", "tiny-grpo", "--print-graph", str(figure)])
    out = capsys.readouterr().out
    heads = [line.split()[0] for line in out.splitlines() if not line.startswith(" ")]
    assert heads == ["generate", "reward", "old_logp", "advantages", "actor_update",
                     "weight_sync", "figure:"]
    assert out.endswith(f"figure: {figure}\n")
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 5_000 < figure.stat().st_size < 500_000


@pytest.mark.parametrize(("args", "error"), [
    (["--set", "pipeline.mode=one_step_off"], "the step graph is the synchronous loop's"),
    (["graph.txt"], "cannot draw the step graph to 'graph.txt': the file name must end in one "
                    "of .png, .pdf, .svg"),
])
def test_print_graph_refuses_in_one_line(args: list[str], error: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["ppo", "--print-graph", *args])
    assert done.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"avrid ppo --print-graph: {error}"), err
    assert captured.out == "" and not list(tmp_path.iterdir())  # nothing printed, no file


# ---- the graph is what the trainer runs ------------------------------------------------------

TRAINED = {
    "ppo, kl in the reward": ("tiny-ppo", "algo.kl_coef=0.05", "algo.kl_in=reward"),
    "grpo, dynamic sampling, kl in the loss": ("tiny-grpo", "algo.dynamic_sampling=true",
                                               "algo.kl_coef=0.05"),
    "ppo, lora, critic warm-up": ("tiny-ppo-lora", "algo.kl_coef=0.05",
                                  "train.critic_warmup_steps=1"),
    "ppo, reward model": ("tiny-ppo",),
    "ppo, reference pool, concurrent": ("tiny-ppo", "algo.kl_coef=0.05",
                                        "placement.reference=pool",
                                        "train.concurrent_phases=true"),
}


@pytest.mark.parametrize("case", TRAINED)
def test_the_trainer_runs_exactly_the_graphs_phases(case: str, tmp_path: Path) -> None:
    name, *sets = TRAINED[case]
    if case == "ppo, reward model":
        from tests.test_ppo_reward_model import save_reward_model

        sets.append(f"reward_model.path={save_reward_model(tmp_path / 'rm')}")
    cfg = config(name, *sets, "placement.backend=inprocess", "placement.actor_dp=1",
                 "placement.critic_dp=1", "train.prompts_per_step=4",
                 "algo.responses_per_prompt=4", "train.mini_batch_size=16",
                 "train.val_prompts=4", "train.progress=false", f"train.out_dir={tmp_path}")
    with Trainer(cfg) as trainer:
        trainer.start()
        metrics, batch = trainer.train_step(0)
        updated = trainer.updates_actor(0)
    graph = step_graph(cfg, updates_actor=updated)
    timed = [k.removeprefix("time/") for k in metrics if k.startswith("time/")
             and k not in ("time/step", "time/compute", "time/overhead")]
    assert timed == [p.name for p in graph.phases if p.timed]
    # What the graph says the phases write is what the step's batch holds (the rule score
    # alone is transient: the combined score takes its place).
    written = {c for p in graph.phases for c in p.writes} - {"rule_score"}
    assert written == set(batch.packed) | set(batch.scalars)
