"""contiguous_gemm vs a dequantize-then-matmul torch reference (the layout's definition)."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidInputError
from moekit.kernels.contiguous_gemm import GemmConfig, contiguous_gemm
from moekit.kernels.permute import ALIGN_M, permute_to_contiguous
from moekit.quant import (
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import count_reference
from moekit.testing import assert_close


def layout(M, K, topk, E, device, *, extra_blocks=1):
    q, s = quantize_fp8_per_token_group(torch.randn(M, K, device=device))
    ids = torch.randint(-1, E, (M, topk), device=device)
    counts = count_reference(ids, E)
    num_rows = int(((counts.long() + ALIGN_M - 1) // ALIGN_M * ALIGN_M).sum()) + extra_blocks * ALIGN_M
    return permute_to_contiguous(q, s, ids, counts, num_rows=num_rows)


def weights(E, N, K, device):
    return quantize_fp8_block(torch.randn(E, N, K, device=device) / K**0.5)


def reference(L, wq, ws):
    A = dequantize_fp8_per_token_group(L.a, L.a_scale)
    W = dequantize_fp8_block(wq, ws)[L.m_indices.long()]  # [M_sum, N, K]
    return torch.einsum("rk,rnk->rn", A, W)


def data_rows(L):
    rows = torch.zeros(L.num_rows, dtype=torch.bool, device=L.a.device)
    rows[L.inv_perm[L.inv_perm >= 0].long()] = True
    return rows


@pytest.mark.parametrize("N,K", [(128, 128), (256, 128), (128, 256), (192, 192)])
def test_matches_dequantized_reference(N, K, device):
    L = layout(45, K, 2, 3, device)
    wq, ws = weights(3, N, K, device)
    out = contiguous_gemm(L.a, L.a_scale, wq, ws, L.m_indices, block_rows=L.block_rows)
    assert out.dtype == torch.bfloat16 and out.shape == (L.num_rows, N)
    rows = data_rows(L)
    assert_close(out[rows], reference(L, wq, ws)[rows], dtype=torch.bfloat16)
    assert bool((out[~rows] == 0).all())  # padding rows: exactly zero, never stale bytes


CONFIGS = [GemmConfig(block_m=32, block_n=64, num_stages=1), GemmConfig(block_m=128, block_n=128),
           GemmConfig(block_m=64, block_n=256, num_stages=1), GemmConfig(block_m=64, block_n=64, tma=True)]


# Without block_rows the padding rows are computed too, from whatever bytes they hold (never compared):
# the interpreter's numpy may warn of an overflow there.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("cfg", CONFIGS)
def test_configs_and_no_skip_agree(cfg, device):
    L = layout(30, 128, 2, 2, device, extra_blocks=0)
    wq, ws = weights(2, 128, 128, device)
    out = contiguous_gemm(L.a, L.a_scale, wq, ws, L.m_indices, config=cfg)  # no block_rows: all rows
    rows = data_rows(L)
    assert_close(out[rows], reference(L, wq, ws)[rows], dtype=torch.bfloat16)


@pytest.mark.parametrize("cfg", [GemmConfig(block_m=64, block_n=128, num_stages=1),
                                 GemmConfig(block_m=64, block_n=128, num_stages=1, tma=True),
                                 GemmConfig(block_m=128, block_n=64, num_stages=1, tma=True)])
def test_one_weight_scale_per_tile_and_tma_over_stale_padding(cfg, device):
    """N=192 (the last column tile runs past N, into the next expert's rows under TMA), two scale
    blocks of columns and two K steps; the padding rows hold stale bytes, which must not show."""
    L = layout(45, 256, 2, 3, device)
    wq, ws = weights(3, 192, 256, device)
    rows = data_rows(L)
    # 0x7F is NaN in float8_e4m3fn, which a row scale of 0 does not cancel: on a GPU only the store's
    # mask keeps it out. (Triton 3.6's interpreter reads 0x7F as 480, so there the zero scale suffices.)
    L.a.view(torch.uint8)[~rows] = 0x7F
    L.a_scale[~rows] = 1e30
    out = contiguous_gemm(L.a, L.a_scale, wq, ws, L.m_indices, block_rows=L.block_rows, config=cfg)
    assert_close(out[rows], reference(L, wq, ws)[rows], dtype=torch.bfloat16)
    assert bool((out[~rows] == 0).all())


def test_writes_into_out_and_row_major_scales(device):
    L = layout(20, 128, 1, 2, device)
    wq, ws = weights(2, 128, 128, device)
    out = torch.empty(L.num_rows, 128, dtype=torch.bfloat16, device=device)
    got = contiguous_gemm(L.a, L.a_scale.contiguous(), wq, ws, L.m_indices, out=out, block_rows=L.block_rows)
    assert got.data_ptr() == out.data_ptr()
    rows = data_rows(L)
    assert_close(out[rows], reference(L, wq, ws)[rows], dtype=torch.bfloat16)


def test_bad_inputs(device):
    L = layout(8, 128, 1, 2, device)
    wq, ws = weights(2, 128, 128, device)
    with pytest.raises(InvalidInputError, match="divide 128"):
        GemmConfig(block_m=96)
    with pytest.raises(InvalidInputError, match="float8"):
        contiguous_gemm(L.a.float(), L.a_scale, wq, ws, L.m_indices)
    with pytest.raises(InvalidInputError, match="multiple of 128"):
        contiguous_gemm(L.a[:100], L.a_scale[:100], wq, ws, L.m_indices[:100])
    with pytest.raises(InvalidInputError, match="b_scale"):
        contiguous_gemm(L.a, L.a_scale, wq, ws[:, :, :0], L.m_indices)
    with pytest.raises(InvalidInputError, match="m_indices"):
        contiguous_gemm(L.a, L.a_scale, wq, ws, L.m_indices.long())


@pytest.mark.gpu
def test_deepseek_like_gemm1_shape(device):
    E, N, K = 16, 4096, 7168
    L = layout(2048, K, 8, E, device)
    wq, ws = weights(E, N, K, device)
    out = contiguous_gemm(L.a, L.a_scale, wq, ws, L.m_indices, block_rows=L.block_rows)
    rows = data_rows(L).nonzero().squeeze(1)[:512]  # a subset keeps the fp32 reference small
    A = dequantize_fp8_per_token_group(L.a[rows], L.a_scale[rows])
    W = dequantize_fp8_block(wq, ws)
    ref = torch.stack([W[e] @ a for a, e in zip(A, L.m_indices[rows].tolist(), strict=True)])
    assert_close(out[rows], ref, dtype=torch.bfloat16)
