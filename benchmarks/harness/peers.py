"""The contenders of one benchmark run, each a callable ``layer(problem) -> [M, K]``.

A problem is a :class:`moekit.testing.MoEProblem` (see :mod:`benchmarks.harness.problem`).

- ``grouped_mm``: a plain torch pipeline around ``torch._grouped_mm`` (bf16), no moekit kernel::

      order   = argsort(topk_ids.flatten())          # (token, slot) pairs grouped by expert
      offsets = searchsorted(sorted_ids, 0..E-1, right) # end row of each expert's group
      h = grouped_mm(x[order // topk], w1^T, offsets) # [M*topk, N]
      y = grouped_mm(silu_and_mul(h), w2^T, offsets)  # [M*topk, K]
      out[m] = sum_j topk_weights[m, j] * y[inverse(order)][m, j]

  Every step stays on the device with fixed shapes (no bincount, no ``.item()``), so it can be
  captured in a CUDA graph.
- ``triton_kernels``: OpenAI's triton_kernels ``matmul_ogs`` (persistent TMA GEMMs, SwiGLU fused in
  GEMM1, routing weights and the top-k sum in GEMM2), routed from the problem's ids; optional,
  detected, skipped with the reason when absent (:mod:`benchmarks.harness.tk_peer`).
- ``triton`` / ``triton_chunked``: moekit's HopperTritonExperts (the wing) through ModularKernel, one chunk or
  chunks of C tokens; ``triton_fused``: one chunk with silu_and_mul in GEMM1's epilogue
  (``HopperTritonExperts(fuse_activation=True)``); ``triton_graphed``: the one-chunk kernel through
  ``moekit.hopper.graphed.GraphedKernel``
  (its eager time is a CUDA-graph replay per call; inside the harness's own capture it runs the
  plain forward).
- ``deep_gemm`` / ``deep_gemm_triton``: DeepGemmExperts (fp8 block) on the real deep_gemm, or on
  moekit's Triton contiguous-layout GEMM.
- ``triton_or_deep_gemm``: the dispatching experts class.
"""

from __future__ import annotations

import torch

from benchmarks.harness.common import quant_of
from benchmarks.harness.peer_base import ExpertPermutation, Peer, permute_by_expert, skipped_peer
from moekit.errors import InvalidInputError, MoekitError
from moekit.quant import FP8
from moekit.testing import MoEProblem

PEERS = (
    "grouped_mm",
    "triton_kernels",
    "triton",
    "triton_fused",
    "triton_graphed",
    "triton_chunked",
    "deep_gemm",
    "deep_gemm_triton",
    "triton_or_deep_gemm",
)
DEFAULT_PEERS = {
    "bf16": ("grouped_mm", "triton_kernels", "triton", "triton_fused", "triton_chunked"),
    "fp8": ("triton", "deep_gemm_triton", "deep_gemm"),
}


# ----------------------------------------------------------------------------------------------
# The torch._grouped_mm pipeline, in pieces that are tested on the CPU.


def unpermute_and_reduce(y: torch.Tensor, perm: ExpertPermutation, topk_weights: torch.Tensor):
    """``out[m] = sum_j topk_weights[m, j] * y[pos(m, j)]`` in y's dtype (fp32 accumulation)."""
    M, topk = topk_weights.shape
    unsorted = torch.empty_like(y)
    unsorted[perm.order] = y  # back to (token, slot) order: [M*topk, K]
    w = topk_weights.to(y.dtype).view(M, 1, topk)
    return torch.bmm(w, unsorted.view(M, topk, -1)).view(M, -1)


def grouped_mm_moe(x: MoEProblem) -> torch.Tensor:
    """The whole layer with two ``torch._grouped_mm`` calls (bf16 weights only)."""
    if x.w1.dtype == FP8:
        raise InvalidInputError("the grouped_mm peer runs bf16 weights only, got float8_e4m3fn")
    E, N, _ = x.w1.shape
    perm = permute_by_expert(x.topk_ids, E)
    rows = x.hidden[perm.token]  # [M*topk, K]
    h = torch._grouped_mm(rows, x.w1.transpose(1, 2), offs=perm.offsets)  # [M*topk, N]
    a = torch.nn.functional.silu(h[:, : N // 2]) * h[:, N // 2 :]  # [M*topk, N/2]
    y = torch._grouped_mm(a, x.w2.transpose(1, 2), offs=perm.offsets)  # [M*topk, K]
    return unpermute_and_reduce(y, perm, x.topk_weights)


# ----------------------------------------------------------------------------------------------
# moekit's own experts through ModularKernel.


def _modular(name: str, experts, chunk_size: int | None, *, graphed: bool = False) -> Peer:
    from moekit.hopper.graphed import GraphedKernel
    from moekit.modular_kernel import ModularKernel
    from moekit.prepare_finalize import NoEPPrepareFinalize

    kernel = ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=chunk_size, trace_counts=False)
    call = GraphedKernel(kernel) if graphed else kernel

    def run(x: MoEProblem) -> torch.Tensor:
        return call(*x.inputs(), **x.options())

    def release() -> None:
        if kernel.pool is not None:
            kernel.pool.release()

    return Peer(name, run, release, kernel)


def make_peer(name: str, dtype: str, *, chunk_size: int = 1024) -> Peer:
    """Build peer ``name`` for ``dtype`` ("bf16" or "fp8"); a peer that cannot run here comes
    back with ``skipped`` set to the reason, instead of raising."""
    if name not in PEERS:
        raise InvalidInputError(f"peer must be one of {PEERS}, got {name!r}")
    quant = quant_of(dtype)
    if name == "grouped_mm":
        if dtype != "bf16":
            return skipped_peer(name, "torch._grouped_mm takes no 128x128 block scales (bf16 only)")
        if not hasattr(torch, "_grouped_mm"):
            return skipped_peer(name, f"torch {torch.__version__} has no torch._grouped_mm")
        return Peer(name, grouped_mm_moe)
    if name == "triton_kernels":
        from benchmarks.harness.tk_peer import make_tk_peer

        return make_tk_peer(name, dtype)
    try:
        if name in ("triton", "triton_fused", "triton_graphed", "triton_chunked"):
            from moekit.hopper.experts import HopperTritonExperts  # the wing: the harness measures H200 speed

            chunk = chunk_size if name == "triton_chunked" else None
            experts = HopperTritonExperts(quant=quant, fuse_activation=name == "triton_fused")
            return _modular(name, experts, chunk, graphed=name == "triton_graphed")
        if name == "triton_or_deep_gemm":
            from moekit.experts import TritonOrDeepGemmExperts

            return _modular(name, TritonOrDeepGemmExperts(quant=quant), None)
        if dtype != "fp8":
            return skipped_peer(name, "DeepGemmExperts is fp8 block only")
        from moekit.experts import DeepGemmExperts

        if name == "deep_gemm":
            from moekit.backends.deep_gemm import status

            st = status()
            if not st.usable:
                return skipped_peer(name, f"deep_gemm not usable: {st.reason}")
            return _modular(name, DeepGemmExperts(quant=quant, backend="deep_gemm"), None)
        return _modular(name, DeepGemmExperts(quant=quant, backend="triton"), None)
    except MoekitError as exc:  # the experts refuse this dtype or this machine
        return skipped_peer(name, f"{type(exc).__name__}: {exc}")
