"""fp8 e4m3 quantization: round-trip error bounds and the scale layouts DeepGEMM reads."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.errors import QuantizationError
from moekit.quant import (
    FP8,
    FP8_GROUP,
    FP8_MAX,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)

# e4m3 keeps 3 mantissa bits: round-to-nearest is within 2**-4 relative for normal numbers; the
# subnormal step is 2**-9 (of the scale), so absolute error there is at most half of it.
REL = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10


def assert_within_fp8_bound(x: torch.Tensor, back: torch.Tensor, scale_per_elem: torch.Tensor) -> None:
    err = (x.float() - back).abs()
    bound = REL * x.float().abs() + SUBNORMAL_HALF_STEP * scale_per_elem
    assert bool((err <= bound * (1 + 1e-6)).all()), f"worst excess {float((err - bound).max())}"


def random_groups(M: int, K: int, dtype=torch.float32) -> torch.Tensor:
    # Magnitudes spread over many binades, so subnormals and normals both occur.
    return (torch.randn(M, K) * torch.exp2(torch.randint(-12, 6, (M, K)).float())).to(dtype)


def test_the_one_fp8_dtype_and_group_width():
    # DeepSeek-V3's and DeepGEMM's: e4m3 (finite, max 448) and 128-wide groups / 128 x 128 blocks.
    assert FP8 is torch.float8_e4m3fn and FP8_MAX == 448.0 and FP8_GROUP == 128


@pytest.mark.parametrize("M,K", [(1, 128), (5, 256), (8, 200), (3, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_token_group_round_trip(M, K, dtype):
    x = random_groups(M, K, dtype)
    q, scale = quantize_fp8_per_token_group(x)
    G = math.ceil(K / FP8_GROUP)
    assert q.dtype == FP8 and q.shape == (M, K) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (M, G)
    back = dequantize_fp8_per_token_group(q, scale)
    assert back.shape == (M, K) and back.dtype == torch.float32
    assert_within_fp8_bound(x, back, scale.repeat_interleave(FP8_GROUP, dim=1)[:, :K])
    # scale = amax / 448: the largest element of each group lands on +-448 and comes back exact
    padded = torch.nn.functional.pad(x.float().abs(), (0, G * FP8_GROUP - K)).view(M, G, FP8_GROUP)
    torch.testing.assert_close(scale, padded.amax(-1) / FP8_MAX)
    assert float(q.float().abs().max()) == FP8_MAX


def test_per_token_group_other_group_size():
    x = random_groups(4, 96)
    q, scale = quantize_fp8_per_token_group(x, 32)
    assert scale.shape == (4, 3)
    back = dequantize_fp8_per_token_group(q, scale, 32)
    assert_within_fp8_bound(x, back, scale.repeat_interleave(32, dim=1))


def test_zero_group_gives_zeros_not_nan():
    x = torch.zeros(2, 256)
    x[1, 128:] = torch.randn(128)
    q, scale = quantize_fp8_per_token_group(x)
    back = dequantize_fp8_per_token_group(q, scale)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    assert torch.count_nonzero(back[0]) == 0
    assert_within_fp8_bound(x, back, scale.repeat_interleave(128, dim=1))


@pytest.mark.parametrize("M", [1, 4, 5, 8, 13])
def test_column_major_scale_layout(M):
    K = 384
    x = random_groups(M, K)
    q_row, scale_row = quantize_fp8_per_token_group(x)
    q_col, scale_col = quantize_fp8_per_token_group(x, column_major=True)
    padded_M = (M + 3) // 4 * 4  # TMA alignment: rows padded to a multiple of 4
    G = K // FP8_GROUP
    assert scale_col.shape == (M, G)
    assert scale_col.stride() == (1, padded_M)  # column-major: one group's scales are adjacent
    assert scale_col.untyped_storage().nbytes() == G * padded_M * 4
    assert torch.equal(scale_col, scale_row) and torch.equal(q_col.float(), q_row.float())
    # The storage read as [G, padded_M] is what DeepGEMM consumes.
    storage = torch.empty(0).set_(scale_col.untyped_storage()).view(G, padded_M)
    assert torch.equal(storage[:, :M], scale_row.t())


@pytest.mark.parametrize("shape", [(128, 128), (2, 256, 384), (3, 200, 300), (1, 5, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_round_trip(shape, dtype):
    w = (torch.randn(*shape) * torch.exp2(torch.randint(-8, 4, shape).float())).to(dtype)
    q, scale = quantize_fp8_block(w)
    *lead, R, C = shape
    Rb, Cb = math.ceil(R / FP8_GROUP), math.ceil(C / FP8_GROUP)
    assert q.dtype == FP8 and q.shape == w.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (*lead, Rb, Cb) and scale.is_contiguous()
    back = dequantize_fp8_block(q, scale)
    assert back.shape == w.shape
    per_elem = scale.repeat_interleave(FP8_GROUP, dim=-2).repeat_interleave(FP8_GROUP, dim=-1)[..., :R, :C]
    assert_within_fp8_bound(w, back, per_elem)
    # every block's scale is its amax / 448
    padded = torch.nn.functional.pad(w.float().abs(), (0, Cb * FP8_GROUP - C, 0, Rb * FP8_GROUP - R))
    amax = padded.view(*lead, Rb, FP8_GROUP, Cb, FP8_GROUP).amax(dim=(-3, -1))
    torch.testing.assert_close(scale, amax / FP8_MAX)


def test_block_scales_are_per_block():
    w = torch.ones(256, 256)
    w[128:, :128] = 100.0
    _, scale = quantize_fp8_block(w)
    torch.testing.assert_close(scale, torch.tensor([[1.0, 1.0], [100.0, 1.0]]) / FP8_MAX)


def _q_block(E, R, C, take=None):
    q, s = quantize_fp8_block(torch.randn(E, R, C))
    return q, (s if take is None else s[take])


def _q_rows(M, K, take=None):
    q, s = quantize_fp8_per_token_group(torch.randn(M, K))
    return q, (s if take is None else s[take])


@pytest.mark.parametrize(
    "call",
    [
        lambda: quantize_fp8_per_token_group(torch.zeros(2, 128, dtype=FP8)),
        lambda: quantize_fp8_per_token_group(torch.zeros(2, 128, dtype=torch.int32)),
        lambda: quantize_fp8_per_token_group(torch.zeros(128)),
        lambda: quantize_fp8_per_token_group(torch.zeros(2, 2, 128)),
        lambda: quantize_fp8_block(torch.zeros(128, 128, dtype=FP8)),
        lambda: quantize_fp8_block(torch.zeros(128)),
        lambda: quantize_fp8_block(torch.randn(128, 128), block=0),
        lambda: quantize_fp8_block(torch.randn(128, 128), block=-128),
        lambda: quantize_fp8_per_token_group(torch.randn(2, 128), group=0),
        # Malformed scales used to broadcast: expert 0's scales for every expert, row 0's for every row.
        lambda: dequantize_fp8_block(*_q_block(3, 128, 128, take=0)),
        lambda: dequantize_fp8_per_token_group(*_q_rows(4, 256, take=slice(0, 1))),
        lambda: dequantize_fp8_per_token_group(_q_rows(4, 256)[0], torch.ones(4, 3)),
        lambda: dequantize_fp8_block(torch.randn(3, 128, 128), torch.ones(3, 1, 1)),  # not fp8
    ],
)
def test_errors(call):
    with pytest.raises(QuantizationError):
        call()
