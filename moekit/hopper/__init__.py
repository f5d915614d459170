"""The wing: what exists for H200 speed, beside the book (``HopperTritonExperts`` and its kernels).

The book (``moekit/`` outside this folder) is what a learner's forward loads; this package imports
the book and never the reverse. It plugs in through one experts class,
:class:`moekit.hopper.experts.HopperTritonExperts`, which ``moekit.fused_moe``, the transformers
integration and the benchmark harness choose by default on a Hopper GPU (``experts="triton"``).

- ``experts``: ``HopperTritonExperts(TritonExperts)``: the book's steps with the pieces below.
- ``grouped_gemm`` (+ ``gemm_args``): the grouped GEMM
  with TMA weight tiles, tail tiles, fused silu_and_mul / fp8 epilogues and a persistent walk.
- ``configs`` (+ ``fused_moe_tiles.json``): the measured H200 tile table.
- ``align``: the align's one-launch fast paths; ``pair_blocks``: decode without an align.
- ``launch``: launches without Triton's per-call binding; ``pdl``: programmatic dependent launch.
- ``graphed``: a modular kernel whose calls replay a CUDA graph.
"""
