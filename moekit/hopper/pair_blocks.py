"""One (token, slot) pair per block: a layout for decode that needs no align launch.

``moe_align_block_size`` sorts the pairs by expert so that a block of BM rows shares one
expert's weights. At decode there are only a few pairs (M=1 at top-8: 8 pairs, usually 8
different experts), so every block holds one pair and BM - 1 padding rows anyway. This layout
says so without computing anything: block ``b`` is pair ``b`` alone, and its expert is read by the
GEMM itself from ``topk_ids`` (through ``expert_map`` under expert parallelism), with the same
rules as the align (a remote expert or an empty slot: a zero row). So the forward launches one
kernel fewer, and the GEMMs need not wait for one (on an H200 the one-program align costs about
1.4 us at 8 pairs, and it is a dependent launch in front of GEMM1)::

    sorted_token_ids[b * BM : (b + 1) * BM] = [b, numel, ..., numel]     (never stored)
    expert_ids[b]                            = local expert of topk_ids.flat[b], or -1

Two pairs of one expert get two blocks, so that expert's weights are read twice (the second
time mostly from L2, as both programs run at once): worth it only for a handful of pairs
(``PAIR_MAX``). On the GPU the rows' results are the align layout's, bit for bit (each row of a
tile is its own dot product; under the interpreter numpy's matmul may round a row by its place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.kernels.align import check_layout_args

# Up to this many pairs TritonExperts skips the align (M <= 2 at top-8). Qwen3-30B-A3B bf16 on an H200,
# CUDA graphs, pairs / align (benchmarks/research/gpu_pdl.py --compare pairs, 2026-12-02): M=1 24.8 / 26.6 us,
# M=2 45.5 / 47.1, M=4 77.0 / 77.3 (level: from there an expert's weights are read twice more often).
PAIR_MAX = 16


@dataclass(frozen=True, eq=False)
class PairBlocks:
    """The layout described in the module docstring, for :func:`moekit.hopper.grouped_gemm.fused_moe_gemm`.

    ``ids`` are the flat ``topk_ids`` (contiguous), ``expert_map`` maps global to local ids (None:
    local = global, ``num_local`` of them). Has the sizes an :class:`~moekit.kernels.align.AlignedBlocks`
    has: ``numel`` pairs, ``block_m`` rows per block, ``max_padded = numel * block_m``.
    """

    ids: torch.Tensor
    expert_map: torch.Tensor | None
    global_num_experts: int
    num_local: int
    block_m: int

    @property
    def numel(self) -> int:
        return self.ids.numel()

    @property
    def max_padded(self) -> int:
        return self.numel * self.block_m

    @property
    def max_blocks(self) -> int:
        return self.numel

    def __repr__(self) -> str:
        return f"PairBlocks(numel={self.numel}, block_m={self.block_m})"


def pair_blocks(
    topk_ids: torch.Tensor,
    block_m: int,
    global_num_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    num_local_experts: int | None = None,
    check: bool = True,
) -> PairBlocks:
    """The one-pair-per-block layout of ``topk_ids`` (checked as ``moe_align_block_size`` checks them;
    ``check=False``, as the experts call it: not checked). Nothing is launched: the GEMMs read the ids.

    Empty slots (-1) and pairs of remote experts get zero rows (the align's ``keep_empty=True``).

    Raises:
        InvalidIdsError: ids or map not signed-integer and contiguous.
        InvalidInputError: a bad ``block_m``/``global_num_experts``, or a map of the wrong length.
    """
    if check:
        check_layout_args(topk_ids, block_m, global_num_experts, expert_map, num_local_experts, True)
    num_local = num_local_experts if num_local_experts is not None else global_num_experts
    return PairBlocks(topk_ids.view(-1), expert_map, global_num_experts, num_local, block_m)
