"""`avrid ppo`: train with PPO or GRPO, or print, explain or size a config, or draw its step.

Where the config comes from, each step overriding the one before (`PPO_SOURCES`): a preset
(--preset, default tiny-ppo) or a config file (--config; a whole config, so not both), then
the flags (--algo, --steps, --seed, --out, --backend, --address, --task, --resume), then each
--set in order; ``--resume --out DIR`` without --preset or --config starts from the config
that DIR's run recorded in its checkpoint.

Training is `avrid.agents.train` (chapter 5's `avrid.ppo.driver.run.train` with the trainer
of `pipeline.mode`); this file parses the command, assembles the config, and turns a user's
error, Ctrl-C or SIGTERM into one line and an exit status.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from avrid.commands.common import (
    USER_ERRORS,
    fail,
    import_from_cwd,
    need_ppo_extra,
    ray_running,
    stop_ray,
)

if TYPE_CHECKING:  # annotations only: the command imports avrid.ppo when it runs
    from avrid.ppo.setup.config import PPOConfig

ALGOS = ("ppo", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""`--algo`'s choices: the built-in estimators of `avrid/ppo/algo/registry.py`, written out
here so that `avrid --help` needs no torch (tests/test_cli_config.py keeps them equal)."""


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



def add_parser(sub: argparse._SubParsersAction, words: list[str]) -> None:
    """Add `avrid ppo` and its arguments to the `avrid` parser's subcommands `sub`;
    `words`: the command line (the presets are listed only for `avrid ppo`)."""
    ppo = sub.add_parser("ppo", help="train with PPO or GRPO (default: tiny PPO on CPU)",
                         epilog=PPO_SOURCES, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Only `avrid ppo` lists the presets: reading them imports torch (~2 s; the run needs it
    # anyway), which `avrid chapters` or `avrid --version` should not wait for.
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
    ppo.add_argument("--print-graph", nargs="?", const="", metavar="FILE",
                     help="print the step as a graph (each phase: its worker group, the "
                     "columns it reads and writes, what it waits for) and exit, starting "
                     "nothing; FILE (.png, .pdf, .svg): draw it there too")
    ppo.add_argument("--estimate-memory", action="store_true",
                     help="print the predicted peak memory per GPU and phase of the config "
                     "and whether it fits, then exit (no Ray, no model, no GPU needed)")
    ppo.add_argument("--gpu-memory", type=_gpu_memory, metavar="SIZE",
                     help="one GPU's memory for --estimate-memory: 80GB (default; GB = GiB, "
                     "as GPU makers count), 80GiB, 80, 40000MiB")
    ppo.add_argument("--gpus", type=_gpu_count, metavar="N",
                     help="how many GPUs there are, for --estimate-memory: the layout must "
                     "fit in N and a suggested one uses at most N (default: one node of 8)")
    # Errors are one line; --debug shows the traceback (and, for ppo, vLLM's own log lines).
    ppo.add_argument("--debug", action="store_true", help="show vLLM's own log lines, and on "
                     "an error the full traceback (or AVRID_DEBUG=1)")


def run(args: argparse.Namespace) -> None:
    """Build the config from preset or file, flags, then --set (validated once); train."""
    need_ppo_extra("avrid ppo")
    from avrid.agents import train
    from avrid.ppo.driver.stopping import StopSignals
    from avrid.ppo.setup.config_file import dump_config
    from avrid.ppo.setup.field_help import help_config
    from avrid.ppo.setup.overrides import with_overrides

    if args.help_config is not None:
        try:
            print(help_config(args.help_config or None), end="")
        except ValueError as e:
            fail("avrid ppo", e, debug=args.debug)
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
    import_from_cwd()
    try:  # a --set comes after the flags' assignments, so it wins over them
        config = with_overrides(first_config(args), sets + args.overrides)
    except (ValueError, TypeError, OSError) as e:  # OSError: a --config file not readable
        fail("avrid ppo", e, debug=args.debug)
    if args.print_config is not None:
        print(dump_config(config, args.print_config), end="")
        return
    if args.print_graph is not None:
        from avrid.ppo.driver.step_graph_figure import print_graph

        try:
            print(print_graph(config, args.print_graph or None), end="")
        except (ValueError, OSError) as e:  # a pipelined mode, an unwritable FILE
            fail("avrid ppo --print-graph", e, debug=args.debug)
        return
    if args.estimate_memory:
        from avrid.ppo.setup.memory_report import report

        try:
            print(report(config, args.gpu_memory or 80 << 30, gpus=args.gpus,
                         label=args.config or f"preset {args.preset or 'tiny-ppo'}"), end="")
        except (ValueError, OSError) as e:  # an unknown model shape, an unreadable config.json
            fail("avrid ppo --estimate-memory", e, debug=args.debug)
        return
    if args.gpu_memory is not None or args.gpus is not None:
        flag = "--gpu-memory sizes" if args.gpu_memory is not None else "--gpus counts"
        fail("avrid ppo", ValueError(f"{flag} the GPUs of --estimate-memory; "
                                      "add --estimate-memory"), debug=args.debug)
    ray_was_running, debug_was = ray_running(), os.environ.get("AVRID_DEBUG")
    if args.debug:  # the workers read it too (vllm_logs.py): vLLM's own lines then show
        os.environ["AVRID_DEBUG"] = "1"
    # Ctrl-C and a scheduler's SIGTERM stop the run alike (stopping.py); a later one waits for
    # the cleanup, which includes shutting down the Ray this command started.
    with StopSignals() as stop:
        try:
            summary = train(config, log=print)
        except USER_ERRORS as e:
            fail("avrid ppo", e, debug=args.debug)
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
                stop_ray()
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


def first_config(args: argparse.Namespace) -> PPOConfig:
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
