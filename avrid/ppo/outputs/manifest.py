"""Chapter 5 — a checkpoint's manifest: what a step directory holds and the sha256 of every
file in it, and checking a directory against it.

`checkpoint.py` writes a step directory and, last of all, its ``manifest.json``::

    {"format": 3, "step": 12, "weights": [], "optimizers": [], "sharded": ["actor", "critic"],
     "extra": true, "files": {"actor/model/.metadata": "<sha256 hex>", ...}}

``sharded`` lists the models saved as per-rank shards (a directory per model, `shards.py`);
``weights`` and ``optimizers`` the ones saved whole (``<name>.safetensors``,
``<name>.optim.pt``: what every checkpoint held before format 3, still written by callers that
hand `save_checkpoint` whole state dicts). ``files`` covers every file, those in the model
directories too, by its path relative to the step directory.

The manifest does two jobs. Its presence marks a directory as complete (it is written last),
and its checksums let a load notice a file that changed after the save: edited in place,
truncated, bit rot. `read_verified` reads one file only after its sha256 matched, and
`verify_checkpoint` checks a whole directory without loading it (to find the newest intact
step when the latest one is damaged). Every error names the file.

The format number lives here because the manifest is what records it: `FORMAT_VERSION` is
written into every manifest and `read_manifest` refuses formats not in `READABLE_FORMATS`.

This file does not decide where directories go, write the data files, pick the latest step
or prune old ones: that is `checkpoint.py`, which imports this one (never the other way
round). The checksums catch damage, not a forger, who can rewrite the manifest too.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from avrid.ppo.outputs.outdir import write_file
from avrid.ppo.outputs.shards import METADATA, MODEL_DIR, OPTIM_DIR

FORMAT_VERSION = 3
"""Bumped when the layout changes; `load_checkpoint` refuses versions it does not know (so an
avrid older than sharded checkpoints refuses a format-3 one, naming the format)."""
READABLE_FORMATS = (1, 2, 3)
"""Formats `load_checkpoint` reads. Format 1 had no checksums: its files load unverified.
Format 2 (whole weights, per-rank optimizer states, no ``sharded``) still resumes."""


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks (a model file never sits in memory
    twice)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path, *, step: int, weights: Iterable[str],
                   optimizers: Iterable[str], extra: bool, sharded: Iterable[str] = ()) -> None:
    """Write ``manifest.json`` into `directory`, recording the sha256 of every file in it.

    Call it last, once every other file is written and fsynced: the files are hashed as they
    are on disk (the page cache), which is what a later load will read.

    Args:
        directory: the (still temporary) step directory.
        step: the training step the directory holds.
        weights: the model names with a ``<name>.safetensors`` file.
        optimizers: the optimizer names with a ``<name>.optim.pt`` file.
        extra: whether an ``extra.pt`` file is there.
        sharded: the model names with a ``<name>/`` directory of per-rank shards.
    """
    files = {p.relative_to(directory).as_posix(): sha256_file(p)
             for p in sorted(directory.rglob("*")) if p.is_file()}
    manifest = {"format": FORMAT_VERSION, "step": step, "weights": sorted(weights),
                "optimizers": sorted(optimizers), "sharded": sorted(sharded), "extra": extra,
                "files": files}
    write_file(directory / "manifest.json",
               lambda p: p.write_text(json.dumps(manifest, indent=1)))


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the step directory `path`, checked for shape before anyone trusts it.

    Raises:
        FileNotFoundError: there is no ``manifest.json``.
        ValueError: it is unreadable, of a format not in `READABLE_FORMATS`, malformed, or (a
            format-2 manifest) lacks the checksum of a file it lists.
    """
    manifest = read_verified(path / "manifest.json", lambda p: json.loads(p.read_text()))
    version = manifest.get("format") if isinstance(manifest, dict) else None
    if type(version) is not int or version not in READABLE_FORMATS:
        raise ValueError(f"{path / 'manifest.json'}: format {version!r}, this code reads "
                         f"formats {', '.join(map(str, READABLE_FORMATS))}")
    if version < 3:  # written before sharded checkpoints: every model saved whole
        manifest.setdefault("sharded", [])
    shapes = {"step": int, "weights": list, "optimizers": list, "sharded": list, "extra": bool}
    if wrong := [k for k, kind in shapes.items() if not isinstance(manifest.get(k), kind)]:
        raise ValueError(f"{path / 'manifest.json'} is malformed: {', '.join(wrong)} missing "
                         f"or of the wrong type")
    unchecked = ([] if version < 2 else sorted(set(_listed_files(manifest))
                                                  - set(manifest.get("files") or {})))
    if unchecked:  # every format-2 save records them all
        raise ValueError(f"{path / 'manifest.json'} records no checksum for "
                         f"{', '.join(unchecked)}: the manifest was edited or damaged")
    return manifest


def read_verified(path: Path, read: Callable[[Path], Any], digest: str | None = None) -> Any:
    """`read(path)` after checking the file's sha256 against `digest` (None: not recorded,
    read unchecked), with errors that name the file.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: its checksum does not match, or `read` failed on it.
    """
    _verify(path, digest)
    try:
        return read(path)
    except Exception as e:
        raise ValueError(f"checkpoint file {path} is unreadable or corrupt: {e}") from e


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Check a step directory without loading it: a readable manifest of a known format,
    and every file it lists present with its recorded sha256.

    Raises:
        FileNotFoundError / ValueError: as `load_checkpoint`, naming the file.
    """
    path = Path(path)
    manifest = read_manifest(path)
    for name, digest in manifest.get("files", {}).items():
        _verify(path / name, digest)
    for name in _listed_files(manifest):
        if not (path / name).is_file():
            raise FileNotFoundError(f"checkpoint file missing: {path / name}")


def _listed_files(manifest: Mapping[str, Any]) -> list[str]:
    """The files a manifest says its directory holds."""
    return ([f"{m}.safetensors" for m in manifest["weights"]]
            + [f"{o}.optim.pt" for o in manifest["optimizers"]]
            + [f"{m}/{part}/{METADATA}" for m in manifest["sharded"]
               for part in (MODEL_DIR, OPTIM_DIR)]  # DCP's index of each part's shards
            + ["state.json"] + (["extra.pt"] if manifest["extra"] else []))


def _verify(path: Path, digest: str | None) -> None:
    """Refuse a missing file, or one whose sha256 is not `digest` (None: not recorded)."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    if digest is not None and (got := sha256_file(path)) != digest:
        raise ValueError(f"checkpoint file {path} does not match the checksum its manifest "
                         f"recorded (sha256 {got[:12]}..., expected {digest[:12]}...): it "
                         f"was changed or damaged after the checkpoint was written")
