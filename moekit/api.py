"""``moekit.fused_moe``: the one-call entry point (NoEP prepare/finalize + experts by name)."""

from __future__ import annotations

import torch

from moekit.experts import experts_class
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.types import QuantScheme

_KERNELS: dict[tuple, ModularKernel] = {}


def fused_moe(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    experts: str = "triton",
    chunk_size: int | None = None,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one MoE layer: ``[M, K] -> [M, K]``.

    The quantization scheme follows the weights: fp8 ``w1``/``w2`` (with 128x128 block scales)
    select ``QuantScheme.FP8_BLOCK``, anything else runs unquantized. Kernels are cached per
    (experts, chunk size, scheme), so repeated calls reuse their workspace pool.

    Args:
        hidden: ``[M, K]`` activations. w1: ``[E, N, K]``. w2: ``[E, K, N/2]``.
        topk_weights, topk_ids: ``[M, topk]`` from :func:`moekit.routing.route`.
        experts: "triton", "deep_gemm" or "triton_or_deep_gemm".
        chunk_size: tokens per chunk (None: one chunk).
        expert_map, global_num_experts: expert parallelism within one process (see
            :class:`moekit.ModularKernel`).
        w1_scale, w2_scale: fp8 block scales.

    Example::

        weights, ids = moekit.routing.route(logits, topk=2)
        out = moekit.fused_moe(x, w1, w2, weights, ids, chunk_size=64)
    """
    quant = QuantScheme.FP8_BLOCK if w1.dtype == torch.float8_e4m3fn else QuantScheme.NONE
    key = (experts, chunk_size, quant)
    kernel = _KERNELS.get(key)
    if kernel is None:
        cls = experts_class(experts)
        kernel = ModularKernel(NoEPPrepareFinalize(), cls(quant=quant), chunk_size=chunk_size, trace_counts=False)
        _KERNELS[key] = kernel
    return kernel(
        hidden,
        w1,
        w2,
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        global_num_experts=global_num_experts,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
    )
