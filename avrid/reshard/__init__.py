"""Chapter 4 — resharding: from the training layout (FSDP dim-0 shards) to the rollout layout
(tensor-parallel slices), moving only what each rank needs, and proving it arrived.

Read in this order: layout.py (regions and layouts), tp_layout.py (how vLLM shards a decoder),
planner.py (the pure minimum-bytes transfer plan), executor.py (running it over
torch.distributed, and the all-gather baseline), fingerprint.py (the stale-weights check),
engines.py (loading into a torch engine or vLLM), vllm_worker.py (its side inside vLLM).
"""

from avrid.reshard.executor import (
    ProcessMap,
    execute,
    expected_slice_checksums,
    layout_checksums,
    naive_allgather,
    post_sends,
    slice_checksums,
)
from avrid.reshard.fingerprint import (
    Fingerprint,
    StaleWeightsError,
    check_same,
    combine,
    fingerprint,
    region_checksum,
)
from avrid.reshard.layout import LayoutError, ModelLayout, ParamLayout, Region
from avrid.reshard.planner import Bucket, Transfer, TransferPlan, plan_transfer
from avrid.reshard.tp_layout import decoder_tp_layout

__all__ = [
    "Bucket", "Fingerprint", "LayoutError", "ModelLayout", "ParamLayout", "ProcessMap",
    "Region", "StaleWeightsError", "Transfer", "TransferPlan", "check_same", "combine",
    "decoder_tp_layout", "execute", "expected_slice_checksums", "fingerprint",
    "layout_checksums", "naive_allgather", "plan_transfer", "post_sends", "region_checksum",
    "slice_checksums",
]
