"""`avrid export SRC DEST`: a checkpoint's policy in Hugging Face format.

The work is `avrid.ppo.outputs.export.export_checkpoint`; this file only parses the command
and reports what was written, or the error in one line (exit status 2).
"""

from __future__ import annotations

import argparse

from avrid.commands.common import fail, need_ppo_extra


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `avrid export` and its arguments to the `avrid` parser's subcommands `sub`."""
    export = sub.add_parser("export", help="write a checkpoint's policy in Hugging Face format")
    export.add_argument("source", help="a run directory (its latest checkpoint), a checkpoints/ "
                        "root or a step directory")
    export.add_argument("dest", help="the directory to write (must not exist, or be empty)")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty DEST")
    export.add_argument("--merged", action="store_true", help="a LoRA run: write the merged "
                        "model too, in DEST/merged, beside DEST/adapter and its DEST/base")
    export.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback (or AVRID_DEBUG=1)")


def run(args: argparse.Namespace) -> None:
    """Export a checkpoint; bad input is one line naming what is wrong, exit status 2."""
    need_ppo_extra("avrid export")
    from avrid.ppo.outputs.export import export_checkpoint

    try:
        done = export_checkpoint(args.source, args.dest, overwrite=args.overwrite,
                                 merged=args.merged)
    except (ValueError, OSError) as e:  # not a checkpoint, destination taken, files gone
        fail("avrid export", e, debug=args.debug)
    print(f"avrid export: step {done.step} of {done.checkpoint} -> {done.dest}/ "
          f"({', '.join(done.files)})")
