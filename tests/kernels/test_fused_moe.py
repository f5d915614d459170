"""The book's grouped GEMM over aligned blocks against a per-pair torch loop."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidInputError, QuantizationError
from moekit.kernels.align import moe_align_block_size
from moekit.kernels.fused_moe import RowWindow, Tiles, fused_moe_gemm, pick_tiles
from moekit.quant import (
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.testing import assert_close, expect_raises

TILES = Tiles(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2)


def gemm_spec(a, w, ids, pairs_per_row, expert_map=None):
    """out[i] = a[i // pairs_per_row] @ w[local(i)].T in fp32; zero for remote or empty pairs."""
    flat = ids.reshape(-1).tolist()
    out = torch.zeros(len(flat), w.shape[1], device=a.device)
    for i, g in enumerate(flat):
        e = g if expert_map is None or g < 0 else int(expert_map[g])
        if 0 <= e < w.shape[0]:
            out[i] = a[i // pairs_per_row].float() @ w[e].float().t()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("M, K, N, E, topk", [(1, 64, 64, 4, 1), (23, 128, 96, 5, 2), (9, 80, 72, 7, 3)])
def test_matches_torch(device, dtype, stage, M, K, N, E, topk):
    # stage 1 reads one row per token (row = pair // topk), stage 2 one row per pair; K and N need
    # not be multiples of the tiles (80, 72: masked loads).
    ids = torch.randint(0, E, (M, topk), device=device)
    rows = M if stage == 1 else M * topk
    a = torch.randn(rows, K, device=device).to(dtype)
    w = (torch.randn(E, N, K, device=device) / K**0.5).to(dtype)
    ppr = topk if stage == 1 else 1
    blocks = moe_align_block_size(ids, TILES.BLOCK_M, E)
    out = torch.empty(M, topk, N, device=device, dtype=dtype)
    fused_moe_gemm(a, w, out, blocks, pairs_per_row=ppr, tiles=TILES)
    # bf16 here also proves the interpreter workaround: a raw bf16 tl.dot gives values ~1e10.
    assert_close(out.flatten(0, 1), gemm_spec(a, w, ids, ppr), dtype=dtype)


def test_remote_blocks_write_zeros_and_dropped_rows_are_untouched(device):
    E, M, topk, K, N = 6, 12, 2, 64, 64
    ids = torch.randint(-1, E, (M, topk), device=device)
    emap = torch.tensor([0, -1, 1, -1, 2, 3], dtype=torch.int32, device=device)
    a = torch.randn(M, K, device=device)
    w = torch.randn(4, N, K, device=device)
    blocks = moe_align_block_size(ids, 16, E, emap, num_local_experts=4)
    out3 = torch.full((M, topk, N), 7.0, device=device)
    fused_moe_gemm(a, w, out3, blocks, pairs_per_row=topk, tiles=TILES)
    out, flat = out3.flatten(0, 1), ids.reshape(-1)
    placed = flat >= 0
    assert_close(out[placed], gemm_spec(a, w, ids, topk, emap)[placed], dtype=torch.float32)
    remote = placed & (emap.long()[flat.clamp(min=0)] < 0)
    assert remote.any() and (out[remote] == 0).all()
    assert (out[~placed] == 7.0).all()  # dropped empty slots: not written


@pytest.mark.parametrize("block_k, column_major", [(128, False), (64, True)])
def test_fp8_block_scales(device, block_k, column_major):
    M, K, N, E, topk = 17, 256, 256, 4, 2
    ids = torch.randint(0, E, (M, topk), device=device)
    aq, a_s = quantize_fp8_per_token_group(torch.randn(M, K, device=device), column_major=column_major)
    wq, w_s = quantize_fp8_block(torch.randn(E, N, K, device=device) / 16)
    blocks = moe_align_block_size(ids, 16, E)
    out = torch.empty(M, topk, N, device=device, dtype=torch.bfloat16)
    fused_moe_gemm(aq, wq, out, blocks, pairs_per_row=topk, tiles=Tiles(16, 64, block_k), a_scale=a_s, w_scale=w_s)
    expected = gemm_spec(dequantize_fp8_per_token_group(aq, a_s), dequantize_fp8_block(wq, w_s), ids, topk)
    assert_close(out.flatten(0, 1), expected, dtype=torch.bfloat16)


def test_row_windows_by_position_compose_to_the_whole_layout(device):
    """GEMM1 of each 64-row window (read by pair, write by position) then GEMM2 (read by position,
    write by pair) gives what the whole layout gives; padding positions hold zeros, remote blocks too."""
    E, M, topk, K, N = 5, 30, 2, 64, 64
    ids = torch.randint(-1, E, (M, topk), device=device)
    emap = torch.tensor([0, -1, 1, 2, 3], dtype=torch.int32, device=device)
    a = torch.randn(M, K, device=device)
    w1 = torch.randn(4, N, K, device=device) / K**0.5
    w2 = torch.randn(4, K, N, device=device) / N**0.5
    blocks = moe_align_block_size(ids, 64, E, emap, num_local_experts=4, keep_empty=True)
    out = torch.full((M, topk, K), 7.0, device=device)
    for s in range(0, blocks.max_padded, 64):
        ws = torch.full((64, 1, N), float("nan"), device=device)
        fused_moe_gemm(
            a, w1, ws, blocks, pairs_per_row=topk, tiles=TILES, window=RowWindow(s, s + 64, write="position")
        )
        assert ws.isfinite().all()
        fused_moe_gemm(ws.view(64, N), w2, out, blocks, pairs_per_row=1, tiles=TILES,
                       window=RowWindow(s, s + 64, read="position"))  # fmt: skip
    mid = gemm_spec(a, w1, ids, topk, emap)
    want = torch.stack([w2[int(emap[g])] @ mid[i] if g >= 0 and emap[g] >= 0 else torch.zeros(K, device=device)
                        for i, g in enumerate(ids.reshape(-1).tolist())])  # fmt: skip
    assert_close(out.flatten(0, 1), want, dtype=torch.float32)


def test_errors(device):
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    blocks = moe_align_block_size(ids, 16, 2)
    a, w = torch.randn(4, 128, device=device), torch.randn(2, 64, 128, device=device)
    out = torch.empty(4, 2, 64, device=device)
    with expect_raises(InvalidInputError, match="BLOCK_M"):
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=2, tiles=Tiles(32, 64, 64))
    with expect_raises(InvalidInputError, match="out must hold 8 rows"):
        fused_moe_gemm(a, w, out[:3], blocks, pairs_per_row=2, tiles=TILES)
    with expect_raises(InvalidInputError, match="rows for 8 pairs"):
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=1, tiles=TILES)
    with expect_raises(InvalidInputError, match="share a float dtype"):
        fused_moe_gemm(a.half(), w, out, blocks, pairs_per_row=2, tiles=TILES)
    aq, a_s = quantize_fp8_per_token_group(a)
    wq, w_s = quantize_fp8_block(w)
    with expect_raises(QuantizationError, match="w_scale"):
        fused_moe_gemm(aq, wq, out.bfloat16(), blocks, pairs_per_row=2, tiles=TILES, a_scale=a_s)
    with expect_raises(QuantizationError, match="BLOCK_K"):
        fused_moe_gemm(aq, wq, out.bfloat16(), blocks, pairs_per_row=2, tiles=Tiles(16, 64, 256), a_scale=a_s,
                       w_scale=w_s)  # fmt: skip
    with expect_raises(QuantizationError, match="both be fp8"):
        fused_moe_gemm(aq, w, out, blocks, pairs_per_row=2, tiles=TILES)
    with expect_raises(InvalidInputError, match="must start on a block of 16"):
        fused_moe_gemm(a, w, torch.empty(16, 1, 64, device=device), blocks, pairs_per_row=2, tiles=TILES,
                       window=RowWindow(8, 24, write="position"))  # fmt: skip
    for bad in (dict(BLOCK_M=24, BLOCK_N=64, BLOCK_K=64), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=0)):
        with expect_raises(InvalidInputError, match="Tiles"):
            Tiles(**bad)


def test_a_2d_out_fails_where_upstream_did(device):
    # The launcher reads out.stride(2) first, as vLLM's invoke_fused_moe_kernel read C.stride(2):
    # handed a 2-D [M*topk, N] output, it raises torch's own IndexError (the crash of bug 1).
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    blocks = moe_align_block_size(ids, 16, 2)
    a, w = torch.randn(4, 128, device=device), torch.randn(2, 64, 128, device=device)
    with expect_raises(IndexError, match=r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)"):
        fused_moe_gemm(a, w, torch.empty(8, 64, device=device), blocks, pairs_per_row=2, tiles=TILES, check=False)


def test_pick_tiles_grow_with_rows_per_expert(monkeypatch):
    import moekit.kernels.fused_moe as book

    monkeypatch.setattr(book, "interpreting", lambda: False)
    small, large = pick_tiles(1.0, torch.bfloat16), pick_tiles(4096.0, torch.bfloat16)
    assert small.BLOCK_M < large.BLOCK_M and pick_tiles(4096.0, torch.float8_e4m3fn).BLOCK_K == 128
