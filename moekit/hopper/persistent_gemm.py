"""The grouped GEMM as a persistent kernel: one program per SM walks every (row block, column) tile.

``_fused_moe_kernel`` launches one program per tile of an upper bound on the layout's blocks (no
host sync), so at large M the GPU runs waves of short programs, each paying its own prologue
(index loads, the first TMA and async copies) and tail, and the programs past the layout's end
still start and return. Here the grid is ``min(SMs, tiles)`` and each program strides over the
tiles (``tile = program, program + SMs, ...``), reading the layout's used rows on the device::

    used = cdiv(num_tokens_post_padded - row_base, BLOCK_M)     # not num_blocks: no empty programs
    for tile in range(program_id, used * cdiv(N, BLOCK_N), NUM_SMS):   # flattened with the k-loop
        pid_m, pid_n = grouped(tile)                            # GROUP_M row blocks share a column sweep
        expert = expert_ids[pid_m]                              # -1: another rank's, zero k-steps
        _tile(pid_m, pid_n, expert, k_steps = 0 if expert == -1 else cdiv(K, BLOCK_K))

The k-loop of one tile and the walk over tiles are one flattened loop (``tl.range(flatten=True)``),
so the software pipeline keeps loading the next tile's operands while this tile's epilogue
stores. Tiles are the same as ``_fused_moe_kernel``'s (``moekit.hopper.gemm_tile._tile``), so
the two kernels give bit-identical results on one GPU; a tile is computed by one program, with
no split along K (deterministic). ``KernelConfig(persistent=True)`` selects it; it has no
``TAIL_M`` variant (one tile shape per flattened loop). Under the interpreter it runs with
:data:`INTERPRETER_SMS` programs, so the CPU tests walk several tiles per program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.hopper.gemm_tile import _tile

INTERPRETER_SMS = 3  # programs of a persistent launch under the interpreter: each walks several tiles


@triton.jit(do_not_specialize=["numel", "num_blocks", "row_base", "expert_off", "post_off", "num_experts", "num_local"])
def _persistent_moe_kernel(
    # Pointers (as _fused_moe_kernel)
    a_ptr,
    w_ptr,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    blocks_ptr,
    out_scale_ptr,
    static_ptr,
    w_desc,
    a_desc,
    ids_ptr,
    map_ptr,  # PAIR_BLOCKS only, which this kernel does not take (the launcher refuses it)
    # Sizes
    N,
    K,
    numel,
    num_blocks,
    row_base,
    expert_off,
    post_off,
    num_experts,
    num_local,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_osm,
    stride_osg,
    stride_static,
    static_div,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PAIRS_PER_ROW: tl.constexpr,
    EVEN_K: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_GROUP: tl.constexpr,
    GATED: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    STATIC_OUT: tl.constexpr,
    W_TMA: tl.constexpr,
    A_TMA: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    FIX_ROUNDING: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TINY: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    READ_BY_POSITION: tl.constexpr,
    WRITE_BY_POSITION: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    NUM_SMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    tl.static_assert(not PAIR_BLOCKS, "the persistent kernel walks an aligned layout")
    sorted_ptr = blocks_ptr + row_base
    expert_ids_ptr = blocks_ptr + expert_off + row_base // EXPERT_BLOCK
    post = tl.load(blocks_ptr + post_off)
    # A chunk's workspace written by position gets every block (those past the layout: zeros);
    # otherwise only the laid-out blocks are walked.
    if WRITE_BY_POSITION:
        used = num_blocks
    else:
        used = tl.minimum(num_blocks, tl.cdiv(tl.maximum(post - row_base, 0), BLOCK_M))
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    k_all = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), used * num_pid_n, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        first_m = (tile // per_group) * GROUP_M
        group_m = tl.minimum(used - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        row0 = pid_m * BLOCK_M
        expert = tl.load(expert_ids_ptr + row0 // EXPERT_BLOCK).to(tl.int64)
        expert = tl.where(row_base + row0 >= post, -1, expert)
        _tile(
            a_ptr,
            w_ptr,
            out_ptr,
            a_scale_ptr,
            w_scale_ptr,
            sorted_ptr,
            out_scale_ptr,
            static_ptr,
            w_desc,
            a_desc,
            row0,
            pid_n,
            expert,
            N,
            K,
            numel,
            tl.where(expert == -1, 0, k_all),
            stride_am,
            stride_ak,
            stride_we,
            stride_wn,
            stride_wk,
            stride_om,
            stride_on,
            stride_asm,
            stride_ask,
            stride_wse,
            stride_wsn,
            stride_wsk,
            stride_osm,
            stride_osg,
            stride_static,
            static_div,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            PAIRS_PER_ROW,
            EVEN_K,
            IS_FP8,
            FP8_GROUP,
            GATED,
            QUANT_OUT,
            STATIC_OUT,
            W_TMA,
            A_TMA,
            UPCAST_BF16,
            DOT_IEEE,
            FIX_ROUNDING,
            FP8_MAX,
            TINY,
            READ_BY_POSITION,
            WRITE_BY_POSITION,
        )
