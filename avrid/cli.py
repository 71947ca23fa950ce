"""The `avrid` command: the entry point for learners and, from chapter 5 on, for training.

    avrid chapters          list the chapters and how to run each demo
    avrid demo ch01         run a chapter's demo (same as `python -m chapters.ch01_workers`)
    avrid demo all          run every chapter's demo in order (the README's main job for now)

It sits above every layer (it will also start PPO runs) and holds no logic of its own: each
demo lives in its chapter package. Chapters are run from the source checkout, so this command
needs the repository that avrid was installed from (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

# (package under chapters/, video topic) — one line per chapter that exists so far.
CHAPTERS: tuple[tuple[str, str], ...] = (
    ("ch01_workers", "Ray basics, worker identity, the mesh and placement groups"),
    ("ch02_dispatch", "token-aware dispatch: balanced shards, token-budget micro-batches"),
    ("ch03_results", "canonical results, exact metric merge, the worker timeline"),
    ("ch04_resharding", "resharding: FSDP shards to TP slices, minimum bytes, fingerprints"),
)


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
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("chapters", help="list the chapters")
    demo = sub.add_parser("demo", help="run a chapter's demo on CPU")
    demo.add_argument("chapter", help="e.g. ch01, ch01_workers, or all")
    args = parser.parse_args(argv)

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
