"""Permute (token, slot) rows into DeepGEMM's contiguous layout, and gather them back.

Shapes (M tokens, K hidden, G = K/128 scale groups, E local experts, M_sum rows of the layout)::

    a1q         [M, K]       fp8 activations       a1q_scale  [M, G] fp32 (any strides)
    topk_ids    [M, topk]    global expert ids, -1 = empty slot
    counts      [E]          int32 (token, slot) pairs per local expert
    a           [M_sum, K]   fp8, rows grouped by expert, each group padded to 128 rows
    a_scale     [M_sum, G]   fp32, column-major storage [G, round_up(M_sum, 4)] (TMA alignment)
    m_indices   [M_sum]      int32 expert of every row, padding rows included (never -1)
    inv_perm    [M * topk]   int32 flat pair -> row of ``a``, -1 for empty or non-local slots

The contiguous layout for counts = [3, 0, 130] and M_sum = 512::

    rows   0..2    expert 0 (3 pairs)      rows 3..127   padding, m_indices 0
    rows 128..257  expert 2 (130 pairs)    rows 258..383 padding, m_indices 2
    rows 384..511  unused blocks, m_indices 2 (the last expert), no data

Within an expert, rows are placed in the order an atomic counter hands out; the order does not
change any result (every output row depends on its own input row only), but ``inv_perm`` may
differ between GPU runs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moekit.errors import InvalidInputError
from moekit.kernels.contiguous_layout import (
    ALIGN,
    FP8,
    MISMATCH,
    OVERFLOW,
    ContiguousLayout,
    alloc_layout,
    column_major_scale,
)
from moekit.kernels.unpermute import unpermute_from_contiguous
from moekit.validate import check_ids


@triton.jit
def _expert_offsets_kernel(
    # Pointers
    counts_ptr, expert_start_ptr, cursor_ptr, flags_ptr,
    # Sizes
    num_experts, num_rows,
    # Meta-parameters
    ALIGN_M: tl.constexpr, BLOCK_E: tl.constexpr,
):
    e = tl.arange(0, BLOCK_E)
    mask = e < num_experts
    c = tl.load(counts_ptr + e, mask=mask, other=0)
    padded = (c + ALIGN_M - 1) // ALIGN_M * ALIGN_M
    end = tl.cumsum(padded, 0)
    start = end - padded
    tl.store(expert_start_ptr + e, start, mask=mask)
    tl.store(cursor_ptr + e, start, mask=mask)
    total = tl.sum(padded, 0)
    tl.store(expert_start_ptr + num_experts, total)
    tl.store(flags_ptr, (total > num_rows).to(tl.int32))  # OVERFLOW


@triton.jit
def _scatter_rows_kernel(
    # Pointers
    a1q_ptr, a1q_scale_ptr, topk_ids_ptr, expert_map_ptr,
    a_ptr, a_scale_ptr, inv_perm_ptr, expert_start_ptr, cursor_ptr, flags_ptr,
    # Sizes
    K, G, topk, num_experts, num_global, num_rows,
    stride_xm, stride_sm, stride_sg, stride_am, stride_asm, stride_asg,
    # Meta-parameters
    HAS_MAP: tl.constexpr, TOPK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, TOPK)
    jmask = j < topk
    ids = tl.load(topk_ids_ptr + m * topk + j, mask=jmask, other=-1).to(tl.int32)
    if HAS_MAP:
        in_map = jmask & (ids >= 0) & (ids < num_global)
        local = tl.load(expert_map_ptr + ids, mask=in_map, other=-1).to(tl.int32)
    else:
        local = ids
    valid = jmask & (local >= 0) & (local < num_experts)
    dest = tl.atomic_add(cursor_ptr + local, 1, mask=valid)
    end = tl.load(expert_start_ptr + local + 1, mask=valid, other=0)
    # Counts that undercount an expert would push rows into the next segment (or past the
    # buffer): drop those rows and raise the flag rather than write out of bounds.
    ok = valid & (dest < tl.minimum(end, num_rows))
    tl.atomic_or(flags_ptr, tl.max((valid & ~ok).to(tl.int32), 0))  # OVERFLOW
    tl.store(inv_perm_ptr + m * topk + j, tl.where(ok, dest, -1), mask=jmask)

    dest64 = dest.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + offs_k < K
        x = tl.load(a1q_ptr + m * stride_xm + k0 + offs_k, mask=kmask)
        dst = a_ptr + dest64[:, None] * stride_am + k0 + offs_k[None, :]
        tl.store(dst, tl.broadcast_to(x[None, :], (TOPK, BLOCK_K)), mask=ok[:, None] & kmask[None, :])
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    s = tl.load(a1q_scale_ptr + m * stride_sm + g * stride_sg, mask=gmask)
    dst = a_scale_ptr + dest64[:, None] * stride_asm + g[None, :] * stride_asg
    tl.store(dst, tl.broadcast_to(s[None, :], (TOPK, BLOCK_G)), mask=ok[:, None] & gmask[None, :])


@triton.jit
def _block_experts_kernel(
    # Pointers
    counts_ptr, expert_start_ptr, cursor_ptr, m_indices_ptr, block_rows_ptr, flags_ptr,
    # Sizes
    num_experts, num_rows,
    # Meta-parameters
    ALIGN_M: tl.constexpr, BLOCK_E: tl.constexpr,
):
    b = tl.program_id(0)
    r0 = b * ALIGN_M
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(expert_start_ptr + 1 + e, mask=e < num_experts, other=2147483647)
    # The segment holding r0 belongs to the first expert whose segment ends after r0; blocks
    # past the last segment take the last expert so that no block ever reads expert -1.
    expert = tl.minimum(tl.sum((ends <= r0).to(tl.int32), 0), num_experts - 1)
    end = tl.load(expert_start_ptr + expert + 1)
    filled = tl.minimum(tl.minimum(tl.load(cursor_ptr + expert), end), num_rows)
    rows = tl.minimum(tl.maximum(filled - r0, 0), ALIGN_M)
    offs = tl.arange(0, ALIGN_M)
    tl.store(m_indices_ptr + r0 + offs, tl.zeros((ALIGN_M,), tl.int32) + expert, mask=r0 + offs < num_rows)
    tl.store(block_rows_ptr + b, rows)
    if b == 0:
        # After the scatter, cursor - start is what topk_ids really route to each expert.
        emask = e < num_experts
        routed = tl.load(cursor_ptr + e, mask=emask, other=0) - tl.load(expert_start_ptr + e, mask=emask, other=0)
        differ = tl.max((routed != tl.load(counts_ptr + e, mask=emask, other=0)).to(tl.int32), 0)
        tl.atomic_or(flags_ptr, differ * 2)  # MISMATCH


def permute_to_contiguous(
    a1q: torch.Tensor,
    a1q_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    counts: torch.Tensor,
    *,
    num_rows: int,
    expert_map: torch.Tensor | None = None,
    out: ContiguousLayout | None = None,
) -> ContiguousLayout:
    """Scatter every local (token, slot) pair's row into DeepGEMM's contiguous layout.

    In plain Python::

        start = exclusive_cumsum(round_up(counts, 128))       # padded segment of each expert
        cursor = start.copy()
        for m, j in pairs:                                   # one program per token, in parallel
            e = local(topk_ids[m, j])                        # -1: empty slot or other rank
            if e < 0: inv_perm[m * topk + j] = -1; continue
            row = cursor[e]; cursor[e] += 1                  # an atomic add on the GPU
            a[row], a_scale[row] = a1q[m], a1q_scale[m]
            inv_perm[m * topk + j] = row
        for each 128-row block b: m_indices[b] = the expert whose segment holds it (last expert
                                   for unused blocks), block_rows[b] = rows of data in it

    Args:
        a1q: fp8 ``[M, K]``. a1q_scale: fp32 ``[M, ceil(K/128)]`` group scales (any strides).
        topk_ids: signed int ``[M, topk]`` global ids. expert_map: optional ``[E_global]``.
        counts: int32 ``[E]`` pairs per local expert (``count_expert_num_tokens``). Wrong
            counts never write out of bounds; they set ``flags`` (checked by the caller, which
            knows where the counts came from). Too large ones still give a valid layout.
        num_rows: M_sum, rows of the layout; at least ``sum(round_up(counts, 128))``.
        out: buffers to fill (see :func:`alloc_layout`); fresh ones when None.

    Returns:
        The filled :class:`ContiguousLayout`.
    """
    check_ids(topk_ids)
    M, K = a1q.shape
    topk = topk_ids.shape[1]
    E = counts.numel()
    if a1q.dtype != FP8 or a1q.stride(1) != 1:
        raise InvalidInputError(f"a1q must be float8_e4m3fn [M, K] with unit column stride, got {a1q.dtype} {a1q.stride()}")
    G = math.ceil(K / ALIGN)
    if tuple(a1q_scale.shape) != (M, G) or a1q_scale.dtype != torch.float32:
        raise InvalidInputError(f"a1q_scale must be float32 {(M, G)}, got {a1q_scale.dtype} {tuple(a1q_scale.shape)}")
    if topk_ids.shape[0] != M or counts.dtype != torch.int32 or counts.dim() != 1 or E == 0:
        raise InvalidInputError(
            f"expected topk_ids [M={M}, topk] and int32 counts [E>0], got {tuple(topk_ids.shape)} and "
            f"{counts.dtype} {tuple(counts.shape)}"
        )
    if num_rows % ALIGN:
        raise InvalidInputError(f"num_rows must be a multiple of {ALIGN}, got {num_rows}")
    layout = out if out is not None else alloc_layout(num_rows, K, M * topk, E, device=a1q.device)
    if tuple(layout.a.shape) != (num_rows, K) or layout.inv_perm.numel() != M * topk or layout.cursor.numel() != E:
        raise InvalidInputError(
            f"layout buffers are a {tuple(layout.a.shape)}, inv_perm {layout.inv_perm.numel()}, cursor "
            f"{layout.cursor.numel()}; expected {(num_rows, K)}, {M * topk}, {E}"
        )
    BLOCK_E = triton.next_power_of_2(E)
    _expert_offsets_kernel[(1,)](
        counts, layout.expert_start, layout.cursor, layout.flags, E, num_rows, ALIGN_M=ALIGN, BLOCK_E=BLOCK_E
    )
    if M > 0:
        emap = expert_map if expert_map is not None else topk_ids  # a dummy pointer when unused
        _scatter_rows_kernel[(M,)](
            a1q, a1q_scale, topk_ids, emap,
            layout.a, layout.a_scale, layout.inv_perm, layout.expert_start, layout.cursor, layout.flags,
            K, G, topk, E, emap.numel() if expert_map is not None else E, num_rows,
            a1q.stride(0), a1q_scale.stride(0), a1q_scale.stride(1),
            layout.a.stride(0), layout.a_scale.stride(0), layout.a_scale.stride(1),
            HAS_MAP=expert_map is not None, TOPK=triton.next_power_of_2(topk),
            BLOCK_K=min(triton.next_power_of_2(K), 1024), BLOCK_G=triton.next_power_of_2(G),
        )  # fmt: skip
    if num_rows > 0:
        _block_experts_kernel[(num_rows // ALIGN,)](
            counts, layout.expert_start, layout.cursor, layout.m_indices, layout.block_rows, layout.flags,
            E, num_rows,
            ALIGN_M=ALIGN, BLOCK_E=BLOCK_E,
        )  # fmt: skip
    return layout


__all__ = [
    "ALIGN",
    "MISMATCH",
    "OVERFLOW",
    "ContiguousLayout",
    "alloc_layout",
    "column_major_scale",
    "permute_to_contiguous",
    "unpermute_from_contiguous",
]
