"""Chapter 4 — resharding: from the training layout (FSDP dim-0 shards) to the rollout layout
(tensor-parallel slices), moving only what each rank needs, and proving it arrived.

Read in this order: layout.py (regions and layouts), tp_layout.py (how vLLM shards a decoder),
planner.py (the pure minimum-bytes transfer plan), executor.py (running it over
torch.distributed, and the all-gather baseline), fingerprint.py (the stale-weights check).
Being built (issue 5): loading into rollout engines (torch engine, vLLM adapter), the
benchmark and the chapter material.
"""

from avrid.reshard.executor import ProcessMap, execute, layout_checksums, naive_allgather
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
    "decoder_tp_layout", "execute", "fingerprint", "layout_checksums", "naive_allgather",
    "plan_transfer", "region_checksum",
]
