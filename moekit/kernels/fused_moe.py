"""Grouped GEMM over aligned blocks (Standard format): the two GEMMs of ``TritonExperts``.

Shapes (numel = M * topk (token, slot) pairs, E local experts, BM = BLOCK_M)::

    a         [rows_a, K]     GEMM1: hidden [M, K] (pair i reads row i // topk)
                              GEMM2: activations [M * topk, K] (pair i reads row i)
    w         [E, N, K]       one [N, K] matrix per expert (w1, or w2 with N = hidden size)
    out       [M, topk, N]    out[m, j] = pair (m, j)'s result, unweighted
    blocks    AlignedBlocks   BM-row blocks of pairs, one expert each (moe_align_block_size)
    fp8 only: a_scale [rows_a, K/128] (1 x 128 groups), w_scale [E, N/128, K/128] (128 x 128 blocks)

The algorithm (fp32 accumulation; fp8 dequantizes every k-step with its two scales)::

    for block in range(num_tokens_post_padded // BM):         # one program per (block, column tile)
        e = expert_ids[block]
        for i in sorted_token_ids[block * BM : (block + 1) * BM]:
            if i == numel:                                     # padding row
                continue
            out[i] = 0 if e == -1 else a[i // pairs_per_row] @ w[e].T

One program computes a ``BLOCK_M x BLOCK_N`` tile: the rows of one block (all of one expert)
times a column slice of that expert's matrix, like the Triton tutorial's matmul with one gather:
the rows come through ``sorted_token_ids``, so nothing is permuted in memory. A block of a
remote expert (expert id -1) writes zeros. The grid is sized by an upper bound on the blocks (no
host sync): programs past ``num_tokens_post_padded`` return at once.

A chunk of sorted rows (``ModularKernel(chunk_by="rows")``) computes only rows ``[start, end)`` of
the layout (:class:`RowWindow`), reading or writing them by their position in the chunk: GEMM1
gathers tokens and writes the chunk's workspace row by row, GEMM2 reads that workspace and
writes each pair's output row.

The Hopper wing (see the README) computes the same tiles with TMA, fused
epilogues, a persistent walk and PDL; its tests hold it to this kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import InvalidInputError, QuantizationError
from moekit.kernels.activation import round_for_store
from moekit.kernels.align import AlignedBlocks
from moekit.quant import FP8, FP8_GROUP

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one grouped GEMM: ``BLOCK_M`` rows by ``BLOCK_N`` columns per program,
    stepping ``BLOCK_K`` along K; ``GROUP_M`` row blocks share one sweep over the columns (so an
    expert's weight tiles are reused from L2). Tile sizes are powers of two >= 16."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"{type(self).__name__}.{name} must be a positive int, got {value!r}")
            if name.startswith("BLOCK") and (value < 16 or value & (value - 1)):
                raise InvalidInputError(f"{type(self).__name__}.{name} must be a power of two >= 16, got {value}")

    @property
    def launch(self) -> dict:
        """Keyword arguments for a kernel launch (the tile shape, warps and stages); a new dict."""
        return dict(
            BLOCK_M=self.BLOCK_M,
            BLOCK_N=self.BLOCK_N,
            BLOCK_K=self.BLOCK_K,
            GROUP_M=self.GROUP_M,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


# Few, large programs under the interpreter: its cost is per program and per k-step, not per
# element (BLOCK_K = 128 also suits fp8: one scale pair per k-step).
INTERPRETER_TILES = Tiles(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=1)


def pick_tiles(rows_per_expert: float, dtype: torch.dtype) -> Tiles:
    """The book's tile rule: small blocks when few rows go to each expert, larger ones as they grow.
    The Hopper wing replaces it with a measured table."""
    if interpreting():
        return INTERPRETER_TILES
    block_k = 128 if dtype == FP8 else 64
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    return Tiles(BLOCK_M=block_m, BLOCK_N=64 if block_m < 64 else 128, BLOCK_K=block_k)


@dataclass(frozen=True)
class RowWindow:
    """Rows ``[start, end)`` of the sorted layout that one GEMM call computes, instead of every
    block of the layout: the GEMMs of a chunk of sorted rows (``ModularKernel(chunk_by="rows")``).

    ``read`` and ``write`` say how rows are addressed: ``"pair"`` through ``sorted_token_ids``
    (activations row ``pair // pairs_per_row``, output row ``pair``), or ``"position"``: row r of a
    contiguous buffer of ``end - start`` rows, the chunk's workspace. GEMM1 of a row chunk reads by
    pair and writes by position; GEMM2 reads by position and writes by pair.
    """

    start: int
    end: int
    read: str = "pair"
    write: str = "pair"

    @property
    def rows(self) -> int:
        return self.end - self.start


@triton.jit
def _fused_moe_kernel(
    # Pointers
    a_ptr,
    w_ptr,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    layout_ptr,
    # Sizes
    N,
    K,
    numel,
    num_blocks,
    row_start,
    expert_off,
    post_off,
    expert_block,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_op,
    stride_on,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PAIRS_PER_ROW: tl.constexpr,
    IS_FP8: tl.constexpr,
    READ_BY_POSITION: tl.constexpr,
    WRITE_BY_POSITION: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    FIX_ROUNDING: tl.constexpr,
):
    # 1. Which tile: GROUP_M row blocks sweep the columns together (neighbouring blocks are
    #    usually the same expert, so its weight tiles come from L2 for all of them).
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    # 2. Its rows: BLOCK_M consecutive rows of the sorted layout (one int32 buffer: sorted pair
    #    ids from 0, expert ids from expert_off, the rows used at post_off), all of one expert.
    row0 = row_start + pid_m * BLOCK_M
    past_end = row0 >= tl.load(layout_ptr + post_off)
    if not WRITE_BY_POSITION:
        if past_end:
            return  # the grid is an upper bound: this block holds no pair
    expert = tl.load(layout_ptr + expert_off + row0 // expert_block)
    expert = tl.where(past_end, -1, expert).to(tl.int64)
    position = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # the row's place in this call's window
    pair = tl.load(layout_ptr + row0 + tl.arange(0, BLOCK_M))
    live = pair < numel  # padding rows hold numel
    if READ_BY_POSITION:
        a_row = position.to(tl.int64)
    else:
        a_row = tl.where(live, pair // PAIRS_PER_ROW, 0).to(tl.int64)
    if WRITE_BY_POSITION:
        dest = position.to(tl.int64)
        keep = position >= 0  # every position: padding rows get zeros (finite, never read back)
    else:
        dest = pair.to(tl.int64)
        keep = live
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + dest[:, None] * stride_op + offs_n[None, :] * stride_on
    out_mask = keep[:, None] & (offs_n[None, :] < N)
    if expert == -1:  # another rank's expert (or past the used rows of a chunk's workspace)
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=out_mask)
        return

    # 3. The product, one BLOCK_K step at a time, accumulated in fp32.
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=live[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if IS_FP8:  # one scale per 1 x 128 group of a row, one per 128 x 128 block of w
            group = (k * BLOCK_K) // 128
            a_s = tl.load(a_scale_ptr + a_row * stride_asm + group * stride_ask, mask=live, other=0.0)
            w_s = tl.load(
                w_scale_ptr + expert * stride_wse + (offs_n // 128) * stride_wsn + group * stride_wsk,
                mask=offs_n < N,
                other=0.0,
            )
            acc += tl.dot(a, b) * (a_s[:, None] * w_s[None, :])
        else:
            if UPCAST_BF16:  # the interpreter multiplies bf16 bit patterns in tl.dot (FACTS.md)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if DOT_IEEE:  # fp32 stays fp32 (no tf32), so that fp32 results match the reference
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    # 4. Each live row goes to its pair's row of out (or its position in the chunk's workspace).
    if FIX_ROUNDING:  # the interpreter truncates fp32 -> bf16 casts: round to nearest first
        acc = round_for_store(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def check_rows(a, out, blocks, pairs_per_row, tiles, window: RowWindow | None) -> None:
    """The rows ``out`` and ``a`` must hold (one per pair, or one per position of a row chunk), and
    tiles that fit the blocks."""
    M, topk, _ = out.shape
    out_rows = window.rows if window is not None and window.write == "position" else blocks.numel
    if M * topk != out_rows:
        raise InvalidInputError(f"out must hold {out_rows} rows as [M, topk, N] (M*topk), got {tuple(out.shape)}")
    if M > 1 and topk > 1 and out.stride(0) != topk * out.stride(1):
        raise InvalidInputError(
            f"out's pairs must be evenly strided (stride(0) == topk * stride(1)), got {out.stride()}"
        )
    by_position = window is not None and window.read == "position"
    need = window.rows if by_position else blocks.numel
    if (
        not isinstance(pairs_per_row, int)
        or pairs_per_row <= 0
        or a.shape[0] * (1 if by_position else pairs_per_row) < need
    ):
        what = "positions" if by_position else "pairs"
        raise InvalidInputError(f"a has {a.shape[0]} rows for {need} {what} at pairs_per_row={pairs_per_row!r}")
    if (
        not isinstance(tiles, Tiles)
        or blocks.block_m % tiles.BLOCK_M
        or (window is None and tiles.BLOCK_M != blocks.block_m)
    ):
        raise InvalidInputError(
            f"tiles must be Tiles with BLOCK_M={blocks.block_m} (the blocks'; a divisor of it for a row chunk), "
            f"got {tiles!r}"
        )
    if window is not None and (
        window.read not in ("pair", "position")
        or window.write not in ("pair", "position")
        or window.start % blocks.block_m
        or window.rows % tiles.BLOCK_M
        or window.rows < 0
        or window.end > blocks.max_padded
    ):
        raise InvalidInputError(
            f"a row chunk must start on a block of {blocks.block_m} rows and hold whole tiles of {tiles.BLOCK_M} "
            f"inside the layout's {blocks.max_padded} rows, got {window}"
        )


def check_gemm_args(
    a, w, out, blocks, pairs_per_row, tiles, a_scale, w_scale, window=None, *, width=None, fp8_out=False
) -> bool:
    """Everything :func:`fused_moe_gemm` needs of its arguments; returns whether the GEMM is fp8.
    ``width`` (out's columns, N by default) and ``fp8_out`` (an fp8 ``out`` is allowed) are for
    GEMMs with another epilogue (the Hopper wing's fused activation)."""
    if a.dim() != 2 or w.dim() != 3 or out.dim() != 3:
        raise InvalidInputError(
            f"expected a [rows, K], w [E, N, K], out [M, topk, N]; got {tuple(a.shape)}, "
            f"{tuple(w.shape)}, {tuple(out.shape)}"
        )
    E, N, K = w.shape
    width = N if width is None else width
    if a.shape[1] != K or out.shape[2] != width:
        raise InvalidInputError(
            f"a must be [rows, K={K}] and out [M, topk, {width}], got {tuple(a.shape)} and {tuple(out.shape)}"
        )
    check_rows(a, out, blocks, pairs_per_row, tiles, window)
    fp8 = a.dtype == FP8  # both fp8, or both one of fp32/fp16/bf16
    if fp8 != (w.dtype == FP8):
        raise QuantizationError(f"a and w must both be fp8 or both not, got {a.dtype} and {w.dtype}")
    if not fp8 and (a.dtype != w.dtype or a.dtype not in _FLOATS):
        raise InvalidInputError(f"a and w must share a float dtype (fp32/fp16/bf16), got {a.dtype} and {w.dtype}")
    if out.dtype not in _FLOATS and not (fp8_out and out.dtype == FP8):
        raise InvalidInputError(f"out must be fp32/fp16/bf16, got {out.dtype}")
    if not fp8:
        return False
    # fp8: both scales, float32 and of their documented shapes, and whole 128-wide groups
    want_a, want_w = (a.shape[0], triton.cdiv(K, FP8_GROUP)), (E, triton.cdiv(N, FP8_GROUP), triton.cdiv(K, FP8_GROUP))
    for name, scale, want in (("a_scale", a_scale, want_a), ("w_scale", w_scale, want_w)):
        if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != want or scale.dtype != torch.float32:
            got = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
            raise QuantizationError(f"fp8 needs {name} float32 {want}, got {got}")
    if FP8_GROUP % tiles.BLOCK_K or K % FP8_GROUP or (width != N and width % FP8_GROUP):
        raise QuantizationError(
            f"fp8 block GEMM needs K (and a gated N/2) % 128 == 0 and BLOCK_K dividing 128, got K={K}, N={N}, "
            f"BLOCK_K={tiles.BLOCK_K}"
        )
    return fp8


def fused_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    blocks: AlignedBlocks,
    *,
    pairs_per_row: int,
    tiles: Tiles,
    a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    window: RowWindow | None = None,
    check: bool = True,
) -> torch.Tensor:
    """``out[i] = a[i // pairs_per_row] @ w[expert(i)].T`` for every placed pair i; zeros for remote ones.

    As the Triton tutorials do: (1) check the arguments, (2) launch the kernel; ``out`` is the
    caller's. Pairs that ``blocks`` did not place (dropped empty slots) are not written.

    Args:
        a: ``[rows, K]`` activations, bf16/fp16/fp32 or fp8 e4m3 (then with ``a_scale``).
        w: ``[E, N, K]`` weights of the same dtype (fp8 with ``w_scale``).
        out: ``[M, topk, N]`` with ``M * topk = blocks.numel`` (or the window's rows, written by
            position). Pair (m, j) is addressed through ``out.stride(1)`` and a column through
            ``out.stride(2)``, as upstream's launcher did, so a 2-D ``out`` fails right there with
            torch's IndexError: the crash of bug 1 (``ModularKernel``'s guard names it first).
        blocks: from :func:`moekit.kernels.align.moe_align_block_size` with ``tiles.BLOCK_M``.
        pairs_per_row: pairs that share a row of ``a``: topk for GEMM1, 1 for GEMM2.
        tiles: the launch shape (:class:`Tiles`).
        a_scale: fp8 only, float32 ``[rows, K/128]`` (any strides, e.g. column-major).
        w_scale: fp8 only, float32 ``[E, N/128, K/128]``.
        window: compute only rows ``[start, end)`` of the layout (:class:`RowWindow`).
        check: check the arguments first; the experts pass False (the modular kernel's door checked
            the forward, and nothing is checked again in every chunk).

    Raises:
        InvalidInputError: shapes or dtypes do not fit together, or BLOCK_M differs from the blocks'.
        QuantizationError: fp8 without the right scales, K % 128 != 0, or BLOCK_K not dividing 128.
    """
    stride_pair, stride_col = out.stride(1), out.stride(2)  # read first, as upstream's launcher did (bug 1)
    if check:
        if not isinstance(blocks, AlignedBlocks):
            raise InvalidInputError(f"blocks must be AlignedBlocks, got {type(blocks).__name__}")
        check_gemm_args(a, w, out, blocks, pairs_per_row, tiles, a_scale, w_scale, window)
    if out.shape[1] == 1:  # topk = 1: a size-1 dim's stride says nothing; pairs step by stride(0)
        stride_pair = out.stride(0)
    start, end = (0, blocks.max_padded) if window is None else (window.start, window.end)
    E, N, K = w.shape
    if blocks.numel == 0 or N == 0 or end == start:
        if window is not None and window.write == "position" and blocks.numel == 0:
            out.zero_()  # a chunk's workspace rows hold zeros, not stale bytes
        return out
    fp8 = a.dtype == FP8
    scales = (a_scale, w_scale, *a_scale.stride(), *w_scale.stride()) if fp8 else (a, w, 0, 0, 0, 0, 0)
    num_blocks = (end - start) // tiles.BLOCK_M
    grid = (num_blocks * triton.cdiv(N, tiles.BLOCK_N),)
    # the kernel's arguments, in the groups of its signature
    pointers = (a, w, out, scales[0], scales[1], blocks.buffer)
    sizes = (N, K, blocks.numel, num_blocks, start, blocks.expert_offset, blocks.post_offset, blocks.block_m)
    strides = (*a.stride(), *w.stride(), stride_pair, stride_col, *scales[2:])
    _fused_moe_kernel[grid](
        *pointers,
        *sizes,
        *strides,
        PAIRS_PER_ROW=pairs_per_row,
        IS_FP8=fp8,
        READ_BY_POSITION=window is not None and window.read == "position",
        WRITE_BY_POSITION=window is not None and window.write == "position",
        UPCAST_BF16=interpreting() and a.dtype == torch.bfloat16,
        DOT_IEEE=a.dtype == torch.float32,
        FIX_ROUNDING=interpreting(),
        **tiles.launch,
    )
    return out
