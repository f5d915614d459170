"""Triton kernels, one family per file: private ``@triton.jit`` kernels sit above the public
launcher that checks its arguments, allocates what it returns and launches them.

- ``count``: ``count_expert_num_tokens``, tokens per local expert (one-pass "histogram" and the
  seed's "scan").
- ``align``: ``moe_align_block_size``, (token, slot) pairs sorted by expert, padded to a block.
- ``pair_blocks``: ``pair_blocks``, one pair per block for decode (no align launch: the GEMMs
  read each pair's expert from the ids).
- ``fused_moe``: grouped GEMM over aligned blocks (standard format), with an optional fused
  silu_and_mul (+ fp8 1x128 requantization) epilogue for GEMM1; ``configs`` holds its tile table.
- ``permute``: DeepGEMM's contiguous layout (rows grouped by expert, padded to 128,
  ``m_indices``), and the gather back to (token, slot) order.
- ``contiguous_gemm``: grouped fp8 GEMM in that layout (moekit's own, when deep_gemm is absent).
- ``batched_gemm``: batched-format GEMM masked by ``expert_num_tokens``.
- ``activation``: ``silu_and_mul`` and ``silu_and_mul_fp8_group`` (fused 1x128 requantization).
- ``quant``: fp8 1x128 activation quantization (prepare).
- ``reduce``: ``weighted_topk_sum``, the finalize step (weight by topk and sum, one pass).

Every kernel runs on a CUDA GPU, or on the CPU through Triton's interpreter (see
:mod:`moekit.device`); the launchers take the same tensors either way.
"""
