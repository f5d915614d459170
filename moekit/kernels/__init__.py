"""Triton kernels, one family per file: a private ``@triton.jit`` ``_name_kernel`` sits right
above the public launcher ``name`` that validates inputs, allocates the output and launches it.

- ``count``: ``count_expert_num_tokens``, tokens per local expert ("scan" and "histogram").
- ``align``: ``moe_align_block_size``, (token, slot) pairs sorted by expert, padded to a block.
- ``fused_moe``: grouped GEMM over aligned blocks (standard format).
- ``contiguous_gemm``: grouped GEMM in DeepGEMM's contiguous layout.
- ``batched_gemm``: batched-format GEMM masked by ``expert_num_tokens``.
- ``activation``: ``silu_and_mul``.

Every kernel runs on a CUDA GPU, or on the CPU through Triton's interpreter (see
:mod:`moekit.device`); the launchers take the same tensors either way.
"""
