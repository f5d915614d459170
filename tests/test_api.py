import pytest
import torch

import moekit
from moekit.errors import ChunkSizeError, InvalidInputError
from moekit.quant import (
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import moe_reference
from moekit.testing import assert_close


def layer(M=24, E=8, topk=2, K=128, N=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w1 = torch.randn(E, N, K, generator=g) / K**0.5
    w2 = torch.randn(E, K, N // 2, generator=g) / (N // 2) ** 0.5
    tw, ti = moekit.routing.skewed_router(M, E, topk, seed=seed, device="cpu")
    return x, w1, w2, tw, ti


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_fused_moe_triton_matches_reference(chunk_size):
    x, w1, w2, tw, ti = layer()
    out = moekit.fused_moe(x, w1, w2, tw, ti, chunk_size=chunk_size)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)


def test_fused_moe_fp8_weights_select_fp8_block():
    x, w1, w2, tw, ti = layer(M=9, E=4)
    q1, s1 = quantize_fp8_block(w1)
    q2, s2 = quantize_fp8_block(w2)
    out = moekit.fused_moe(x, q1, q2, tw, ti, experts="triton", w1_scale=s1, w2_scale=s2)
    xd = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(x))
    ref = moe_reference(xd, dequantize_fp8_block(q1, s1), dequantize_fp8_block(q2, s2), tw, ti)
    assert_close(out, ref, dtype=torch.float8_e4m3fn)


def test_fused_moe_names_bad_arguments():
    x, w1, w2, tw, ti = layer(M=4)
    with pytest.raises(InvalidInputError, match="experts must be one of"):
        moekit.fused_moe(x, w1, w2, tw, ti, experts="cutlass")
    with pytest.raises(ChunkSizeError):
        moekit.fused_moe(x, w1, w2, tw, ti, chunk_size=0)
