"""silu_and_mul and silu_and_mul_fp8_group against plain torch and moekit.quant."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidInputError, QuantizationError
from moekit.kernels.activation import silu_and_mul, silu_and_mul_fp8_group
from moekit.quant import FP8, FP8_GROUP, dequantize_fp8_per_token_group, quantize_fp8_per_token_group
from moekit.reference import silu_and_mul as silu_and_mul_ref
from moekit.testing import assert_close, expect_raises


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("R, H", [(1, 64), (37, 300), (5, 1)])
def test_silu_and_mul_matches_torch(device, dtype, R, H):
    x = torch.randn(R, 2 * H, device=device, dtype=dtype) * 3
    out = silu_and_mul(x)
    expected = silu_and_mul_ref(x.float())
    assert out.shape == (R, H) and out.dtype == dtype
    # Computed in fp32 and rounded once: equal to the fp32 result rounded to the dtype.
    torch.testing.assert_close(out, expected.to(dtype), atol=1e-6, rtol=1e-6)


def test_silu_and_mul_row_stride_and_out(device):
    big = torch.randn(9, 200, device=device)
    x = big[:, :128]  # rows 200 apart
    out = torch.empty(9, 64, device=device)
    got = silu_and_mul(x, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, silu_and_mul_ref(x), dtype=torch.float32)


def test_silu_and_mul_empty_and_errors(device):
    assert silu_and_mul(torch.randn(0, 8, device=device)).shape == (0, 4)
    with expect_raises(InvalidInputError, match="even width"):
        silu_and_mul(torch.randn(2, 7, device=device))
    with expect_raises(InvalidInputError, match="2-D"):
        silu_and_mul(torch.randn(2, 2, 8, device=device))
    with expect_raises(InvalidInputError, match="out must be"):
        silu_and_mul(torch.randn(2, 8, device=device), out=torch.empty(2, 8, device=device))


def test_worked_example_of_the_docstring(device):
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], device=device)
    assert_close(silu_and_mul(x), torch.tensor([[2.1932, 7.0464]]), dtype=torch.float16)
    q, scale = silu_and_mul_fp8_group(x)
    assert q.float().tolist() == [[144.0, 448.0]]
    assert abs(scale.item() - 7.0464 / 448) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R, H", [(1, 128), (13, 256), (6, 200)])
def test_fp8_group_equals_moekit_quant(device, dtype, R, H):
    x = torch.randn(R, 2 * H, device=device, dtype=dtype) * 2
    q, scale = silu_and_mul_fp8_group(x)
    q_ref, scale_ref = quantize_fp8_per_token_group(silu_and_mul_ref(x.float()))
    assert q.dtype == FP8 and q.shape == (R, H) and scale.shape == (R, -(-H // FP8_GROUP))
    torch.testing.assert_close(scale, scale_ref, rtol=1e-5, atol=0)
    # Same fp32 activation, same scale: the same e4m3 codes (exp differs by an ulp at most).
    mismatched = (q.float() != q_ref.float()).float().mean().item()
    assert mismatched < 0.01
    back = dequantize_fp8_per_token_group(q, scale)
    assert_close(back, silu_and_mul_ref(x.float()), dtype=FP8)


def test_fp8_rounds_across_powers_of_two(device):
    # 127.9 / scale must become 128, not 64 (the interpreter's own cast drops that carry).
    gate = torch.full((1, 128), 30.0, device=device)
    up = torch.linspace(0.5, 1.0, 128, device=device).view(1, 128)
    up[0, -1] = 1.0
    x = torch.cat([gate, up], dim=1)
    q, scale = silu_and_mul_fp8_group(x)
    y = silu_and_mul_ref(x)
    exact = (y / scale).to(FP8).float()
    assert torch.equal(q.float(), exact)


def test_fp8_column_major_scales(device):
    R, H = 10, 256
    x = torch.randn(R, 2 * H, device=device, dtype=torch.bfloat16)
    q, scale = silu_and_mul_fp8_group(x, column_major_scales=True)
    _, row_major = silu_and_mul_fp8_group(x)
    assert scale.shape == (R, 2) and scale.stride() == (1, 12)  # storage [G, round_up(R, 4)]
    assert torch.equal(scale, row_major)
    storage = scale.t()
    padded = torch.as_strided(storage, (2, 12), (12, 1))
    assert torch.equal(padded[:, R:], torch.zeros(2, 2, device=device))


def test_fp8_into_given_buffers(device):
    R, H = 4, 128
    x = torch.randn(R, 2 * H, device=device)
    out_q = torch.empty(R, H, dtype=FP8, device=device)
    out_scale = torch.empty(R, 1, device=device)
    q, scale = silu_and_mul_fp8_group(x, out_q=out_q, out_scale=out_scale)
    assert q.data_ptr() == out_q.data_ptr() and scale.data_ptr() == out_scale.data_ptr()
    with expect_raises(InvalidInputError, match="out_scale must be"):
        silu_and_mul_fp8_group(x, out_scale=torch.empty(R, 2, device=device))


@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_static_scale(device, per_row):
    R, H = 6, 256
    x = torch.randn(R, 2 * H, device=device)
    y = silu_and_mul_ref(x)
    if per_row:
        static = y.abs().amax(dim=1) / 448 * 1.5
    else:
        static = torch.tensor([0.01], device=device)
    q, scale = silu_and_mul_fp8_group(x, static_scale=static)
    s = static.view(-1, 1).expand(R, 2) if per_row else static.expand(R, 2)
    assert torch.equal(scale, s)
    expected = (y / s.repeat_interleave(128, dim=1)).clamp(-448, 448).to(FP8)
    assert torch.equal(q.float(), expected.float())
    with expect_raises(QuantizationError, match="static_scale"):
        silu_and_mul_fp8_group(x, static_scale=torch.ones(R + 1, device=device))


def test_fp8_group_errors(device):
    with expect_raises(QuantizationError, match="power of two"):
        silu_and_mul_fp8_group(torch.randn(2, 256, device=device), group=96)
    q, scale = silu_and_mul_fp8_group(torch.randn(0, 256, device=device))
    assert q.shape == (0, 128) and scale.shape == (0, 1)
