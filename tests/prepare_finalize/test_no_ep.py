"""NoEPPrepareFinalize: quantize (or pass through) before, weight and sum over topk after."""

from __future__ import annotations

import pytest
import torch

from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import FP8, FP8_GROUP, dequantize_fp8_per_token_group, quantize_fp8_per_token_group
from moekit.reference import count_reference
from moekit.testing import assert_close
from moekit.types import ActivationFormat, ExpertPlacement, QuantScheme


def _inputs(M, K, E, topk, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).to(torch.int32)
    weights = torch.rand(M, topk, generator=g) + 0.1
    return hidden, weights, ids.reshape(M, topk)


def test_unquantized_prepare_passes_through():
    hidden, weights, ids = _inputs(5, 16, 4, 2)
    placement = ExpertPlacement(4, 4)
    p = NoEPPrepareFinalize().prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=placement)
    assert p.a1q is hidden and p.a1q_scale is None and p.tokens_meta is None
    assert p.topk_ids is ids and p.topk_weights is weights
    assert NoEPPrepareFinalize.activation_format is ActivationFormat.STANDARD


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [256, 200])  # 200: the last 1x128 group is partial
def test_fp8_block_quantizes_activations_per_group(dtype, K):
    hidden, weights, ids = _inputs(6, K, 4, 2)
    hidden = hidden.to(dtype)
    p = NoEPPrepareFinalize().prepare(
        hidden, weights, ids, quant=QuantScheme.FP8_BLOCK, placement=ExpertPlacement(4, 4)
    )
    assert p.a1q.dtype == FP8 and p.a1q.shape == (6, K)
    assert p.a1q_scale.dtype == torch.float32 and p.a1q_scale.shape == (6, -(-K // FP8_GROUP))
    q, s = quantize_fp8_per_token_group(hidden)
    assert torch.equal(p.a1q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(p.a1q_scale, s)
    assert_close(dequantize_fp8_per_token_group(p.a1q, p.a1q_scale), hidden, dtype=FP8)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "E_global, E_local, emap",
    [(6, 6, None), (8, 3, torch.tensor([-1, 2, -1, 0, -1, -1, 1, -1], dtype=torch.int32))],
)
def test_return_counts_metadata(E_global, E_local, emap):
    hidden, weights, ids = _inputs(9, 16, E_global, 3)
    ids[1, 2] = -1
    pf = NoEPPrepareFinalize(return_counts=True)
    p = pf.prepare(
        hidden, weights, ids, quant=QuantScheme.NONE, placement=ExpertPlacement(E_global, E_local, emap)
    )
    meta = p.tokens_meta
    expected = count_reference(ids, E_local, emap)
    assert meta.expert_num_tokens.dtype == torch.int32 and meta.expert_num_tokens.shape == (E_local,)
    assert torch.equal(meta.expert_num_tokens, expected)
    assert meta.expert_num_tokens_cpu is not None and meta.expert_num_tokens_cpu.device.type == "cpu"
    assert torch.equal(meta.expert_num_tokens_cpu, expected.cpu())
    assert repr(pf) == "NoEPPrepareFinalize(return_counts=True)"


@pytest.mark.interpreter
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_finalize_weights_and_sums_over_topk(out_dtype):
    M, K, topk = 7, 16, 3
    hidden, weights, ids = _inputs(M, K, 5, topk)
    pf = NoEPPrepareFinalize()
    p = pf.prepare(hidden, weights, ids, quant=QuantScheme.NONE, placement=ExpertPlacement(5, 5))
    fused = torch.randn(M, topk, K).to(out_dtype)
    output = torch.full((M, K), 3.0, dtype=out_dtype)  # finalize overwrites, it does not add
    assert pf.finalize(fused, p, output=output) is output
    expected = torch.zeros(M, K)
    for m in range(M):
        for j in range(topk):
            expected[m] += weights[m, j] * fused[m, j].float()
    assert_close(output, expected, dtype=out_dtype)
