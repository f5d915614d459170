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

The way back, :func:`unpermute_from_contiguous`, gathers GEMM2's rows into the experts' output
in (token, slot) order; slots without a row (empty, or another rank's expert) get zeros.

A chunk of the expert-sorted rows (``ModularKernel(chunk_by="rows")``) is already this layout:
:func:`gather_positions` fills it from the tokens by position (``moe_align_block_size``'s
``sorted_token_ids``), and :func:`scatter_positions` writes each row back to its (token, slot) row
of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekit.errors import InvalidInputError
from moekit.kernels.host_math import cdiv, next_power_of_2
from moekit.quant import FP8, FP8_GROUP
from moekit.types import ALIGN_M
from moekit.validate import check_ids

OVERFLOW = 1  # ContiguousLayout.flags bits
MISMATCH = 2


@dataclass
class ContiguousLayout:
    """The permuted activations and the indices that describe them (shapes: :mod:`moekit.kernels.permute`).

    ``expert_start`` is int32 ``[E + 1]``: where each expert's padded segment starts, and the
    total padded rows last. ``block_rows`` is int32 ``[M_sum / 128]``: rows holding data at the
    start of each 128-row block (0 for blocks of pure padding). ``cursor`` is scratch; after
    the permute it is ``expert_start[:-1]`` plus the pairs routed to each expert. ``flags`` is
    int32 ``[1]``: bit :data:`OVERFLOW` when ``counts`` undercount an expert or need more rows
    than M_sum (the rows that do not fit are dropped, never written out of bounds), bit
    :data:`MISMATCH` when ``counts`` differ at all from the pairs ``topk_ids`` route.
    """

    a: torch.Tensor
    a_scale: torch.Tensor
    m_indices: torch.Tensor
    inv_perm: torch.Tensor
    block_rows: torch.Tensor
    expert_start: torch.Tensor
    cursor: torch.Tensor
    flags: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.a.shape[0]


def index_sizes(num_rows: int, num_pairs: int, num_experts: int) -> tuple[int, ...]:
    """Lengths of the layout's int32 arrays, in field order: ``m_indices``, ``inv_perm``,
    ``block_rows``, ``expert_start``, ``cursor``, ``flags``."""
    return num_rows, num_pairs, num_rows // ALIGN_M, num_experts + 1, num_experts, 1


def alloc_layout(num_rows: int, K: int, num_pairs: int, num_experts: int, *, device) -> ContiguousLayout:
    """Fresh buffers for a layout of ``num_rows`` rows (experts carve theirs from workspaces)."""
    scale_storage = torch.empty(cdiv(K, FP8_GROUP), cdiv(num_rows, 4) * 4, dtype=torch.float32, device=device)
    a_scale = scale_storage[:, :num_rows].t()  # column-major, rows padded to 4 (TMA alignment)
    index = [torch.empty(n, dtype=torch.int32, device=device) for n in index_sizes(num_rows, num_pairs, num_experts)]
    return ContiguousLayout(torch.empty(num_rows, K, dtype=FP8, device=device), a_scale, *index)


@triton.jit
def _copy_rows(srcs, src_strides, src_rows, dsts, dst_strides, dst_rows, load_ok, store_ok, widths, BLOCKS):
    """For each tensor pair ``t``: ``dsts[t][dst_rows[i], :widths[t]] = srcs[t][src_rows[i], :widths[t]]``
    where ``store_ok``, zeros where not ``load_ok``; ``*_strides[t]`` are each 2-D tensor's (row, column)
    strides, ``BLOCKS[t]`` its column block. Every kernel of this file moves its rows with it."""
    for t in tl.static_range(len(srcs)):
        cols = tl.arange(0, BLOCKS[t])
        for c0 in range(0, widths[t], BLOCKS[t]):
            c = c0 + cols
            col_ok = c < widths[t]
            src = srcs[t] + src_rows[:, None] * src_strides[t][0] + c[None, :] * src_strides[t][1]
            x = tl.load(src, mask=load_ok[:, None] & col_ok[None, :], other=0.0)
            dst = dsts[t] + dst_rows[:, None] * dst_strides[t][0] + c[None, :] * dst_strides[t][1]
            tl.store(dst, x.to(dsts[t].dtype.element_ty), mask=store_ok[:, None] & col_ok[None, :])


def _copy_args(srcs: tuple[torch.Tensor, ...], dsts: tuple[torch.Tensor, ...]) -> dict:
    """The kernel arguments that describe tensor pairs whose rows move together (see :func:`_copy_rows`):
    each destination's width is the columns moved."""
    widths = tuple([dst.shape[1] for dst in dsts])  # (list comprehensions: a launch's host time counts)
    return dict(
        srcs=srcs,
        dsts=dsts,
        widths=widths,
        src_strides=tuple([src.stride() for src in srcs]),
        dst_strides=tuple([dst.stride() for dst in dsts]),
        BLOCKS=tuple([min(next_power_of_2(w), 1024) for w in widths]),
    )


@triton.jit
def _expert_offsets_kernel(
    # Pointers
    counts_ptr,
    expert_start_ptr,
    cursor_ptr,
    flags_ptr,
    # Sizes
    num_experts,
    num_rows,
    # Meta-parameters
    ALIGN_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
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
    # Pointers (srcs: a1q and a1q_scale, dsts: the layout's a and a_scale; see _copy_rows)
    srcs,
    dsts,
    topk_ids_ptr,
    expert_map_ptr,
    inv_perm_ptr,
    expert_start_ptr,
    cursor_ptr,
    flags_ptr,
    # Sizes (widths: K and G; each strides tuple holds one (row, column) pair per tensor)
    widths,
    topk,
    num_experts,
    num_global,
    num_rows,
    src_strides,
    dst_strides,
    # Meta-parameters
    HAS_MAP: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, TOPK)
    jmask = j < topk
    ids = tl.load(topk_ids_ptr + m * topk + j, mask=jmask, other=-1).to(tl.int32)
    if HAS_MAP:  # the map's entry is compared in its own dtype: 2**32 + 1 must not wrap to 1
        in_map = jmask & (ids >= 0) & (ids < num_global)
        entry = tl.load(expert_map_ptr + ids, mask=in_map, other=-1)
        valid = jmask & (entry >= 0) & (entry < num_experts)
        local = tl.where(valid, entry, -1).to(tl.int32)
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

    # Every slot of token m copies the token's row (and scales) to its own row of the layout.
    dest64 = dest.to(tl.int64)
    token = tl.zeros_like(dest64) + m
    _copy_rows(srcs, src_strides, token, dsts, dst_strides, dest64, ok, ok, widths, BLOCKS)


@triton.jit
def _block_experts_kernel(
    # Pointers
    counts_ptr,
    expert_start_ptr,
    cursor_ptr,
    m_indices_ptr,
    block_rows_ptr,
    flags_ptr,
    # Sizes
    num_experts,
    num_rows,
    # Meta-parameters
    ALIGN_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
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
        raise InvalidInputError(
            f"a1q must be float8_e4m3fn [M, K] with unit column stride, got {a1q.dtype} {a1q.stride()}"
        )
    G = cdiv(K, FP8_GROUP)
    if tuple(a1q_scale.shape) != (M, G) or a1q_scale.dtype != torch.float32:
        raise InvalidInputError(f"a1q_scale must be float32 {(M, G)}, got {a1q_scale.dtype} {tuple(a1q_scale.shape)}")
    if topk_ids.shape[0] != M or counts.dtype != torch.int32 or counts.dim() != 1 or E == 0:
        raise InvalidInputError(
            f"expected topk_ids [M={M}, topk] and int32 counts [E>0], got {tuple(topk_ids.shape)} and "
            f"{counts.dtype} {tuple(counts.shape)}"
        )
    if num_rows % ALIGN_M:
        raise InvalidInputError(f"num_rows must be a multiple of {ALIGN_M}, got {num_rows}")
    layout = out if out is not None else alloc_layout(num_rows, K, M * topk, E, device=a1q.device)
    if tuple(layout.a.shape) != (num_rows, K) or layout.inv_perm.numel() != M * topk or layout.cursor.numel() != E:
        raise InvalidInputError(
            f"layout buffers are a {tuple(layout.a.shape)}, inv_perm {layout.inv_perm.numel()}, cursor "
            f"{layout.cursor.numel()}; expected {(num_rows, K)}, {M * topk}, {E}"
        )
    return launch_permute(a1q, a1q_scale, topk_ids, counts, layout, expert_map=expert_map)


def launch_permute(a1q, a1q_scale, topk_ids, counts, layout: ContiguousLayout, *, expert_map=None) -> ContiguousLayout:
    """:func:`permute_to_contiguous` without its checks, into ``layout``'s buffers (for the experts)."""
    M = a1q.shape[0]
    topk, E, num_rows = topk_ids.shape[1], counts.numel(), layout.a.shape[0]
    BLOCK_E = next_power_of_2(E)
    _expert_offsets_kernel[(1,)](
        counts, layout.expert_start, layout.cursor, layout.flags, E, num_rows, ALIGN_M=ALIGN_M, BLOCK_E=BLOCK_E
    )
    if M > 0:
        emap = expert_map if expert_map is not None else topk_ids  # a dummy pointer when unused
        _scatter_rows_kernel[(M,)](
            topk_ids_ptr=topk_ids,
            expert_map_ptr=emap,
            inv_perm_ptr=layout.inv_perm,
            expert_start_ptr=layout.expert_start,
            cursor_ptr=layout.cursor,
            flags_ptr=layout.flags,
            topk=topk,
            num_experts=E,
            num_global=emap.numel() if expert_map is not None else E,
            num_rows=num_rows,
            HAS_MAP=expert_map is not None,
            TOPK=next_power_of_2(topk),
            **_copy_args((a1q, a1q_scale), (layout.a, layout.a_scale)),
        )
    if num_rows > 0:
        _block_experts_kernel[(num_rows // ALIGN_M,)](
            counts,
            layout.expert_start,
            layout.cursor,
            layout.m_indices,
            layout.block_rows,
            layout.flags,
            E,
            num_rows,
            ALIGN_M=ALIGN_M,
            BLOCK_E=BLOCK_E,
        )
    return layout


@triton.jit
def _move_rows_kernel(
    # Pointers (srcs, dsts: tensors whose rows move together; see _copy_rows)
    srcs,
    dsts,
    index_ptr,
    expert_ids_ptr,
    # Sizes (widths: the columns moved per tensor; each strides tuple holds one (row, column) pair per tensor)
    num_rows,
    limit,
    divisor,
    widths,
    src_strides,
    dst_strides,
    # Meta-parameters
    SCATTER: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    idx = tl.load(index_ptr + r, mask=r_ok, other=-1)
    live = (idx >= 0) & (idx < limit)  # -1 (no row, or past the index) and ``limit`` (padding) are dead
    if SCATTER:  # dst[idx[r]] = src[r]: zeros for blocks of expert -1 (another rank's), dead rows skipped
        local = tl.load(expert_ids_ptr + r // EXPERT_BLOCK, mask=r_ok, other=-1) >= 0
        _copy_rows(srcs, src_strides, r, dsts, dst_strides, idx.to(tl.int64), live & local, live, widths, BLOCKS)
    else:  # dst[r] = src[idx[r] // divisor]: zeros for dead rows
        src_rows = (idx // divisor).to(tl.int64)  # divided in int32: cheaper than int64
        _copy_rows(srcs, src_strides, src_rows, dsts, dst_strides, r, live, r_ok, widths, BLOCKS)


def _move_rows(srcs, dsts, index: torch.Tensor, *, limit: int, divisor: int = 1, expert_ids=None, expert_block=1):
    """One launch of :func:`_move_rows_kernel` over the rows of ``index`` (int32): the gather
    ``dst[r] = src[index[r] // divisor]``, or with ``expert_ids`` the scatter ``dst[index[r]] = src[r]``
    (zeros from blocks of ``expert_block`` rows whose expert id is -1). Indices outside ``[0, limit)``
    are dead: a gather writes zeros for them, a scatter skips them."""
    if index.numel() == 0:
        return
    BLOCK_R = 8
    _move_rows_kernel[(cdiv(index.numel(), BLOCK_R),)](
        index_ptr=index,
        expert_ids_ptr=expert_ids if expert_ids is not None else index,  # a dummy pointer when unused
        num_rows=index.numel(),
        limit=limit,
        divisor=divisor,
        SCATTER=expert_ids is not None,
        EXPERT_BLOCK=expert_block,
        BLOCK_R=BLOCK_R,
        **_copy_args(srcs, dsts),
    )


def unpermute_from_contiguous(rows: torch.Tensor, inv_perm: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """Gather the layout's rows back into ``out``, one row per (token, slot); empty slots get zeros.

    In plain Python (``pair = m * topk + j``)::

        for pair in range(M * topk):
            r = inv_perm[pair]
            out.view(-1, K)[pair] = rows[r] if r >= 0 else 0

    ``out`` is written through ``out.view(-1, K)``, as upstream's ``index_select(..., out=
    output.view(-1, K))`` did after PR #20392: the experts' output is ``[M, topk, K]``, and a
    pre-fix ``[M * topk, K]`` one is written the same way.

    Upstream (2025-07) computed the rows of non-local experts with expert 0's weights and
    relied on their router weights being 0 at finalize; moekit writes zeros instead, as its
    Triton experts do, so the result is right whatever those weights are.

    Args:
        rows: ``[M_sum, >=K]`` GEMM2 output (unit column stride). inv_perm: int32 ``[M * topk]``.
        out: ``M * topk`` rows of ``K`` (``[M, topk, K]``, or ``[M * topk, K]``), contiguous rows,
            written in place and returned.
    """
    if rows.dim() != 2 or rows.stride(1) != 1 or out.dim() < 2 or out.stride(-1) != 1:
        raise InvalidInputError(
            f"expected rows [M_sum, K] and out [..., K] with unit last strides, got "
            f"{tuple(rows.shape)} {rows.stride()} and {tuple(out.shape)} {out.stride()}"
        )
    K = out.shape[-1]
    pairs = out.numel() // K if K else 0
    if inv_perm.numel() != pairs or rows.shape[1] < K:
        raise InvalidInputError(
            f"inv_perm must have one entry per output row ({pairs}) and rows >= {K} columns, got "
            f"{inv_perm.numel()} and {rows.shape[1]}"
        )
    _move_rows((rows,), (out.view(-1, K),), inv_perm, limit=rows.shape[0])
    return out


def gather_positions(
    a1q: torch.Tensor,
    a1q_scale: torch.Tensor,
    sorted_ids: torch.Tensor,
    *,
    numel: int,
    topk: int,
    out: torch.Tensor,
    out_scale: torch.Tensor,
) -> None:
    """``out[r] = a1q[sorted_ids[r] // topk]`` (and its scales) for a chunk of sorted rows.

    In plain Python::

        for r, pair in enumerate(sorted_ids):          # one chunk of moe_align_block_size's rows
            out[r], out_scale[r] = (a1q[pair // topk], a1q_scale[pair // topk]) if pair < numel else (0, 0)

    Args:
        a1q: fp8 ``[M, K]``; a1q_scale: fp32 ``[M, K/128]`` (any strides).
        sorted_ids: int32 ``[rows]``, pair indices (``numel`` for padding).
        out: fp8 ``[rows, K]`` (unit column stride); out_scale: fp32 ``[rows, K/128]`` (any strides,
            column-major for deep_gemm).
    """
    _move_rows((a1q, a1q_scale), (out, out_scale), sorted_ids, limit=numel, divisor=topk)


def scatter_positions(
    rows: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    numel: int,
    expert_block: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out.view(-1, K)[sorted_ids[r]] = rows[r]`` for a chunk of sorted rows; zeros for rows of a
    block whose expert id is -1 (another rank's expert, or kept empty slots). Padding is skipped.

    Args:
        rows: ``[R, >=K]`` GEMM2 output of the chunk (unit column stride).
        sorted_ids: int32 ``[R]`` pair per row; expert_ids: int32, one per ``expert_block`` rows.
        out: the whole-batch output, ``numel`` rows of ``K`` (``[M, topk, K]``), written in place.
    """
    flat = out.view(-1, out.shape[-1])
    _move_rows((rows,), (flat,), sorted_ids, limit=numel, expert_ids=expert_ids, expert_block=expert_block)
    return out
