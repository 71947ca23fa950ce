"""The `avrid` command's subcommands that run the library, one file each.

`avrid.cli` is the entry point: it builds the parser (each file here adds its subcommand's
arguments with `add_parser`) and calls the subcommand's `run`. Read in this order:

1. common.py  what every subcommand shares: one-line errors (exit 2), the `ppo` extra, Ray
2. ppo.py     `avrid ppo`: a config from preset or file, flags and --set; train, or print
3. export.py  `avrid export`: a checkpoint's policy in Hugging Face format
4. eval.py    `avrid eval`: a checkpoint, an export or the initial model scored on a task

Nothing here holds logic of the library: each `run` parses what the user typed, calls one
library function and reports the outcome (or the error, in one line).
"""
