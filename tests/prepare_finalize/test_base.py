"""moekit.prepare_finalize.base: the helpers every stage shares, and what each stage declares."""

from __future__ import annotations

import pytest
import torch

from moekit.prepare_finalize import All2AllPrepareFinalize, BatchedPrepareFinalize, NoEPPrepareFinalize
from moekit.prepare_finalize.base import PrepareFinalize, quantize_activations, weight_and_reduce
from moekit.quant import FP8, FP8_GROUP, quantize_fp8_per_token_group
from moekit.testing import assert_close
from moekit.types import ActivationFormat, QuantScheme


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unquantized_activations_pass_through(device, dtype):
    x = torch.randn(5, 64, device=device, dtype=dtype)
    a1q, scale = quantize_activations(x, QuantScheme.NONE)
    assert a1q is x and scale is None


@pytest.mark.parametrize("M, K", [(1, 128), (7, 256), (33, 384)])
def test_fp8_block_activations_match_the_torch_spec(device, M, K):
    x = (torch.randn(M, K) * torch.logspace(-2, 1, K)).to(torch.bfloat16).to(device)
    a1q, scale = quantize_activations(x, QuantScheme.FP8_BLOCK)
    assert a1q.dtype == FP8 and a1q.shape == (M, K)
    assert scale.dtype == torch.float32 and scale.shape == (M, K // FP8_GROUP)
    q_ref, s_ref = quantize_fp8_per_token_group(x)
    torch.testing.assert_close(scale, s_ref, rtol=1e-6, atol=0)
    assert torch.equal(a1q.float(), q_ref.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, topk, K", [(1, 1, 64), (9, 2, 128), (40, 4, 96)])
def test_weight_and_reduce_is_the_weighted_sum_over_slots(device, dtype, M, topk, K):
    fused = torch.randn(M, topk, K, device=device, dtype=dtype)
    weights = torch.rand(M, topk, device=device) + 0.1
    output = torch.full((M, K), float("nan"), device=device, dtype=dtype)
    got = weight_and_reduce(fused, weights, output)
    assert got is output and not got.isnan().any()
    expected = (fused.float() * weights.unsqueeze(-1)).sum(1)
    assert_close(got, expected, dtype=dtype)


def test_weight_and_reduce_takes_a_non_contiguous_output_of_the_experts(device):
    fused = torch.randn(3, 6, 2, device=device).transpose(1, 2)  # [M, topk, K] strided
    weights = torch.rand(6, 2, device=device) + 0.1
    got = weight_and_reduce(fused, weights[:3], torch.empty(3, 6, device=device))
    assert_close(got, (fused * weights[:3].unsqueeze(-1)).sum(1), dtype=torch.float32)


@pytest.mark.parametrize(
    "cls, collective, dispatches, fmt",
    [
        (NoEPPrepareFinalize, False, False, ActivationFormat.STANDARD),
        (BatchedPrepareFinalize, False, True, ActivationFormat.BATCHED),
        (All2AllPrepareFinalize, True, True, ActivationFormat.STANDARD),
    ],
)
def test_class_flags(cls, collective, dispatches, fmt):
    assert issubclass(cls, PrepareFinalize)
    assert (cls.collective, cls.dispatches, cls.activation_format) == (collective, dispatches, fmt)


def test_base_defaults_and_names():
    assert (PrepareFinalize.collective, PrepareFinalize.dispatches) == (False, False)
    assert PrepareFinalize.activation_format is ActivationFormat.STANDARD
    stage = BatchedPrepareFinalize(max_tokens=4)
    assert stage.name == "BatchedPrepareFinalize"
    with pytest.raises(TypeError):
        PrepareFinalize()  # abstract: prepare and finalize
