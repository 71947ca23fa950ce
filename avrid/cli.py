"""The `avrid` command: the entry point for learners and, from chapter 5 on, for training.

    avrid ppo               train: PPO on CPU with the default preset (the README's main job)
    avrid ppo --algo grpo   the same with GRPO;  --preset NAME, --set section.field=value ...
    avrid ppo --print-config  the config as YAML (`--print-config json`: as JSON), and
    avrid ppo --config FILE   a run of the config in that file (.yaml, .yml or .json)
    avrid ppo --help-config   every config field: its type, default and what it does
    avrid ppo --estimate-memory [--gpu-memory 80GB] [--gpus 8]  peak memory per GPU and phase
    (Ctrl-C, or a scheduler's SIGTERM, stops a run: exit 130 or 143 and how to resume it)
    avrid export SRC DEST   a checkpoint's policy in Hugging Face format (SRC: a run directory
                            for its latest checkpoint, a checkpoints/ root or a step directory;
                            a LoRA run: DEST/adapter, the PEFT adapter, DEST/base, the base it
                            names, and with --merged DEST/merged, the merged model)
    avrid chapters          list the chapters and how to run each demo
    avrid demo ch01         run a chapter's demo (same as `python -m chapters.ch01_workers`)
    avrid demo all          run every chapter's demo in order
    avrid --version         the installed version of avrid

Where `avrid ppo`'s config comes from, each step overriding the one before (`PPO_SOURCES`):
a preset (--preset, default tiny-ppo) or a config file (--config; a whole config, so not
both), then the flags (--algo, --steps, --seed, --out, --backend, --address, --task,
--resume), then each --set in order; ``--resume --out DIR`` without --preset or --config
starts from the config that DIR's run recorded in its checkpoint.

It sits above every layer and holds no logic of its own: training is `avrid.pipeline.train`
(chapter 5's `avrid.ppo.driver.run.train` with the trainer of `pipeline.mode`), exporting is
`avrid.ppo.outputs.export.export_checkpoint`, each demo lives in its chapter package.
Chapters are run from the source checkout, so `demo` needs the repository that avrid was
installed from (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from avrid.workers.errors import PlacementError, WorkerError

if TYPE_CHECKING:  # annotations only: the command imports avrid.ppo when it runs
    from avrid.ppo.setup.config import PPOConfig

USER_ERRORS = (ValueError, TypeError, OSError, ImportError, PlacementError, WorkerError)
"""What `avrid ppo` reports in one line: bad config or input, files, placement, and a
worker's failure (its role, rank, method and message). Anything else is a bug in avrid and
keeps its traceback."""

ALGOS = ("ppo", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""`--algo`'s choices: the built-in estimators of `avrid/ppo/algo/registry.py`, written out
here so that `avrid --help` needs no torch (tests/test_cli_config.py keeps them equal)."""

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


PPO_SOURCES = """\
where the config comes from, each step overriding the one before:
  1. --preset NAME (default tiny-ppo), or --config FILE: a whole config (not both);
     with --resume --out DIR and neither: the config DIR's run recorded (state.json)
  2. the flags --algo --steps --seed --out --backend --address --task --resume
  3. --set section.field=value, in the order given

  avrid ppo --print-config > run.yaml     the config (after all three) as YAML, or
                                          --print-config json; edit it, then
  avrid ppo --config run.yaml --steps 20  run it; a field the file leaves out takes its default
  avrid ppo --help-config [SECTION]       every field: its type, default and what it does"""
"""The end of `avrid ppo --help`: the order in which a config is assembled."""


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
    ppo = sub.add_parser("ppo", help="train with PPO or GRPO (default: tiny PPO on CPU)",
                         epilog=PPO_SOURCES, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Only `avrid ppo` lists the presets: reading them imports torch (~2 s; the run needs it
    # anyway), which `avrid chapters` or `avrid --version` should not wait for.
    words = sys.argv[1:] if argv is None else argv
    ppo.add_argument("--preset", help=_preset_help() if words[:1] == ["ppo"] else "a preset")
    ppo.add_argument("--config", metavar="FILE", help="a whole config from a .yaml/.yml/.json "
                     "file (as --print-config writes it); instead of --preset")
    ppo.add_argument("--algo", choices=ALGOS, help="override algo.name (your own estimator: "
                     "--set algo.name=module:function)")
    ppo.add_argument("--steps", type=int, help="override train.steps")
    ppo.add_argument("--seed", type=int, help="override train.seed")
    ppo.add_argument("--out", help="override train.out_dir")
    ppo.add_argument("--backend", choices=("ray", "inprocess"), help="placement.backend")
    ppo.add_argument("--address", help="join this Ray cluster: auto (the one `ray start` "
                     "runs here) or HOST:PORT; placement.ray_address (default: RAY_ADDRESS, "
                     "else a local Ray)")
    ppo.add_argument("--task", help="task name, e.g. digits, gsm8k, my_module:make_task")
    ppo.add_argument("--resume", action="store_true", help="continue the run in --out from "
                     "its last checkpoint, with its own config (or --preset's, --config's)")
    ppo.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="SECTION.FIELD=VALUE", help="any config field; repeatable")
    ppo.add_argument("--print-config", nargs="?", const="yaml", choices=("yaml", "json"),
                     help="print the config (YAML, or json) and exit; --config reads it back")
    ppo.add_argument("--help-config", nargs="?", const="", metavar="SECTION",
                     help="list every config field (or SECTION's): type, default, meaning")
    ppo.add_argument("--estimate-memory", action="store_true",
                     help="print the predicted peak memory per GPU and phase of the config "
                     "and whether it fits, then exit (no Ray, no model, no GPU needed)")
    ppo.add_argument("--gpu-memory", type=_gpu_memory, metavar="SIZE",
                     help="one GPU's memory for --estimate-memory: 80GB (default; GB = GiB, "
                     "as GPU makers count), 80GiB, 80, 40000MiB")
    ppo.add_argument("--gpus", type=_gpu_count, metavar="N",
                     help="how many GPUs there are, for --estimate-memory: the layout must "
                     "fit in N and a suggested one uses at most N (default: one node of 8)")
    export = sub.add_parser("export", help="write a checkpoint's policy in Hugging Face format")
    export.add_argument("source", help="a run directory (its latest checkpoint), a checkpoints/ "
                        "root or a step directory")
    export.add_argument("dest", help="the directory to write (must not exist, or be empty)")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty DEST")
    export.add_argument("--merged", action="store_true", help="a LoRA run: write the merged "
                        "model too, in DEST/merged, beside DEST/adapter and its DEST/base")
    # Errors are one line; --debug shows the traceback (and, for ppo, vLLM's own log lines).
    ppo.add_argument("--debug", action="store_true", help="show vLLM's own log lines, and on "
                     "an error the full traceback (or AVRID_DEBUG=1)")
    export.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback (or AVRID_DEBUG=1)")
    args = parser.parse_args(argv)

    if args.command == "ppo":
        _ppo(args)
        return
    if args.command == "export":
        _export(args)
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


PPO_NEEDS = {"torch": "torch", "ray": "ray", "transformers": "transformers",
             "safetensors": "safetensors", "tqdm": "tqdm", "matplotlib": "matplotlib",
             "yaml": "pyyaml"}
"""What `avrid ppo` and `avrid export` import (import name: the name pip installs)."""


def _need_ppo_extra(command: str) -> None:
    """`pip install avrid` alone has no torch, Ray or models: name what to add, in one line."""
    missing = [dist for mod, dist in PPO_NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        print(f"{command} needs {', '.join(missing)}: pip install 'avrid[ppo]'", file=sys.stderr)
        sys.exit(2)


def _ppo(args: argparse.Namespace) -> None:
    """Build the config from preset or file, flags, then --set (validated once); train."""
    _need_ppo_extra("avrid ppo")
    from avrid.agents import train
    from avrid.ppo.driver.stopping import StopSignals
    from avrid.ppo.setup.config_file import dump_config
    from avrid.ppo.setup.field_help import help_config
    from avrid.ppo.setup.overrides import with_overrides

    if args.help_config is not None:
        try:
            print(help_config(args.help_config or None), end="")
        except ValueError as e:
            _fail("avrid ppo", e, debug=args.debug)
        return
    sets = []
    for flag, field in (("algo", "algo.name"), ("steps", "train.steps"),
                        ("seed", "train.seed"), ("out", "train.out_dir"),
                        ("backend", "placement.backend"), ("task", "task.name"),
                        ("address", "placement.ray_address")):
        if getattr(args, flag) is not None:
            sets.append(f"{field}={getattr(args, flag)}")
    if args.task is not None:
        sets.append("task.options=")  # the preset's options belong to the preset's task
    if args.resume:
        sets.append("train.resume=true")
    if args.backend == "inprocess":  # threads cannot form an FSDP group: one rank per role
        sets += ["placement.actor_dp=1", "placement.critic_dp=1"]
    # A custom task module (`--task my_tasks:make_task`) is looked up from where you run the
    # command, by the driver and by every Ray worker process (hence PYTHONPATH too).
    sys.path.insert(0, os.getcwd())
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    try:  # a --set comes after the flags' assignments, so it wins over them
        config = with_overrides(_first_config(args), sets + args.overrides)
    except (ValueError, TypeError, OSError) as e:  # OSError: a --config file not readable
        _fail("avrid ppo", e, debug=args.debug)
    if args.print_config is not None:
        print(dump_config(config, args.print_config), end="")
        return
    if args.estimate_memory:
        from avrid.ppo.setup.memory_report import report

        try:
            print(report(config, args.gpu_memory or 80 << 30, gpus=args.gpus,
                         label=args.config or f"preset {args.preset or 'tiny-ppo'}"), end="")
        except (ValueError, OSError) as e:  # an unknown model shape, an unreadable config.json
            _fail("avrid ppo --estimate-memory", e, debug=args.debug)
        return
    if args.gpu_memory is not None or args.gpus is not None:
        flag = "--gpu-memory sizes" if args.gpu_memory is not None else "--gpus counts"
        _fail("avrid ppo", ValueError(f"{flag} the GPUs of --estimate-memory; "
                                      "add --estimate-memory"), debug=args.debug)
    ray_was_running, debug_was = _ray_running(), os.environ.get("AVRID_DEBUG")
    if args.debug:  # the workers read it too (vllm_logs.py): vLLM's own lines then show
        os.environ["AVRID_DEBUG"] = "1"
    # Ctrl-C and a scheduler's SIGTERM stop the run alike (stopping.py); a later one waits for
    # the cleanup, which includes shutting down the Ray this command started.
    with StopSignals() as stop:
        try:
            summary = train(config, log=print)
        except USER_ERRORS as e:
            _fail("avrid ppo", e, debug=args.debug)
        except KeyboardInterrupt:
            # The trainer has already stopped its workers; the checkpoints on disk are whole.
            signum = stop.signum or signal.SIGINT
            by = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
            print(f"\navrid ppo: interrupted{by}; {_after_interrupt(config.train.out_dir)}",
                  file=sys.stderr)
            sys.exit(128 + signum)  # 130 after Ctrl-C, 143 after SIGTERM
        else:
            if not summary.already_complete:  # if it is, `train` said so in one line
                line = summary.finished_line(config.algo.name, lora=config.lora.enabled)
                print(f"avrid ppo: {line}", flush=True)
        finally:
            stop.ignore()
            if not ray_was_running:  # now, not at exit: no signal may cut Ray's shutdown short
                _stop_ray()
            if debug_was is None:  # as it was: `main()` called from Python (tests) leaks nothing
                os.environ.pop("AVRID_DEBUG", None)
            else:
                os.environ["AVRID_DEBUG"] = debug_was


def _gpu_memory(text: str) -> int:
    """--gpu-memory's value in bytes; a bad one is argparse's usage error (exit 2)."""
    from avrid.ppo.setup.memory_report import parse_gpu_memory

    try:
        return parse_gpu_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--gpu-memory: ")) from None


def _gpu_count(text: str) -> int:
    """--gpus's value: a whole number >= 1; anything else is argparse's usage error."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU count; allowed: a whole "
                                         f"number >= 1, e.g. 8")
    return int(text)


def _preset_help() -> str:
    """--preset's help: every name in `PRESETS`, the default first."""
    try:
        from avrid.ppo.setup.presets import PRESETS
    except ImportError:  # the core install: `avrid ppo` will name the extra it needs
        return "a preset of `pip install 'avrid[ppo]'`"
    names = [name if name != "tiny-ppo" else "tiny-ppo (default)" for name in PRESETS]
    return "one of " + ", ".join(names)


def _first_config(args: argparse.Namespace) -> PPOConfig:
    """Where a config starts: --config, --preset, a resumed run's own, or tiny-ppo."""
    from avrid.ppo.driver.saving import saved_config
    from avrid.ppo.setup.config_file import read_config
    from avrid.ppo.setup.presets import preset

    if args.config is not None:
        if args.preset is not None:
            raise ValueError(f"--preset {args.preset} and --config {args.config} both give a "
                             f"whole config; use one (a file leaves nothing to a preset: "
                             f"write one from a preset with --preset NAME --print-config)")
        return read_config(args.config)
    if args.resume and args.preset is None and args.out and (saved := saved_config(args.out)):
        return saved  # (None: no checkpoint there; the resume then refuses, saying why)
    name = args.preset or "tiny-ppo"
    if args.algo not in (None, "ppo") and name == "tiny-ppo":
        name = "tiny-grpo"  # the default run's critic-free twin (its lr, its own out_dir)
    return preset(name)


def _ray_running() -> bool:
    """Whether this process is connected to Ray (imported only if something imported it)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _stop_ray() -> None:
    """Shut down the Ray this command started (Ray would do it at exit, where a second Ctrl-C
    interrupts it: a traceback, and its agents left running for minutes)."""
    if _ray_running():
        sys.modules["ray"].shutdown()


def _after_interrupt(out_dir: str) -> str:
    """What an interrupted run can do next: resume from its last checkpoint, if it has one."""
    from avrid.ppo.outputs.checkpoint import latest_checkpoint

    try:
        latest = latest_checkpoint(Path(out_dir) / "checkpoints")
    except (OSError, ValueError):  # a damaged pointer: `--resume` will say what to do
        latest = None
    if latest is None:
        return (f"no checkpoint was written yet, so there is nothing to resume; start again "
                f"with another (or an emptied) --out than {out_dir}")
    return (f"the last checkpoint is {latest}; continue with `avrid ppo --resume --out "
            f"{out_dir}` (the run's own config is read from its checkpoint)")


def _fail(command: str, error: BaseException, *, debug: bool) -> NoReturn:
    """Report an error a user can act on in one line (exit status 2), or, with --debug (or
    AVRID_DEBUG=1), raise it again so the whole traceback shows."""
    if debug or os.environ.get("AVRID_DEBUG", "") not in ("", "0"):
        raise error
    # A worker's failure carries the remote traceback: its headline names role, rank, method
    # and the remote exception; the full text is one --debug away.
    text = getattr(error, "headline", None) or str(error).strip() or type(error).__name__
    first = text.splitlines()[0] if text else type(error).__name__
    hint = " (run with --debug for the traceback)" if not isinstance(error, ValueError) else ""
    print(f"{command}: {first}{hint}", file=sys.stderr)
    sys.exit(2)


def _export(args: argparse.Namespace) -> None:
    """Export a checkpoint; bad input is one line naming what is wrong, exit status 2."""
    _need_ppo_extra("avrid export")
    from avrid.ppo.outputs.export import export_checkpoint

    try:
        done = export_checkpoint(args.source, args.dest, overwrite=args.overwrite,
                                 merged=args.merged)
    except (ValueError, OSError) as e:  # not a checkpoint, destination taken, files gone
        _fail("avrid export", e, debug=args.debug)
    print(f"avrid export: step {done.step} of {done.checkpoint} -> {done.dest}/ "
          f"({', '.join(done.files)})")


if __name__ == "__main__":
    main()
