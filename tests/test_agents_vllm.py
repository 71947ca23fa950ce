"""Chapter 7's episode loop on the real vLLM engine (`vllm` tier: `make test-vllm` on CPU,
`make gpu-test` on CUDA).

The CPU tests (`test_agents_episodes.py`) run the loop over `TorchEngine`; here the same
loop drives `VllmEngine`, which it calls only through `generate`: multi-turn episodes with
scripted environments, segments on and off, both schedules. What the trainer gets must be
exactly the engine's tokens and the environment's, turn by turn, with the action mask on the
policy's tokens alone, and the trainer's log-probs of those tokens must equal vLLM's (fp32:
chapter 5's bound, 1e-4). The model is `test_ppo_vllm.py`'s kind of tiny random Qwen2, shaped
for vLLM's CPU attention (head dim 64), saved with `save_pretrained` so the trainer can load
the very weights vLLM serves. One engine serves the module; the `AgentTrainer` run, whose
policy rank builds its own engine in this process (in-process backend; one vLLM engine per
process at a time), comes first, before that engine is built.

Not here: the loop's own properties on any engine (limits, per-token versions under weight
updates: `test_agents_episodes.py`), vLLM's engine alone (`test_ppo_vllm.py`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from avrid.agents.env import EpisodeLimits
from avrid.agents.episodes import run_episodes
from avrid.agents.trajectory import Trajectory, trajectory_columns
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy, load_policy
from avrid.ppo.engines.torch_engine import SamplingParams, TorchEngine
from tests.helpers import trainer_logprobs
from tests.test_agents_episodes import IdTokenizer, RecordingEngine, ScriptedEnv

if TYPE_CHECKING:  # vllm is imported inside the engine only
    from avrid.ppo.engines.vllm_engine import VllmEngine

pytestmark = [pytest.mark.chapter(7), pytest.mark.vllm]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SPEC = TinyModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=2, num_kv_heads=2, max_positions=256)
PAD = 0
STOPS = tuple(range(1, 33))
"""Turn stops: 32 of 512 ids, so that some turns end at a stop and others at their budget."""
LIMITS = EpisodeLimits(max_turns=4, turn_tokens=8, max_tokens=60)
TOKENIZER = IdTokenizer(vocab_size=SPEC.vocab_size)  # the envs' ids go up to 511


def scripted_envs(n: int, seed: int, delays: bool) -> list[ScriptedEnv]:
    """`n` scripted episodes: prompts and observations of ids past the stops (an empty
    observation among them), 1-4 turns, and (`delays`) tools of 0-20 ms, so that
    per-trajectory scheduling mixes episodes at different turns in one call."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(40, 512) for _ in range(k)]  # noqa: E731
    return [ScriptedEnv(prompt=ids(rng.randint(1, 12)),
                        observations=[ids(rng.randint(0 if i == 1 else 1, 5))
                                      for i in range(4)],
                        turns=rng.randint(1, 4),
                        # drawn either way: the same seed gives the same episodes
                        delay_s=rng.random() * 0.02 * delays)
            for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("agents_vllm") / "policy"
    policy = build_tiny_policy(SPEC, seed=0, pad_token_id=PAD)
    with torch.no_grad():  # greedy argmaxes far from ties (as test_ppo_vllm.py does)
        policy.lm_head.weight.mul_(4.0)
    policy.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def policy(checkpoint: Path) -> torch.nn.Module:
    """The weights vLLM serves, as the trainer loads them."""
    return load_policy(checkpoint, dtype=torch.float32).to(DEVICE).eval()


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[VllmEngine]:
    from avrid.ppo.engines.vllm_engine import VllmEngine

    eng = VllmEngine(str(checkpoint), max_model_len=128, seed=0, dtype="float32",
                     gpu_memory_utilization=0.25, enforce_eager=True)
    try:
        yield eng
    finally:
        eng.close()


def test_agent_trainer_on_vllm_trains_on_the_episodes_with_the_trainers_logprobs() -> None:
    # First in the module: its policy rank builds a vLLM engine in this process, which
    # must be closed before the module's engine is built (and is, when the trainer closes).
    from avrid.agents import AgentTrainer
    from avrid.ppo.engines.vllm_engine import VllmEngine
    from tests.test_agents_calc import agent_config

    # tiny-agent with tiny-ppo-vllm's model shape (2 heads of 64) and engine.
    config = agent_config("rollout.engine=vllm", "model.hidden_size=128", "model.num_heads=2")
    with AgentTrainer(config) as trainer:
        trainer.start()
        assert VllmEngine._live  # the in-process policy rank built a real vLLM engine
        rows = [trainer.train_step(step) for step in range(2)]
    assert not VllmEngine._live  # and the trainer closed it
    for metrics, batch in rows:
        # fp32 on both sides: vLLM's log-probs of the policy tokens are the trainer's
        # (measured: max 4.8e-7 on CPU).
        assert metrics["rollout/logprob_gap_max"] < 1e-4, metrics["rollout/logprob_gap_max"]
        assert metrics["sync/engine_bytes"] > 0  # each step's weights went into vLLM
        assert torch.isfinite(torch.tensor(metrics["agent/turns"]))
        mask, versions = batch.packed["action_mask"], batch.packed["token_version"]
        assert torch.equal(mask.lengths, batch.response_lens)
        assert set(mask.values.tolist()) <= {0, 1} and int(mask.values.sum()) > 0
        assert set(versions.values[mask.values == 0].tolist()) <= {-1}
    # Step s's policy tokens were generated by the weights after s updates: the sync loaded
    # each step's weights into vLLM before it generated.
    for step, (_, batch) in enumerate(rows):
        mask, versions = batch.packed["action_mask"], batch.packed["token_version"]
        assert set(versions.values[mask.values == 1].tolist()) == {step}
    # The episodes did use the tool: observations sit between the policy's turns.
    assert any(int((b.packed["action_mask"].values == 0).sum()) > 0 for _, b in rows)


def check_tokens(traj: Trajectory, env: ScriptedEnv, engine: RecordingEngine) -> None:
    """Token-in/token-out: each policy turn is what the environment got, each observation
    what it returned, each policy token what the engine generated for the context before it
    (over one call or several segments), and the mask is 1 exactly on the policy's tokens."""
    assert list(traj.prompt) == env.prompt
    policy_turns = [s for s in traj.turns if s[0] == "policy"]
    observations = [s for s in traj.turns if s[0] == "observation"]
    assert [traj.ids[a:b] for _, a, b in policy_turns] == env.got
    shown = [o for o in env.returned if o]  # an empty observation adds no tokens
    assert [traj.ids[a:b] for _, a, b in observations] == shown[:len(observations)]
    if traj.done:
        assert len(observations) == len(shown)
    for _, start, end in policy_turns:
        pos = start
        while pos < end:
            # (identical contexts may have been sampled more than once: one of them)
            made = engine.seen[(*traj.prompt, *traj.ids[:pos])]
            take = next(k for c in made if (k := min(len(c.token_ids), end - pos))
                        and traj.ids[pos:pos + k] == list(c.token_ids[:k])
                        and traj.logp[pos:pos + k] == list(c.logprobs[:k]))
            pos += take
    expected = [0] * len(traj.ids)
    for _, a, b in policy_turns:
        expected[a:b] = [1] * (b - a)
    assert traj.action == expected
    assert traj.version == [0 if a else -1 for a in expected]
    assert all(lp == 0.0 for lp, a in zip(traj.logp, expected, strict=True) if not a)


@pytest.mark.parametrize("schedule, segment, temperature", [
    ("per_trajectory", None, 1.0), ("per_trajectory", 3, 0.7),
    ("turn_sync", None, 0.7), ("turn_sync", 3, 1.0),
])
def test_vllm_episodes_are_the_engines_tokens_and_the_trainer_scores_them_the_same(
        engine: VllmEngine, policy: torch.nn.Module, schedule: str, segment: int | None,
        temperature: float) -> None:
    recording = RecordingEngine(engine)
    envs = scripted_envs(8, seed=len(schedule) + (segment or 0), delays=True)
    params = SamplingParams(max_new_tokens=1, temperature=temperature, stop_token_ids=STOPS,
                            seed=11)
    trajs, stats = run_episodes(recording, envs, tokenizer=TOKENIZER, limits=LIMITS,
                                params=params, schedule=schedule, segment_tokens=segment)
    for env, traj in zip(envs, trajs, strict=True):
        check_tokens(traj, env, recording)
        assert traj.done != traj.truncated
    spans = [(t, a, b) for t in trajs for kind, a, b in t.turns if kind == "policy"]
    assert any(t.policy_turns > 1 for t in trajs)  # observations between policy turns
    # Both ways a turn ends were exercised: a stop token, and the turn's budget.
    ends = [t.ids[b - 1] in STOPS for t, _, b in spans]
    assert any(ends) and not all(ends)
    if segment:  # turns longer than a segment were generated over several engine calls
        assert any(b - a > segment for _, a, b in spans)
    assert stats.engine_calls >= max(t.policy_turns for t in trajs)
    # The batch's columns are the trajectories' own.
    packed, _ = trajectory_columns(trajs)
    for i, t in enumerate(trajs):
        assert packed["response"].row(i).tolist() == t.ids
        assert packed["action_mask"].row(i).tolist() == t.action
    # The trainer's log-probs of the policy's tokens (prompt, turns and observations as
    # context) = vLLM's. fp32 both sides: only the kernels' summation order differs.
    full = trainer_logprobs(policy, [t.prompt for t in trajs], [t.ids for t in trajs],
                            temperature=temperature, pad_id=PAD)
    worst = 0.0
    for t, logp in zip(trajs, full, strict=True):
        mask = torch.tensor(t.action, dtype=torch.bool, device=logp.device)
        vllm_logp = torch.tensor(t.logp, device=logp.device)
        worst = max(worst, float((logp[mask].float() - vllm_logp[mask]).abs().max()))
    print(f"{schedule} segment={segment} T={temperature}: max gap {worst:.1e}, "
          f"{stats.engine_calls} engine calls")
    assert worst < 1e-4, worst


def test_greedy_vllm_episodes_are_the_same_under_both_schedules(
        engine: VllmEngine, policy: torch.nn.Module) -> None:
    # Scheduling decides which episodes share a vLLM call, never what an episode is; and
    # greedy vLLM episodes are TorchEngine's on the same weights.
    params = SamplingParams(max_new_tokens=1, greedy=True, stop_token_ids=STOPS)
    runs = {}
    for schedule in ("per_trajectory", "turn_sync"):
        runs[schedule], _ = run_episodes(engine, scripted_envs(12, seed=5, delays=True),
                                         tokenizer=TOKENIZER, limits=LIMITS,
                                         params=params, schedule=schedule, tool_threads=4)
    torch_run, _ = run_episodes(TorchEngine(policy, pad_token_id=PAD),
                                scripted_envs(12, seed=5, delays=False),
                                tokenizer=TOKENIZER, limits=LIMITS, params=params,
                                schedule="turn_sync")
    a, b = runs["per_trajectory"], runs["turn_sync"]
    assert [t.ids for t in a] == [t.ids for t in b] == [t.ids for t in torch_run]
    assert [t.action for t in a] == [t.action for t in b] == [t.action for t in torch_run]
    assert sum(t.policy_turns for t in a) > len(a)  # multi-turn episodes among them
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(torch.tensor(x.logp), torch.tensor(y.logp), atol=1e-5, rtol=0)
