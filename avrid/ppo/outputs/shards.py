"""Chapter 5 — sharded checkpoints on disk: the layout every rank of a trained role writes
with `torch.distributed.checkpoint` (DCP), and reading a model's shards back whole.

Why sharded: gathering the whole fp32 model on every rank to save it (`fsdp.full_state_dict`)
needs one full copy of the weights in host memory per rank — 28 GB each for a 7B model on
eight GPUs — and ships it to the driver. Instead each rank writes only what it holds, its
FSDP2 shards (`fsdp.save_shards`, run by `TrainedWorker.save_shards`), so neither a rank nor
the driver ever holds the whole model; the driver only says where. A model's directory::

    actor/
      model/   .metadata, __0_0.distcp, __1_0.distcp, ...   one file per rank, plus DCP's
      optim/   .metadata, __0_0.distcp, ...                 index of which rank holds what

`fsdp.load_shards` reads them back on every rank of a resumed run (same number of ranks:
the config check refuses another placement). The ranks must all reach the directory: on one
machine they do; a multi-node run needs ``train.out_dir`` on a filesystem every node mounts
(NFS, Lustre, ...).

Here: the names of that layout (`fsdp.py` spells the same ones: roles may not import this
package, nor this one roles) and `read_model_weights`, which loads a model directory whole in
one process with no process group at all — what the Hugging Face export needs, and only it.

Not here: writing the shards (`fsdp.py`, on the workers), where the directory goes,
atomicity and checksums (`checkpoint.py`, `manifest.py`), when to save (the driver).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

MODEL_DIR = "model"
"""Subdirectory of a model's directory holding its weights."""
OPTIM_DIR = "optim"
"""Subdirectory holding its optimizer's state."""
METADATA = ".metadata"
"""The index DCP writes last into each of them (which rank's file holds which piece)."""


def read_model_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved model's weights, whole, on the CPU, in this process alone (no
    process group): the export's reader. Allocates one full copy, which is the point here."""
    path = Path(directory) / MODEL_DIR
    if not (path / METADATA).is_file():
        raise FileNotFoundError(f"{path} holds no sharded weights (no {METADATA} file)")
    metadata = dcp.FileSystemReader(path).read_metadata()
    weights: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"{path}: entry {key!r} is not a tensor; a model's weights hold "
                             f"tensors only")
        weights[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    with _quiet():
        dcp.load(weights, checkpoint_id=path, no_dist=True)
    return weights


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every load without a process group that it assumes one process: here
    that is the point, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
