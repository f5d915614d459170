"""Exercise 3: the per-chunk recount of tokens per expert (bug 2's fix), in torch."""

from __future__ import annotations

import torch


def chunk_counts(topk_ids, start, end, num_local_experts, expert_map=None):
    """Pairs per local expert among tokens ``[start, end)``: int64 ``[num_local_experts]``."""
    ids = topk_ids[start:end].reshape(-1).long()
    limit = expert_map.numel() if expert_map is not None else num_local_experts
    ok = (ids >= 0) & (ids < limit)  # -1 = empty slot; never index the map with it
    local = ids.clamp(0, max(limit - 1, 0))
    if expert_map is not None:
        local = expert_map.long()[local]
    ok &= (local >= 0) & (local < num_local_experts)  # -1 in the map = another rank's expert
    # Shift by one: invalid pairs land in bin 0, which is dropped (no boolean indexing).
    return torch.bincount(torch.where(ok, local + 1, 0), minlength=num_local_experts + 1)[1:]
