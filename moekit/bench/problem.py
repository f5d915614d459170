"""The problem a benchmark runs: random weights, routing and activations, and its oracle.

Weights are ``randn / sqrt(fan_in)`` in bf16 (so activations stay O(1) through both GEMMs), or
fp8 e4m3 with 128x128 block scales, quantized a block of experts at a time. Routing comes from
:mod:`moekit.routing` (uniform or skewed), seeded, so every peer sees the same tokens.
"""

from __future__ import annotations

import torch

from moekit.bench import measure, shapes
from moekit.bench.peers import LayerInputs


def make_weights(shape: shapes.LayerShape, dtype: str, *, seed: int, block: int = 16, device="cuda"):
    """Random ``w1 [E, N, K]``, ``w2 [E, K, I]`` scaled by 1/sqrt(fan_in); fp8 block-quantized
    one block of experts at a time (no fp32 copy of a whole DeepSeek-V3 layer)."""
    from moekit.quant import FP8, quantize_fp8_block

    g = torch.Generator(device).manual_seed(seed)
    wdtype = FP8 if dtype == "fp8" else torch.bfloat16
    dims = {"w1": (shape.N, shape.K), "w2": (shape.K, shape.I)}
    out, scales = {}, {}
    for name, (R, C) in dims.items():
        w = torch.empty(shape.E, R, C, dtype=wdtype, device=device)
        s = torch.empty(shape.E, -(-R // 128), -(-C // 128), device=device) if dtype == "fp8" else None
        for e0 in range(0, shape.E, block):
            e1 = min(shape.E, e0 + block)
            part = torch.randn(e1 - e0, R, C, device=device, dtype=torch.bfloat16, generator=g) * C**-0.5
            if s is None:
                w[e0:e1] = part
            else:
                w[e0:e1], s[e0:e1] = quantize_fp8_block(part)
        out[name], scales[name] = w, s
    return out["w1"], out["w2"], scales["w1"], scales["w2"]


def make_inputs(shape: shapes.LayerShape, M: int, weights, *, router: str, seed: int,
                device="cuda") -> LayerInputs:
    """Seeded routing and bf16 activations for M tokens, sharing ``weights``."""
    from moekit.routing import skewed_router, uniform_router

    draw = uniform_router if router == "uniform" else skewed_router
    r = draw(M, shape.E, shape.topk, seed=seed, device=device)
    g = torch.Generator(device).manual_seed(seed + 12345)
    hidden = torch.randn(M, shape.K, device=device, dtype=torch.bfloat16, generator=g)
    w1, w2, s1, s2 = weights
    return LayerInputs(hidden, w1, w2, r.topk_weights, r.topk_ids, s1, s2)


def reference_for(x: LayerInputs, rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 oracle output of ``rows`` (fp8: on the fp8-rounded activations the experts see)."""
    hidden = x.hidden[rows]
    if dtype == "fp8":  # compare on the activations the experts actually see
        from moekit.quant import dequantize_fp8_per_token_group, quantize_fp8_per_token_group

        hidden = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(hidden))
    return measure.reference_rows(hidden, x.w1, x.w2, x.topk_weights[rows], x.topk_ids[rows],
                                  w1_scale=x.w1_scale, w2_scale=x.w2_scale)
