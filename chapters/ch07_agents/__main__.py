"""Chapter 7 demo — multi-turn episodes: tools in a sandbox, the trajectory in tokens, the
schedule, and chapter 5's trainer on episodes.

Run it with ``python -m chapters.ch07_agents`` (CPU only; under a minute on a 2-core machine,
in one process, no Ray). It reads top to bottom:

1. the sandbox: tool calls that work, loop forever, allocate without bound, try the
   network, append to the Python runtime, read a file of yours, kill this process, and
   crash; each comes back as an observation, and nothing of the child is left running
   (namespaces: on a machine without them, the weaker process backend, said so);
2. calc episodes ("48*7=[" -> "48*7]" -> "336;" -> ...) of the tiny random policy through
   the episode loop, turns generated in segments while new weights arrive every two engine
   calls (a partial rollout); one trajectory printed token by token with its action mask
   and the version of each token, and every recorded log-prob checked against the weights
   of its version;
3. the same episodes with tools of 0-200 ms, scheduled per trajectory and turn by turn:
   the engine's busy share side by side;
4. a few steps of `AgentTrainer` (chapter 5's loop on episodes, preset ``tiny-agent``, in
   process): its agent/* metrics, the batch's mask and versions, advantages on action
   tokens only;
5. the checks, and the chapter's picture in ``outputs/ch07/agents.png``.

It exits 0 when every check passes and 1 otherwise. The tiny model does not learn the task
in these few steps (the preset's 650 steps take it part of the way: the chapter README):
the demo shows the machinery, not a learning curve.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from avrid.agents import AgentTrainer
from avrid.agents.env import EpisodeLimits
from avrid.agents.episodes import run_episodes
from avrid.agents.sandbox import (
    Sandbox,
    SandboxUnavailable,
    ToolLimits,
    make_sandbox,
    run_python,
)
from avrid.agents.trajectory import Trajectory
from avrid.agents.worker import agent_task
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy, tiny_spec
from avrid.ppo.engines.torch_engine import SamplingParams, TorchEngine
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.tokenizer import make_tokenizer
from chapters.ch07_agents.figure import save_agents_figure
from chapters.ch07_agents.workloads import (
    IdTokenizer,
    NewWeightsEvery,
    SleepyToolEnv,
    TimedEngine,
    behaviour_gap,
    glyphs,
    show_trajectory,
)

OUT = Path("outputs/ch07")
EPISODES = 32
SECRET = (OUT / "secret.txt").resolve()
TOOLS = {  # what the policy might write, and how it must end
    "prints": ("print(6 * 7)", "ok"),
    "loops forever": ("while True:\n    pass", "timeout"),
    "memory bomb": ("x = bytearray(4 << 30)", "memory"),
    "network": ("import socket\nsocket.create_connection(('1.1.1.1', 80))", "denied"),
    "writes runtime": ("import os\nopen(os.__file__, 'a').write('# pwned')", "denied"),
    "reads your file": (f"print(open({str(SECRET)!r}).read())", "error"),
    "kills trainer": (f"import os\nos.kill({os.getpid()}, 9)", "error"),
    "crashes": ("1 / 0", "error"),
}
UNSAFE_IN_PROCESS = ("reads your file", "kills trainer")
"""What the process backend (no boundary) would let happen: the demo skips them there."""
SMALL = ["placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
         "train.prompts_per_step=4", "algo.responses_per_prompt=4",
         "train.mini_batch_size=16", "train.val_prompts=8", "train.progress=false",
         f"train.out_dir={OUT / 'run'}"]


Check = tuple[str, bool]
"""One claim the demo verified, and whether it held."""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def sandbox() -> list[Check]:
    chosen: Sandbox = make_sandbox("namespaces")
    try:
        chosen.check()
        print("1. the sandbox: each call in its own namespaces (bubblewrap), 256 MiB, the "
              "loop's wall 1 s")
    except SandboxUnavailable as e:  # e.g. macOS: say so, and show the weaker backend
        print(f"1. the sandbox: namespaces unavailable here ({e});\n   the process backend "
              f"instead (NOT a boundary: the calls it would let through are skipped)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            chosen = make_sandbox("process")
    SECRET.parent.mkdir(parents=True, exist_ok=True)
    SECRET.write_text("the answer key: 42")
    oks = []
    for what, (code, expected) in TOOLS.items():
        if chosen.name == "process" and what in UNSAFE_IN_PROCESS:
            continue
        # 1 s for the loop; the others get 5 s, so a loaded machine's slow start of the
        # child never reads as a timeout
        wall = 1.0 if expected == "timeout" else 5.0
        r = run_python(code, ToolLimits(wall_s=wall, memory_mb=256), sandbox=chosen)
        print(f"  {what:<16} {r.status:<7} {r.seconds:4.1f} s  {r.observation().strip()!r}")
        oks.append(r.status == expected and not alive(r.pid))
    return [("every tool call ended as expected and left no process (os.kill(pid, 0) "
             "raises ProcessLookupError)", all(oks)),
            ("the runtime file the tool appended to is unchanged",
             not open(os.__file__).read().endswith("# pwned"))]


def calc_episodes() -> tuple[list[Trajectory], Callable[[int], str], list[Check]]:
    print("\n2. calc episodes, turns in segments of 2 tokens, new weights every 2 engine calls")
    config = preset("tiny-agent")
    task = agent_task(config)
    tok = make_tokenizer(config, task)
    spec = tiny_spec(config, tok.vocab_size)

    def model(version: int):  # noqa: ANN202 - a transformers model
        return build_tiny_policy(spec, seed=version, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)

    engine = TorchEngine(model(0), pad_token_id=tok.pad_token_id)
    weights = NewWeightsEvery(engine, model, every=2)
    prompts = task.train_prompts()[:12]
    params = SamplingParams(max_new_tokens=1, seed=3, stop_token_ids=(
        tok.eos_token_id, *tok.encode(task.turn_stops)))
    # turn_sync: which episodes share a call (so the samples) does not depend on timing,
    # and the printout is the same on every run
    trajs, stats = run_episodes(engine, [task.make_env(p) for p in prompts], tokenizer=tok,
                                limits=task.limits, params=params, prompts=prompts,
                                schedule="turn_sync", segment_tokens=2, weights=weights)
    shown = max(trajs, key=lambda t: (t.tool_calls > 0, len(set(t.version)), -len(t.ids)))
    print(f"  {stats.engine_calls} engine calls at versions {stats.versions}")
    glyph = glyphs(tok)
    print("  " + show_trajectory(shown, glyph).replace("\n", "\n  "))
    print(f"  reward {shown.reward:.2f}, tool calls {shown.tool_calls}, oldest version "
          f"{shown.oldest_version()}, staleness at version {weights.version}: "
          f"{weights.version - shown.oldest_version()}")
    for t in trajs:
        turns = " | ".join(f"{'obs ' if k == 'observation' else ''}"
                           f"{''.join(map(glyph, t.ids[a:b]))}" for k, a, b in t.turns)
        print(f"  {''.join(map(glyph, t.prompt)):<7} {turns}  -> reward {t.reward:.2f}")
    gap = max(behaviour_gap(t, weights.models) for t in trajs)
    obs_ok = all((a == 0) == (v == -1) and (a == 1 or lp == 0.0) for t in trajs
                 for a, v, lp in zip(t.action, t.version, t.logp, strict=True))
    policy = [[v for v, a in zip(t.version, t.action, strict=True) if a] for t in trajs]
    spans = sum(len({t.version[i] for i in range(a, b)}) > 1 for t in trajs
                for k, a, b in t.turns if k == "policy")
    print(f"  policy turns spanning several versions: {spans}; largest |recorded log-prob - "
          f"log-prob under its version's weights|: {gap:.1e}")
    return trajs, glyph, [
        ("observation tokens: action 0, version -1, log-prob 0; policy tokens: action 1",
         obs_ok),
        ("each policy token's log-prob is its own version's (gap < 1e-4), across weight "
         "updates inside a turn", gap < 1e-4 and spans > 0),
        ("versions never decrease along a trajectory", all(v == sorted(v) for v in policy))]


def schedules() -> tuple[dict[str, tuple[list, float]], list[Check]]:
    print(f"\n3. {EPISODES} episodes x 4 turns x 32 tokens, tools sleeping 0-200 ms")
    threads = torch.get_num_threads()
    # One intra-op thread, as benchmarks/agent_schedule.py runs it: on a shared 2-core
    # machine two OpenMP threads stall each other whenever another process runs.
    torch.set_num_threads(1)
    engine = TimedEngine(TorchEngine(build_tiny_policy(
        TinyModelSpec(vocab_size=17, max_positions=160), seed=0), pad_token_id=0))
    limits = EpisodeLimits(max_turns=4, turn_tokens=32, max_tokens=4 * 35)
    params = SamplingParams(max_new_tokens=1, greedy=True)  # no stops: 32 tokens a turn
    engine.generate([[2] * 6] * EPISODES, SamplingParams(max_new_tokens=32))  # warm-up
    made, drawn = {}, {}
    for schedule in ("per_trajectory", "turn_sync"):
        engine.reset()
        trajs, stats = run_episodes(engine, [SleepyToolEnv(i, turns=4) for i in range(EPISODES)],
                                    tokenizer=IdTokenizer(), limits=limits, params=params,
                                    schedule=schedule, tool_threads=EPISODES)
        made[schedule], drawn[schedule] = trajs, (engine.calls, stats.wall_s)
        tokens = sum(sum(t.action) for t in trajs)
        print(f"  {schedule:<15} wall {stats.wall_s:.2f} s, engine busy {stats.busy_s:.2f} s "
              f"= {stats.busy_share:.0%} in {stats.engine_calls:>2} calls, "
              f"{tokens / stats.wall_s:,.0f} policy tokens/s")
    torch.set_num_threads(threads)
    share = {s: sum(end - start for start, end in calls) / wall
             for s, (calls, wall) in drawn.items()}
    print(f"  busy share per_trajectory / turn_sync: "
          f"{share['per_trajectory'] / share['turn_sync']:.2f}x")
    a, b = made["per_trajectory"], made["turn_sync"]
    return drawn, [
        ("both schedules made the same episodes (greedy: same ids and masks)",
         [(t.ids, t.action) for t in a] == [(t.ids, t.action) for t in b]),
        ("per-trajectory scheduling kept the engine busier than turn_sync",
         share["per_trajectory"] > share["turn_sync"])]


def trainer_steps() -> list[Check]:
    print("\n4. AgentTrainer: preset tiny-agent, in process, 4 prompts x 4 episodes a step")
    keys = ("train/reward", "agent/turns", "agent/tool_calls", "agent/tool_errors",
            "agent/action_share", "rollout/logprob_gap_max")
    print("  step" + "".join(f"{k.split('/')[1]:>18}" for k in keys))
    oks = []
    with AgentTrainer(with_overrides(preset("tiny-agent"), SMALL)) as trainer:
        trainer.start()
        for step in range(4):
            metrics, batch = trainer.train_step(step)
            print(f"  {step:>4}" + "".join(f"{metrics[k]:>18.4f}" for k in keys))
            mask = batch.packed["action_mask"].values
            versions = batch.packed["token_version"].values
            advantages = batch.packed["advantages"].values
            oks.append(set(versions[mask == 1].tolist()) == {step}
                       and set(versions[mask == 0].tolist()) <= {-1}
                       and bool((advantages[mask == 0] == 0).all())
                       and metrics["rollout/logprob_gap_max"] < 1e-4)
        val = trainer.validate()
    print(f"  validation: reward {val['val/reward']:.3f}, tool calls per episode "
          f"{val['val/tool_calls']:.2f} (not learned in 4 steps)")
    return [("every step: policy tokens at the step's version, observations at -1, no "
             "advantage on observation tokens, trainer log-probs = the engine's", all(oks))]


def main() -> int:
    start = time.monotonic()
    checks = sandbox()
    trajs, glyph, more = calc_episodes()
    drawn, most = schedules()
    checks += more + most + trainer_steps()
    path = save_agents_figure(drawn, trajs, OUT / "agents.png", glyph=glyph,
                              title="chapter 7: when the engine works, and what trains")
    print(f"\n5. checks ({time.monotonic() - start:.0f} s so far); the picture: {path}")
    checks.append(("the picture was written", path.stat().st_size > 0))
    for label, ok in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    ok = all(ok for _, ok in checks)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
