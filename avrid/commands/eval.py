"""`avrid eval TARGET`: evaluate a checkpoint, an export or the initial model on a task.

    avrid eval runs/tiny-ppo                 the run's latest checkpoint, on its validation
                                             prompts: greedy and sampled pass@k, mean reward,
                                             response lengths -> runs/tiny-ppo/eval/step_N/
    avrid eval runs/x/checkpoints/step_000050 --k 1,8 --samples 16 --temperature 0.7
    avrid eval runs/x/export --split train --prompts 50 --set task.path=other.jsonl
    avrid eval --initial --preset tiny-grpo  the model before training, as the preset builds it

A checkpoint (and a run's own export/) brings its run's config; --set changes parts of it
(another task file: --set task.path=...). Anything else evaluated takes its config from
--preset (default tiny-ppo) or --config, like `avrid ppo`. The evaluation itself is
`avrid.ppo.driver.evaluate.evaluate`; this file parses the command, builds the config and
reports the outcome, or the error in one line (exit status 2).
"""

from __future__ import annotations

import argparse
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
    from avrid.ppo.driver.eval_target import EvalTarget
    from avrid.ppo.driver.evaluate import EvalOptions
    from avrid.ppo.setup.config import PPOConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `avrid eval` and its arguments to the `avrid` parser's subcommands `sub`."""
    ev = sub.add_parser("eval", help="evaluate a checkpoint, an export or the initial model: "
                        "pass@k, reward, response lengths",
                        epilog=__doc__.split("\n\n")[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("target", nargs="?", help="a run directory (its latest checkpoint), a "
                    "checkpoints/ root, a step directory, or an export directory")
    ev.add_argument("--initial", action="store_true", help="evaluate the model of --preset "
                    "or --config before training, instead of a TARGET")
    ev.add_argument("--preset", help="the config (task, model) where the target brings none "
                    "(--initial, an export outside a run); default tiny-ppo")
    ev.add_argument("--config", metavar="FILE", help="a whole config from a file, instead "
                    "of --preset")
    ev.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.FIELD=VALUE", help="change a config field (e.g. "
                    "task.path=other.jsonl); repeatable")
    ev.add_argument("--split", default="val", help="the prompts: val (default) or train")
    ev.add_argument("--prompts", type=int, metavar="N", help="the split's first N prompts "
                    "(default: train.val_prompts, the number validation uses)")
    ev.add_argument("--samples", type=int, metavar="N", help="sampled responses per prompt "
                    "for pass@k (default: the largest k; 0: the greedy pass only)")
    ev.add_argument("--k", default="1,4,8", metavar="K,K,...",
                    help="the pass@k to report (default 1,4,8); each k <= --samples")
    ev.add_argument("--temperature", type=float, help="the sampling temperature "
                    "(rollout.temperature; default: the config's)")
    ev.add_argument("--pass-threshold", type=float, default=1.0, metavar="R",
                    help="a response passes when its reward is >= R (default 1.0: fully "
                    "right on the built-in tasks, which give partial credit below it)")
    ev.add_argument("--seed", type=int, help="the sampled pass's seed (default: derived "
                    "from train.seed)")
    ev.add_argument("--out", help="where eval.jsonl and eval_summary.json go (default: "
                    "beside the target, e.g. RUN/eval/step_N/)")
    ev.add_argument("--force", action="store_true", help="replace an earlier evaluation in "
                    "--out (only its two files)")
    ev.add_argument("--backend", choices=("ray", "inprocess"), help="placement.backend")
    ev.add_argument("--address", help="join this Ray cluster (placement.ray_address)")
    ev.add_argument("--debug", action="store_true",
                    help="on an error, show the full traceback (or AVRID_DEBUG=1)")


def run(args: argparse.Namespace) -> None:
    """Resolve the target, build the config and options, evaluate, write, print one line."""
    need_ppo_extra("avrid eval")
    from avrid.ppo.driver.eval_target import default_out_dir, initial_target, resolve_target
    from avrid.ppo.driver.evaluate import eval_config, evaluate, summary_line
    from avrid.ppo.outputs.eval_files import check_eval_out, write_eval
    from avrid.ppo.setup.overrides import with_overrides

    import_from_cwd()
    try:
        if (args.target is None) == (not args.initial):
            raise ValueError("give a TARGET (a run, checkpoint or export directory) or "
                             "--initial, not " + ("both" if args.initial else "neither"))
        target = initial_target() if args.initial else resolve_target(args.target)
        options = _options(args)
        config = eval_config(with_overrides(_first_config(args, target), _sets(args)),
                             target, options)
        out = check_eval_out(args.out or default_out_dir(target, config), force=args.force)
    except (ValueError, TypeError, OSError) as e:
        fail("avrid eval", e, debug=args.debug)
    ray_was_running = ray_running()
    try:
        report = evaluate(config, target, options)
        write_eval(out, report.rows, report.summary)
    except USER_ERRORS as e:
        fail("avrid eval", e, debug=args.debug)
    finally:
        if not ray_was_running:
            stop_ray()
    print(f"avrid eval: {summary_line(report.summary)} -> {out}/", flush=True)


def _options(args: argparse.Namespace) -> EvalOptions:
    """`EvalOptions` from the flags (their checks raise ValueError: one line)."""
    from avrid.ppo.driver.evaluate import EvalOptions

    try:
        ks = tuple(int(k) for k in args.k.split(",") if k.strip())
    except ValueError:
        raise ValueError(f"--k {args.k!r} is not a list of whole numbers, e.g. 1,4,8") from None
    samples = args.samples if args.samples is not None else max(ks, default=0)
    return EvalOptions(split=args.split, prompts=args.prompts, samples=samples, ks=ks,
                       pass_threshold=args.pass_threshold, seed=args.seed)


def _first_config(args: argparse.Namespace, target: EvalTarget) -> PPOConfig:
    """The config to start from: the target's run's, else --config's or --preset's."""
    from avrid.ppo.setup.config_file import read_config
    from avrid.ppo.setup.presets import preset

    if args.preset is not None and args.config is not None:
        raise ValueError(f"--preset {args.preset} and --config {args.config} both give a "
                         f"whole config; use one")
    if target.config is not None:
        if args.preset is not None or args.config is not None:
            raise ValueError(f"{args.target} brings its run's config; change parts of it "
                             f"with --set section.field=value, not --preset or --config")
        return target.config
    return read_config(args.config) if args.config else preset(args.preset or "tiny-ppo")


def _sets(args: argparse.Namespace) -> list[str]:
    """The flags as --set assignments, then the --set options (which win)."""
    sets = []
    if args.temperature is not None:
        sets.append(f"rollout.temperature={args.temperature}")
    if args.backend is not None:
        sets.append(f"placement.backend={args.backend}")
    if args.backend == "inprocess":  # threads cannot form an FSDP group: one rank per role
        sets += ["placement.actor_dp=1", "placement.critic_dp=1"]
    if args.address is not None:
        sets.append(f"placement.ray_address={args.address}")
    return sets + args.overrides

