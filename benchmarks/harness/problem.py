"""The problem a benchmark runs, built by :func:`moekit.testing.make_problem`, and its oracle.

- :func:`build_problem`: one named layer shape at M tokens (weights ``randn / sqrt(fan_in)``,
  fp8 block-quantized a block of experts at a time on the target device; seeded routing, uniform
  or skewed), so every peer sees the same tokens;
- :func:`with_tokens`: another draw of activations and routing that shares a problem's weights
  (the input sets a CUDA graph cycles through);
- :func:`reference_for`: the fp32 oracle on a sample of rows: :meth:`MoEProblem.reference` when
  an fp32 copy of the weights is small, else :func:`blockwise_reference`, which dequantizes a
  block of experts at a time (a DeepSeek-V3 layer's weights are 45 GB in fp32).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks.harness.common import quant_of
from moekit.roofline import LayerShape
from moekit.testing import MoEProblem, make_problem
from moekit.types import QuantScheme

ROUTER_SKEW = {"uniform": 0.0, "skewed": 1.2}  # moekit.routing.skewed_router's skew per --router
WHOLE_REFERENCE_BYTES = 8 * 2**30  # fp32 weights up to this size are dequantized whole


def build_problem(shape: LayerShape, M: int, dtype: str, *, router: str = "uniform", seed: int = 0,
                  device) -> MoEProblem:
    """``shape`` at M tokens: bf16 activations, bf16 or fp8 block (``dtype="fp8"``) weights."""
    return make_problem(M, E=shape.E, topk=shape.topk, K=shape.K, N=shape.N, dtype=torch.bfloat16,
                        quant=quant_of(dtype), skew=ROUTER_SKEW[router], seed=seed, device=device)  # fmt: skip


def with_tokens(problem: MoEProblem, M: int, *, router: str = "uniform", seed: int) -> MoEProblem:
    """Fresh seeded activations and routing for M tokens, sharing ``problem``'s weights."""
    from moekit.routing import skewed_router

    device = problem.w1.device
    E, topk, K = problem.w1.shape[0], problem.topk_ids.shape[1], problem.w1.shape[2]
    r = skewed_router(M, E, topk, skew=ROUTER_SKEW[router], seed=seed, device=device)
    g = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(M, K, generator=g, device=device).to(problem.hidden.dtype)
    return replace(problem, hidden=hidden, topk_weights=r.topk_weights, topk_ids=r.topk_ids)


def restrict(problem: MoEProblem, rows: torch.Tensor) -> MoEProblem:
    """The same layer on the tokens ``rows`` only (an index tensor)."""
    return replace(problem, hidden=problem.hidden[rows], topk_weights=problem.topk_weights[rows],
                   topk_ids=problem.topk_ids[rows])  # fmt: skip


def blockwise_reference(problem: MoEProblem, *, block: int = 16) -> torch.Tensor:
    """fp32 ``[M, K]``: :meth:`MoEProblem.reference`, dequantizing ``block`` experts at a time
    (for a problem without an expert_map, as :func:`build_problem` makes)."""
    from moekit.quant import dequantize_fp8_block, dequantize_fp8_per_token_group, quantize_fp8_per_token_group
    from moekit.reference import moe_reference

    fp8 = problem.quant is QuantScheme.FP8_BLOCK
    hidden = problem.hidden
    if fp8:  # compare on the activations the experts actually see
        hidden = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(hidden))
    ids, E = problem.topk_ids, problem.w1.shape[0]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e0 in range(0, E, block):
        e1 = min(E, e0 + block)
        if not ((ids >= e0) & (ids < e1)).any():
            continue
        a, b = problem.w1[e0:e1], problem.w2[e0:e1]
        if fp8:
            a, b = dequantize_fp8_block(a, problem.w1_scale[e0:e1]), dequantize_fp8_block(b, problem.w2_scale[e0:e1])
        emap = torch.full((E,), -1, dtype=torch.int32, device=hidden.device)  # this block's experts are local
        emap[e0:e1] = torch.arange(e1 - e0, dtype=torch.int32, device=hidden.device)
        out += moe_reference(hidden, a, b, problem.topk_weights, ids, expert_map=emap)
    return out


def reference_for(problem: MoEProblem, rows: torch.Tensor) -> torch.Tensor:
    """fp32 oracle output of ``rows`` (fp8: on the fp8-rounded activations the experts see)."""
    sub = restrict(problem, rows)
    fp32_weight_bytes = 4 * (problem.w1.numel() + problem.w2.numel())
    if fp32_weight_bytes <= WHOLE_REFERENCE_BYTES:
        return sub.reference()
    return blockwise_reference(sub)
