"""The `avrid` command: the entry point for learners and, from chapter 5 on, for training.

    avrid ppo               train: PPO on CPU with the default preset (the README's main job)
    avrid ppo --algo grpo   the same with GRPO;  --preset NAME, --set section.field=value ...
    avrid ppo --print-config  the config as YAML (`--print-config json`: as JSON), and
    avrid ppo --config FILE   a run of the config in that file (.yaml, .yml or .json)
    avrid ppo --help-config   every config field: its type, default and what it does
    avrid ppo --estimate-memory [--gpu-memory 80GB] [--gpus 8]  peak memory per GPU and phase
    avrid ppo --print-graph [FILE.png]  the step's phases, what each waits for (and drawn)
    (Ctrl-C, or a scheduler's SIGTERM, stops a run: exit 130 or 143 and how to resume it)
    avrid export SRC DEST   a checkpoint's policy in Hugging Face format (SRC: a run directory
                            for its latest checkpoint, a checkpoints/ root or a step directory;
                            a LoRA run: DEST/adapter, the PEFT adapter, DEST/base, the base it
                            names, and with --merged DEST/merged, the merged model)
    avrid eval TARGET       evaluate a run's latest checkpoint, a step directory or an export
                            (`avrid eval --initial`: the model before training): greedy and
                            sampled pass@k, mean reward, response lengths -> eval.jsonl and
                            eval_summary.json, by default in RUN/eval/step_N/
    avrid chapters          list the chapters and how to run each demo
    avrid demo ch01         run a chapter's demo (same as `python -m chapters.ch01_workers`)
    avrid demo all          run every chapter's demo in order
    avrid --version         the installed version of avrid

It sits above every layer and holds no logic of its own: each subcommand that runs the
library is a file of `avrid.commands` (`ppo.py`: where a config comes from, `PPO_SOURCES`;
`export.py`; `eval.py`), which parses its arguments and calls one library function; each
demo lives in its chapter package. Chapters are run from the source checkout, so `demo`
needs the repository that avrid was installed from (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from avrid.commands import eval as evaluate
from avrid.commands import export, ppo
from avrid.commands.ppo import ALGOS

__all__ = ["ALGOS", "CHAPTERS", "main"]

# (package under chapters/, video topic) — one line per chapter that exists so far.
CHAPTERS: tuple[tuple[str, str], ...] = (
    ("ch01_workers", "Ray basics, worker identity, the mesh and placement groups"),
    ("ch02_dispatch", "token-aware dispatch: balanced shards, token-budget micro-batches"),
    ("ch03_results", "canonical results, exact metric merge, the worker timeline"),
    ("ch04_resharding", "resharding: FSDP shards to TP slices, minimum bytes, fingerprints"),
    ("ch05_ppo", "the PPO/GRPO loop: roles, RL math, rollouts, weight sync, checkpoints"),
    ("ch06_async", "asynchronous RL: one-step-off, bounded staleness, off-policy correction"),
    ("ch07_agents", "multi-turn agents: tools in a sandbox, token-in/token-out, action masks"),
)


def _version() -> str:
    """avrid's installed version, from the package metadata (pyproject.toml's version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("avrid")
    except PackageNotFoundError:  # run from a checkout that was never `pip install`ed
        return "unknown (not installed)"


def _checkout_root() -> Path:
    root = Path(__file__).resolve().parents[1]
    if not (root / "chapters").is_dir():
        sys.exit(f"avrid: the chapters live in the source checkout, not found next to {root}; "
                 f"clone the repository and run `pip install -e .` there")
    return root


def _resolve(name: str) -> list[str]:
    if name == "all":
        return [pkg for pkg, _ in CHAPTERS]
    matches = [pkg for pkg, _ in CHAPTERS if pkg == name or pkg.split("_")[0] == name]
    if not matches:
        known = ", ".join(pkg for pkg, _ in CHAPTERS)
        print(f"avrid: unknown chapter {name!r}; known: {known} (or 'all')", file=sys.stderr)
        sys.exit(2)
    return matches


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run the command."""
    parser = argparse.ArgumentParser(prog="avrid", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"avrid {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("chapters", help="list the chapters")
    demo = sub.add_parser("demo", help="run a chapter's demo on CPU")
    demo.add_argument("chapter", help="e.g. ch01, ch01_workers, or all")
    ppo.add_parser(sub, sys.argv[1:] if argv is None else argv)
    export.add_parser(sub)
    evaluate.add_parser(sub)
    args = parser.parse_args(argv)

    if args.command == "ppo":
        ppo.run(args)
        return
    if args.command == "export":
        export.run(args)
        return
    if args.command == "eval":
        evaluate.run(args)
        return

    if args.command == "chapters":
        for pkg, topic in CHAPTERS:
            print(f"{pkg:<16} {topic}\n{'':<16} demo: python -m chapters.{pkg}  "
                  f"notebook: notebooks/{pkg[2:4]}_{pkg.split('_', 1)[1]}.ipynb")
        return
    packages = _resolve(args.chapter)
    root = str(_checkout_root())
    sys.path.insert(0, root)
    # Ray workers are new processes: they find `chapters.*` through PYTHONPATH, not sys.path.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    for pkg in packages:
        print(f"=== chapters.{pkg} ===", flush=True)
        try:
            runpy.run_module(f"chapters.{pkg}", run_name="__main__", alter_sys=True)
        except SystemExit as done:  # a demo's `raise SystemExit(main())` must not end the loop
            if done.code not in (None, 0):
                raise


if __name__ == "__main__":
    main()
