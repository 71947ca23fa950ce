"""Chapter 5 — DAPO's soft overlong punishment: a length penalty that ramps in near the budget.

A response cut off at the response budget has no final answer, so its score says little about
its reasoning; `algo.truncation` handles those (keep, mask, or a fixed penalty). DAPO (Yu et
al. 2025, arXiv 2503.14476, section 3.4) adds a softer signal BEFORE the cut-off: over the
last `buffer` tokens of the budget L_max the score loses a share that grows linearly with the
excess, so the policy learns to finish early instead of learning nothing from a cut.

    excess_i  = len_i - (L_max - buffer)
    penalty_i = min(-factor * excess_i / buffer, 0)

i.e. 0 up to L_max - buffer tokens, -factor at exactly L_max. verl 0.9.1 applies it in its DAPO
reward manager (`reward += min(-exceed_len / overlong_buffer_len * penalty_factor, 0)`); here
it is applied where `algo.truncation` is, to the score before any advantage sees it.
Pure tensor math; no models, no batches, no Ray.
"""

from __future__ import annotations

import torch


def overlong_penalty(response_lens: torch.Tensor, *, max_response: int, buffer: int,
                     factor: float) -> torch.Tensor:
    """DAPO's soft overlong penalty per response (<= 0; add it to the scores).

    Args:
        response_lens: (B,) integer response lengths in tokens (0 <= len <= max_response).
        max_response: the response budget L_max (> 0).
        buffer: the ramp's length in tokens, 0 < buffer < max_response.
        factor: the penalty at the budget (> 0).

    Returns:
        (B,) float32 penalties: 0 for len <= L_max - buffer, -factor * excess / buffer above.

    Example:
        >>> overlong_penalty(torch.tensor([4, 6, 7, 8]), max_response=8, buffer=4, factor=1.0)
        tensor([ 0.0000, -0.5000, -0.7500, -1.0000])
    """
    if max_response <= 0:
        raise ValueError(f"max_response must be > 0, got {max_response}")
    if not 0 < buffer < max_response:
        raise ValueError(f"buffer must be in (0, max_response={max_response}), got {buffer}")
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    if response_lens.dim() != 1:
        raise ValueError(f"response_lens must be 1-D (B,), got {tuple(response_lens.shape)}")
    excess = response_lens.float() - float(max_response - buffer)
    # + 0.0 turns clamp's -0.0 (no excess) into a plain 0 in metrics and logs.
    return torch.clamp(-excess / buffer * factor, max=0.0) + 0.0
