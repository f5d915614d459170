"""Counts per local expert as a product of two one-hot matrices (tensor cores), for comparison.

A local expert ``e < HI * LO`` is the pair ``(e // LO, e % LO)``. For a tile of ids, the one-hot
of the high part ``A[h, i] = (hi_i == h)`` and of the low part ``B[i, l] = (lo_i == l)`` give
``(A @ B)[h, l]`` = the ids of the tile whose expert is ``h * LO + l``: the tile's histogram, as a
small int8 x int8 -> int32 matrix product. Each id costs ``HI + LO`` compares instead of the
``HI * LO`` of a full one-hot, and the adds run on the tensor cores. Invalid ids get ``hi = HI``,
which matches no row.

``SPLIT`` tiles are binned at once as a batched product ``[SPLIT, HI, K] @ [SPLIT, K, LO]`` so
that several warps share the work along the ids instead of along the 16 x 16 output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.kernels.count import _load_tile, _local_ids
from moekit.kernels.host_math import cdiv, next_power_of_2


@triton.jit
def _count_dot_kernel(
    ids_ptr, map_ptr, out_ptr,
    numel, id_limit, num_local,
    HAS_MAP: tl.constexpr, SPLIT: tl.constexpr, K: tl.constexpr, HI: tl.constexpr, LO: tl.constexpr,
    SOLO: tl.constexpr, FP16: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    BLOCK: tl.constexpr = SPLIT * K
    num_tiles = tl.cdiv(numel, BLOCK)
    acc = tl.zeros([HI, LO], dtype=tl.int32)
    rows = tl.arange(0, HI)
    cols = tl.arange(0, LO)
    ahead = _load_tile(ids_ptr, pid, num_tiles, numel, BLOCK)
    for t in range(pid, num_tiles, step):
        ids = ahead
        ahead = _load_tile(ids_ptr, t + step, num_tiles, numel, BLOCK)
        local, ok = _local_ids(ids, map_ptr, id_limit, num_local, HAS_MAP)
        hi = tl.where(ok, local // LO, HI)
        lo = local % LO
        kind = tl.float16 if FP16 else tl.int8
        if SPLIT == 1:
            a = (hi[None, :] == rows[:, None]).to(kind)  # [HI, K]
            b = (lo[:, None] == cols[None, :]).to(kind)  # [K, LO]
            part = tl.dot(a, b, out_dtype=tl.float32 if FP16 else tl.int32)
        else:
            a = (tl.reshape(hi, [SPLIT, 1, K]) == rows[None, :, None]).to(kind)  # [SPLIT, HI, K]
            b = (tl.reshape(lo, [SPLIT, K, 1]) == cols[None, None, :]).to(kind)  # [SPLIT, K, LO]
            part = tl.sum(tl.dot(a, b, out_dtype=tl.float32 if FP16 else tl.int32), axis=0)
        acc += part.to(tl.int32)  # exact: a tile's count per bin is at most SPLIT * K
    hist = acc
    bins = rows[:, None] * LO + cols[None, :]
    keep = bins < num_local
    if SOLO:
        tl.store(out_ptr + bins, hist, mask=keep)
    else:
        tl.atomic_add(out_ptr + bins, hist, mask=keep & (hist > 0), sem="relaxed")


def count_dot(topk_ids, num_local_experts, expert_map=None, *, k=256, split=1, programs_per_sm=8,
              num_warps=1, sms=132, fp16=False):
    """Counts of validated, non-empty ids through ``_count_dot_kernel`` (benchmark use only)."""
    numel = topk_ids.numel()
    lo = 16
    hi = max(16, next_power_of_2(cdiv(num_local_experts, lo)))
    block = split * k
    grid = min(cdiv(numel, block), sms * programs_per_sm)
    solo = grid == 1
    out = (torch.empty if solo else torch.zeros)(num_local_experts, dtype=torch.int32, device=topk_ids.device)
    limit = expert_map.numel() if expert_map is not None else num_local_experts
    _count_dot_kernel[(grid,)](
        topk_ids, expert_map, out, numel, limit, num_local_experts,
        HAS_MAP=expert_map is not None, SPLIT=split, K=k, HI=hi, LO=lo, SOLO=solo, FP16=fp16,
        num_warps=num_warps,
    )  # fmt: skip
    return out

