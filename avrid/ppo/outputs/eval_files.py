"""Chapter 5 — the files `avrid eval` writes: ``eval.jsonl`` and ``eval_summary.json``.

    eval.jsonl         one JSON line per prompt: its index, text and answer, the greedy
                       response and every sampled one (text, reward, length in tokens,
                       truncated, passed), and how many samples passed
    eval_summary.json  what was evaluated (target, step, task, split, counts, temperature,
                       pass threshold) and the metrics (`driver/evaluate.py`)

Each file is written atomically (`results.timeline.atomic_write`: a temporary file renamed
into place), the rows first and the summary last, so a summary is only ever beside the
rows it summarises. A directory that holds an earlier evaluation is refused unless `force`;
with it, only those two files are replaced: nothing else in the directory is touched, so
pointing ``--out`` at a folder of one's own never deletes anything of the user's.

Not here: running the evaluation, choosing the default directory (`driver/eval_target.py`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from avrid.ppo.outputs.outdir import OutDirError, writing
from avrid.results.timeline import atomic_write

ROWS_FILE = "eval.jsonl"
SUMMARY_FILE = "eval_summary.json"


def check_eval_out(out: str | os.PathLike[str], *, force: bool) -> Path:
    """`out` as a Path, after refusing what the evaluation may not write to: a file, or a
    directory holding an earlier evaluation (unless `force`). Called before the evaluation
    starts, so a refusal costs nothing.

    Raises:
        OutDirError: (a ValueError) the message says what is in the way and what to do.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutDirError(f"--out {out} is a file; give a directory for {ROWS_FILE} and "
                          f"{SUMMARY_FILE}")
    earlier = [name for name in (ROWS_FILE, SUMMARY_FILE) if (out / name).exists()]
    if earlier and not force:
        raise OutDirError(f"{out} already holds an evaluation ({', '.join(earlier)}); pass "
                          f"--force to replace it, or --out another directory")
    return out


def write_eval(out: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]],
               summary: Mapping[str, Any]) -> Path:
    """Write the rows, then the summary, into `out` (created if missing); returns `out`.

    Raises:
        avrid.ppo.outputs.outdir.WriteError: (an OSError) a file cannot be written.
    """
    out = Path(out)
    lines = "".join(json.dumps(dict(row), allow_nan=False) + "\n" for row in rows)
    text = json.dumps(dict(summary), indent=2, allow_nan=False) + "\n"
    for name, data in ((ROWS_FILE, lines), (SUMMARY_FILE, text)):
        with writing(out / name):
            atomic_write(out / name, lambda f, data=data: f.write(data.encode()))
    return out
