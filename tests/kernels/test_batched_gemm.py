"""batched_gemm: masked per-expert GEMMs against torch, padding rows never written."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.errors import InvalidInputError, QuantizationError
from moekit.kernels.batched_gemm import batched_gemm
from moekit.quant import (
    FP8,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.testing import assert_close, expect_raises

POISON = -12345.0  # exactly representable in bf16/fp16/fp32


def _operands(E, T, K, N, dtype, device="cpu"):
    a = torch.randn(E, T, K, device=device).to(dtype)
    b = (torch.randn(E, N, K, device=device) / K**0.5).to(dtype)
    return a, b


def _check(c, a, b, counts, dtype):
    for e, n in enumerate(counts.tolist()):
        n = min(n, a.shape[1])
        expected = a[e, :n].float() @ b[e].float().t()
        assert_close(c[e, :n], expected, dtype=dtype)
        assert (c[e, n:] == POISON).all(), f"padding rows of expert {e} were written"


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "E, T, K, N, counts",
    [
        (3, 20, 48, 40, [5, 0, 20]),  # an empty expert, a full one, one cut mid-tile
        (5, 17, 123, 30, [17, 1, 16, 0, 9]),  # weird shapes: K=123, E=5, T not a power of two
        (2, 70, 32, 16, [65, 64]),  # more than one row tile; a tile boundary exactly at n_e
    ],
)
def test_matches_torch_and_skips_padding(dtype, E, T, K, N, counts):
    a, b = _operands(E, T, K, N, dtype)
    counts = torch.tensor(counts, dtype=torch.int32)
    c = torch.full((E, T, N), POISON, dtype=dtype)
    assert batched_gemm(a, b, counts, out=c) is c
    _check(c, a, b, counts, dtype)


@pytest.mark.interpreter
def test_bf16_is_right_under_the_interpreter():
    """tl.dot on bf16 tiles multiplies bit patterns in the interpreter; the kernel upcasts."""
    a, b = _operands(2, 16, 64, 32, torch.bfloat16)
    counts = torch.tensor([16, 7], dtype=torch.int32)
    c = batched_gemm(a, b, counts)
    expected = a[0].float() @ b[0].float().t()
    assert c[0].float().abs().max() < 100  # the bit-pattern product is around 1e10
    assert_close(c[0], expected, dtype=torch.bfloat16)
    assert moekit.device.interpreting() == (moekit.device.get_device().type == "cpu")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_padding_writes_zeros_past_the_counts(dtype):
    E, T, K, N = 3, 40, 32, 24
    a, b = _operands(E, T, K, N, dtype)
    counts = torch.tensor([0, 17, 40], dtype=torch.int32)
    c = torch.full((E, T, N), float("nan"), dtype=dtype)
    batched_gemm(a, b, counts, out=c, zero_padding=True)
    for e, n in enumerate(counts.tolist()):
        assert_close(c[e, :n], a[e, :n].float() @ b[e].float().t(), dtype=dtype)
        assert (c[e, n:] == 0).all()


@pytest.mark.interpreter
def test_no_tokens_anywhere_writes_nothing():
    a, b = _operands(3, 8, 32, 16, torch.float32)
    c = torch.full((3, 8, 16), POISON)
    batched_gemm(a, b, torch.zeros(3, dtype=torch.int32), out=c)
    assert (c == POISON).all()


@pytest.mark.interpreter
def test_counts_above_T_are_clamped():
    a, b = _operands(2, 8, 32, 16, torch.float32)
    c = batched_gemm(a, b, torch.tensor([100, 3], dtype=torch.int32))
    assert_close(c[0], a[0] @ b[0].t(), dtype=torch.float32)


@pytest.mark.interpreter
def test_default_out_dtype_and_empty_slabs():
    a, b = _operands(2, 8, 32, 16, torch.float16)
    assert batched_gemm(a, b, torch.tensor([1, 2], dtype=torch.int32)).dtype == torch.float16
    empty = batched_gemm(a[:, :0], b, torch.zeros(2, dtype=torch.int32))
    assert empty.shape == (2, 0, 16)


@pytest.mark.interpreter
@pytest.mark.parametrize("K, N", [(256, 192), (200, 96)])
def test_fp8_block_scaled(K, N):
    E, T = 2, 16
    a = torch.randn(E * T, K)
    b = torch.randn(E, N, K) / K**0.5
    aq, a_s = quantize_fp8_per_token_group(a)
    bq, b_s = quantize_fp8_block(b)
    counts = torch.tensor([7, 16], dtype=torch.int32)
    c = torch.full((E, T, N), POISON, dtype=torch.bfloat16)
    batched_gemm(aq.view(E, T, K), bq, counts, out=c, a_scale=a_s.view(E, T, -1), b_scale=b_s)
    ad = dequantize_fp8_per_token_group(aq, a_s).view(E, T, K)
    bd = dequantize_fp8_block(bq, b_s)
    for e, n in enumerate(counts.tolist()):
        assert_close(c[e, :n], ad[e, :n] @ bd[e].t(), dtype=torch.bfloat16)
        assert (c[e, n:] == POISON).all()


def test_rejects_bad_operands():
    a, b = _operands(2, 8, 32, 16, torch.float32)
    ok = torch.tensor([1, 2], dtype=torch.int32)
    with expect_raises(InvalidInputError, match="b must be"):
        batched_gemm(a, b[:, :, :16], ok)
    with expect_raises(InvalidInputError, match="share a dtype"):
        batched_gemm(a, b.half(), ok)
    with expect_raises(InvalidInputError, match="int32"):
        batched_gemm(a, b, ok.long())
    with expect_raises(InvalidInputError, match="out must be"):
        batched_gemm(a, b, ok, out=torch.empty(2, 8, 15))
    with expect_raises(QuantizationError, match="not fp8"):
        batched_gemm(a, b, ok, a_scale=torch.ones(2, 8, 1))
    aq, bq = a.to(FP8), b.to(FP8)
    with expect_raises(QuantizationError, match="need both"):
        batched_gemm(aq, bq, ok)
    with expect_raises(QuantizationError, match="b_scale must be"):
        batched_gemm(aq, bq, ok, a_scale=torch.ones(2, 8, 1), b_scale=torch.ones(2, 2, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_larger(dtype):
    E, T, K, N = 8, 256, 512, 384
    a, b = _operands(E, T, K, N, dtype, device="cuda")
    counts = torch.randint(0, T + 1, (E,), dtype=torch.int32, device="cuda")
    counts[0] = 0
    c = torch.full((E, T, N), POISON, dtype=dtype, device="cuda")
    batched_gemm(a, b, counts, out=c)
    _check(c, a, b, counts, dtype)


@pytest.mark.gpu
def test_gpu_fp8_block_and_zero_padding():
    E, T, K, N = 4, 192, 512, 256
    a = torch.randn(E * T, K, device="cuda")
    b = torch.randn(E, N, K, device="cuda") / K**0.5
    aq, a_s = quantize_fp8_per_token_group(a)
    bq, b_s = quantize_fp8_block(b)
    counts = torch.tensor([0, 1, 100, 192], dtype=torch.int32, device="cuda")
    c = torch.full((E, T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    a_s3 = a_s.view(E, T, -1)
    batched_gemm(aq.view(E, T, K), bq, counts, out=c, a_scale=a_s3, b_scale=b_s, zero_padding=True)
    ad = dequantize_fp8_per_token_group(aq, a_s).view(E, T, K)
    bd = dequantize_fp8_block(bq, b_s)
    for e, n in enumerate(counts.tolist()):
        assert_close(c[e, :n], ad[e, :n] @ bd[e].t(), dtype=torch.bfloat16)
        assert (c[e, n:] == 0).all()
