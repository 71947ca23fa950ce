"""Chapters 5-6 — a mutation check of the RL math and the roles: would a test notice?

Each `Site` below names one line that applies a formula (a clip bound, a KL coefficient, an
importance weight, an aggregation weight, GAE's discount, ...) and a small change to it:
delete the line, or replace one expression (``* iw.weights`` dropped, ``maximum`` ->
``minimum``, clip_low and clip_high swapped). For each site the script copies ``avrid/`` and
``tests/`` into a temporary directory, applies the change THERE (the working tree is never
touched: others may be running code from it), runs the site's fast in-process tests against
the copy, and reports whether they caught it ("killed", and by which test) or not
("survived"). A survivor is either a hole in the tests (add one) or a change that cannot
matter, which the site's `why` explains; the table prints both, and the script exits 1 while
any survivor is unexplained.

    python benchmarks/mutants.py                 # every site (12 minutes here: 704 s)
    python benchmarks/mutants.py --list          # the sites, without running anything
    python benchmarks/mutants.py --only kl_loss_coef,is_weights

An anchor is the exact text of the line (or the part of it that changes); it must occur
exactly once in its file, else the script refuses before running anything (the code moved:
update the site). `tests/test_mutants.py` checks that on every test run, so the list cannot
silently rot. This is a check of the tests, not a benchmark: `make bench` does not run it
(it is not named bench_*.py).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(Path(__file__).resolve().parent))  # mutant_sites.py beside this file
from mutant_sites import SITES, Site  # noqa: E402


def anchor_problems(sites: tuple[Site, ...] = SITES, root: Path = ROOT) -> list[str]:
    """A line per site whose anchor is not found exactly once (or whose file or test file is
    missing); empty when every site still points at its code."""
    problems = []
    for s in sites:
        path = root / s.file
        if not path.is_file():
            problems.append(f"{s.name}: no file {s.file}")
            continue
        n = path.read_text().count(s.anchor)
        if n != 1:
            problems.append(f"{s.name}: anchor {s.anchor!r} found {n} times in {s.file} "
                            f"(expected exactly once: the code moved; update the site)")
        for t in s.tests:
            if not (root / t.split("::")[0]).is_file():
                problems.append(f"{s.name}: no test file {t.split('::')[0]}")
    return problems


def copy_tree(dest: Path) -> None:
    """What the tests need, copied: the package, the tests, pytest's configuration."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("avrid", "tests"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def test_env(copy: Path) -> dict[str, str]:
    """The copy first on the path; no bytecode (a mutant and the original may share a size
    and an mtime second); no outside Ray."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    return env


FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def run_tests(copy: Path, tests: tuple[str, ...], timeout_s: int) -> tuple[str, str]:
    """("passed" | "failed" | "error", the first failing test or what went wrong)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE",
           "-m", "not slow", *tests]
    try:
        done = subprocess.run(cmd, cwd=copy, env=test_env(copy), capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "failed", f"(timed out after {timeout_s} s)"
    if done.returncode == 0:
        return "passed", ""
    found = FAILED.search(done.stdout)
    if done.returncode == 1 and found:
        return "failed", found.group(1)
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    return "error", f"pytest exit {done.returncode}: " + " / ".join(tail)


def check_copy(copy: Path) -> None:
    """The tests must import the copy's avrid, not the installed (editable) one."""
    code = "import avrid, tests; print(avrid.__file__); print(tests.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=test_env(copy),
                         capture_output=True, text=True, check=True).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(copy.resolve()):
            raise SystemExit(f"the copy is not what runs: {path} is outside {copy}")


def table(rows: list[tuple[Site, str, str]]) -> str:
    """The markdown table of results."""
    out = ["| site | file | mutation | result | killed by / why it survives |",
           "|---|---|---|---|---|"]
    for s, result, detail in rows:
        if result == "survived":
            detail = s.why or "**UNEXPLAINED**"
        mutation = s.mutation().replace("|", "\\|")
        out.append(f"| {s.name} | {s.file.removeprefix('avrid/ppo/')} | {mutation} | "
                   f"{result} | {detail.replace('|', '/')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated site names to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the sites and exit")
    parser.add_argument("--timeout", type=int, default=900,
                        help="seconds one site's tests may take (default 900)")
    args = parser.parse_args(argv)
    names = [s.name for s in SITES]
    if len(set(names)) != len(names):
        raise SystemExit("two sites share a name")
    sites = SITES
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"--only: no site named {unknown}; the sites: {', '.join(names)}")
        sites = tuple(s for s in SITES if s.name in wanted)
    problems = anchor_problems(sites)
    if problems:
        print("refusing to run: a site no longer matches the code\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 2
    if args.list:
        for s in sites:
            print(f"{s.name:28} {s.file:32} {s.mutation()}\n{'':28} tests: {' '.join(s.tests)}")
        return 0
    # SIGTERM unwinds like Ctrl-C: subprocess.run kills the running pytest and the temporary
    # copy is removed (the default action would leave both behind).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    start = time.monotonic()
    rows: list[tuple[Site, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="avrid-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        check_copy(copy)
        everything = tuple(dict.fromkeys(t for s in sites for t in s.tests))
        print(f"sanity: the unmutated copy on {len(everything)} test targets ...",
              file=sys.stderr, flush=True)
        status, detail = run_tests(copy, everything, args.timeout)
        if status != "passed":
            print(f"refusing to run: the unmutated copy does not pass: {detail}", file=sys.stderr)
            return 2
        for i, s in enumerate(sites, 1):
            path = copy / s.file
            original = path.read_text()
            path.write_text(s.apply(original))
            try:
                status, detail = run_tests(copy, s.tests, args.timeout)
            finally:
                path.write_text(original)
            result = {"passed": "survived", "failed": "killed"}.get(status, "error")
            rows.append((s, result, detail))
            print(f"[{i}/{len(sites)}] {s.name}: {result} {detail}", file=sys.stderr, flush=True)
    print(table(rows))
    survived = [s for s, r, _ in rows if r == "survived"]
    unexplained = [s.name for s in survived if not s.why]
    errors = [s.name for s, r, _ in rows if r == "error"]
    print(f"\n{len(rows)} sites: {len(rows) - len(survived) - len(errors)} killed, "
          f"{len(survived)} survived ({len(unexplained)} unexplained), {len(errors)} errors; "
          f"{time.monotonic() - start:.0f} s")
    return 1 if unexplained or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
