"""The wing's grouped GEMM over aligned blocks (and its config table) against the book's per-pair torch loop."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidInputError, QuantizationError
from moekit.hopper.configs import KernelConfig
from moekit.hopper.gemm_args import RowWindow
from moekit.hopper.grouped_gemm import GatedOutput, fused_moe_gemm
from moekit.kernels.align import moe_align_block_size
from moekit.quant import (
    FP8,
    FP8_GROUP,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import silu_and_mul
from moekit.testing import assert_close, expect_raises
from tests.kernels.test_fused_moe import gemm_spec  # the book's per-pair spec

CFG = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("M, K, N, E, topk", [(1, 64, 64, 4, 1), (23, 128, 96, 5, 2), (9, 96, 80, 7, 3)])
def test_matches_torch(device, dtype, stage, M, K, N, E, topk):
    # stage 1 reads one row per token (row = pair // topk), stage 2 one row per pair.
    ids = torch.randint(0, E, (M, topk), device=device)
    rows = M if stage == 1 else M * topk
    a = torch.randn(rows, K, device=device).to(dtype)
    w = (torch.randn(E, N, K, device=device) / K**0.5).to(dtype)
    ppr = topk if stage == 1 else 1
    blocks = moe_align_block_size(ids, CFG.BLOCK_M, E)
    out = torch.empty(M, topk, N, device=device, dtype=dtype)  # one row per (token, slot)
    fused_moe_gemm(a, w, out, blocks, pairs_per_row=ppr, config=CFG)
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
    fused_moe_gemm(a, w, out3, blocks, pairs_per_row=topk, config=CFG)
    out = out3.flatten(0, 1)
    flat = ids.reshape(-1)
    expected = gemm_spec(a, w, ids, topk, emap)
    placed = flat >= 0
    assert_close(out[placed], expected[placed], dtype=torch.float32)
    remote = placed & (emap.long()[flat.clamp(min=0)] < 0)
    assert (out[remote] == 0).all()
    assert (out[~placed] == 7.0).all()  # dropped empty slots: not written


@pytest.mark.parametrize(
    "block_k, block_n, N, persistent",
    [(128, 64, 384, False), (64, 64, 384, False), (128, 128, 384, False), (128, 256, 384, False),
     (128, 32, 320, False), (128, 128, 320, True), (128, 256, 320, True)],
)  # fmt: skip
def test_fp8_block_scales(device, block_k, block_n, N, persistent):
    # 128-row weight blocks whose rows differ 4x in size, so that a tile reading another block's scale is
    # off by 4x; BLOCK_N 256 takes two blocks per tile, and the last tile runs past N (N = 320: mid-block).
    M, K, E, topk = 17, 256, 4, 2
    ids = torch.randint(0, E, (M, topk), device=device)
    aq, a_s = quantize_fp8_per_token_group(torch.randn(M, K, device=device))
    rows = 4.0 ** (torch.arange(N, device=device) // FP8_GROUP)
    wq, w_s = quantize_fp8_block(torch.randn(E, N, K, device=device) * rows[:, None] / 16)
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, persistent=persistent)
    blocks = moe_align_block_size(ids, 16, E)
    out = torch.empty(M, topk, N, device=device, dtype=torch.bfloat16)
    fused_moe_gemm(aq, wq, out, blocks, pairs_per_row=topk, config=cfg, a_scale=a_s, w_scale=w_s)
    expected = gemm_spec(dequantize_fp8_per_token_group(aq, a_s), dequantize_fp8_block(wq, w_s), ids, topk)
    assert_close(out.flatten(0, 1), expected, dtype=torch.bfloat16)  # the same dequantized products, bf16 output


def test_fp8_column_major_activation_scales(device):
    M, K, N, E = 6, 128, 128, 2
    ids = torch.randint(0, E, (M, 1), device=device)
    aq, a_s = quantize_fp8_per_token_group(torch.randn(M, K, device=device), column_major=True)
    wq, w_s = quantize_fp8_block(torch.randn(E, N, K, device=device))
    blocks = moe_align_block_size(ids, 16, E)
    out = torch.empty(M, 1, N, device=device, dtype=torch.bfloat16)
    fused_moe_gemm(aq, wq, out, blocks, pairs_per_row=1, config=CFG, a_scale=a_s, w_scale=w_s)
    expected = gemm_spec(dequantize_fp8_per_token_group(aq, a_s), dequantize_fp8_block(wq, w_s), ids, 1)
    assert_close(out.flatten(0, 1), expected, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_epilogue(device, dtype):
    M, K, N, E, topk = 13, 96, 160, 5, 2  # K % BLOCK_K != 0 and N/2 = 80 % BLOCK_N != 0
    ids = torch.randint(-1, E, (M, topk), device=device)
    a = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(E, N, K, device=device) / K**0.5).to(dtype)
    blocks = moe_align_block_size(ids, CFG.BLOCK_M, E, keep_empty=True)
    out = torch.empty(M, topk, N // 2, device=device, dtype=dtype)
    fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=CFG, gated=GatedOutput())
    assert_close(out.flatten(0, 1), silu_and_mul(gemm_spec(a, w, ids, topk)), dtype=dtype)


@pytest.mark.parametrize("static", [None, "per_tensor", "per_token"])
def test_gated_fp8_requantization(device, static):
    # GEMM1 + silu_and_mul + 1x128 requantization in one kernel vs the same steps one by one.
    M, K, N, E, topk = 11, 128, 512, 3, 2
    ids = torch.randint(0, E, (M, topk), device=device)
    aq, a_s = quantize_fp8_per_token_group(torch.randn(M, K, device=device))
    wq, w_s = quantize_fp8_block(torch.randn(E, N, K, device=device) / 8)
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128)
    blocks = moe_align_block_size(ids, 16, E)
    y = silu_and_mul(gemm_spec(dequantize_fp8_per_token_group(aq, a_s), dequantize_fp8_block(wq, w_s), ids, topk))
    st, div = None, 1
    if static == "per_tensor":
        st = torch.tensor([0.02], device=device)
    elif static == "per_token":
        st, div = torch.rand(M, device=device) * 0.02 + 0.01, topk
    q3 = torch.empty(M, topk, N // 2, device=device, dtype=FP8)
    q = q3.flatten(0, 1)
    scale = torch.empty(M * topk, N // 256, device=device)
    gated = GatedOutput(out_scale=scale, static_scale=st, static_div=div)
    fused_moe_gemm(aq, wq, q3, blocks, pairs_per_row=topk, config=cfg, a_scale=a_s, w_scale=w_s, gated=gated)
    if st is None:
        s_ref = (y.abs().view(-1, N // 2 // FP8_GROUP, FP8_GROUP).amax(-1) / 448).clamp_min(1e-10)
        torch.testing.assert_close(scale, s_ref, rtol=1e-4, atol=0)
    else:
        s_ref = st.repeat_interleave(div).view(-1, 1).expand(M * topk, N // 256)
        assert torch.equal(scale, s_ref)
    limit = 448 * s_ref.repeat_interleave(128, dim=1)  # a static scale saturates what it cannot hold
    back = q.float() * scale.repeat_interleave(128, dim=1)
    assert_close(back, torch.maximum(torch.minimum(y, limit), -limit), dtype=FP8)
    with expect_raises(QuantizationError, match="BLOCK_N == 128"):
        fused_moe_gemm(aq, wq, q3, blocks, pairs_per_row=topk, config=CFG, a_scale=a_s, w_scale=w_s, gated=gated)


@pytest.mark.parametrize("kind", ["fp32", "bf16_gated", "fp8_gated"])
def test_tail_tiles_match_full_tiles(device, kind):
    # TAIL_M=16 in 32-row blocks: experts get 3, 16, 17, 32 and 40 pairs, so some last blocks
    # hold at most 16 real rows (the short tile), some more (the full tile), and some blocks are full.
    K, topk = 128, 1
    counts = [3, 16, 17, 32, 40, 0]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])[torch.randperm(sum(counts))]
    ids = ids.view(-1, topk).to(device)
    E, M = len(counts), ids.shape[0]
    N = 256
    a = torch.randn(M, K, device=device)
    w = torch.randn(E, N, K, device=device) / K**0.5
    kw, dtype, width = {}, torch.float32, N // 2 if "gated" in kind else N
    if kind.startswith("bf16"):
        a, w, dtype = a.bfloat16(), w.bfloat16(), torch.bfloat16
    elif kind.startswith("fp8"):
        (a, a_s), (w, w_s) = quantize_fp8_per_token_group(a), quantize_fp8_block(w)
        kw, dtype = dict(a_scale=a_s, w_scale=w_s), torch.bfloat16
    blocks = moe_align_block_size(ids, 32, E)
    results = []
    for tail in (0, 16):
        cfg = KernelConfig(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, TAIL_M=tail)
        if kind == "fp8_gated":
            out = torch.empty(M, topk, width, device=device, dtype=FP8)
            kw["gated"] = GatedOutput(out_scale=torch.empty(M * topk, width // FP8_GROUP, device=device))
        else:
            out = torch.full((M, topk, width), float("nan"), device=device, dtype=dtype)
            kw["gated"] = GatedOutput() if "gated" in kind else None
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=cfg, **kw)
        back = out.flatten(0, 1).float()
        if kind == "fp8_gated":
            back = back * kw["gated"].out_scale.repeat_interleave(128, dim=1)
        results.append(back)
    assert results[1].isfinite().all()  # every pair written by one tile or the other
    if kind == "fp32":
        assert_close(results[1], gemm_spec(a, w, ids, topk), dtype=torch.float32)
    tol = FP8 if kind == "fp8_gated" else dtype
    assert_close(results[1], results[0], dtype=tol)


def test_tail_m_must_fit_the_block():
    for bad in (8, 24, 32, 64, True):
        with expect_raises(InvalidInputError, "TAIL_M"):
            KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, TAIL_M=bad)


@pytest.mark.parametrize("kind", ["bf16", "fp32_gated", "fp8_gated", "fp8"])
def test_tma_weights_match_pointer_loads(device, kind):
    # Weight tiles through a TMA descriptor: the last column tile reads past the expert (into the
    # next one, or zero-filled past the end), and none of those columns may reach the output.
    M, K, E, topk = 9, 256, 3, 2
    N = 256 if kind.startswith("fp8") else 160  # N/2 = 80: a partial column tile
    ids = torch.randint(-1, E, (M, topk), device=device)
    a = torch.randn(M, K, device=device)
    w = torch.randn(E, N, K, device=device) / K**0.5
    kw, dtype, width = {}, torch.float32, N // 2 if "gated" in kind else N
    if kind == "bf16":
        a, w, dtype = a.bfloat16(), w.bfloat16(), torch.bfloat16
    elif kind.startswith("fp8"):
        (a, a_s), (w, w_s) = quantize_fp8_per_token_group(a), quantize_fp8_block(w)
        kw, dtype = dict(a_scale=a_s, w_scale=w_s), torch.bfloat16
    results = []
    for tma in (False, True):
        cfg = KernelConfig(BLOCK_M=16, BLOCK_N=128 if kind.startswith("fp8") else 64, BLOCK_K=128, tma=tma)
        blocks = moe_align_block_size(ids, 16, E, keep_empty=True)
        if kind == "fp8_gated":
            out = torch.empty(M, topk, width, device=device, dtype=FP8)
            kw["gated"] = GatedOutput(out_scale=torch.empty(M * topk, width // FP8_GROUP, device=device))
        else:
            out = torch.empty(M, topk, width, device=device, dtype=dtype)
            kw["gated"] = GatedOutput() if "gated" in kind else None
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=cfg, **kw)
        back = out.flatten(0, 1).float()
        if kind == "fp8_gated":
            back = back * kw["gated"].out_scale.repeat_interleave(128, dim=1)
        results.append(back)
    if kind == "fp8_gated":  # an fp32 rounding difference may flip an fp8 code
        assert_close(results[1], results[0], dtype=FP8)
    else:  # the same products; only the dot's summation order may differ
        assert (results[1] - results[0]).abs().max() <= 1e-6 * results[0].abs().max()


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8_requantized"])
def test_interleaved_gate_up_matches_the_spec(device, kind):
    # One accumulator whose columns alternate gate, up (KernelConfig.interleave), by pointers or a TMA box
    # of w seen as [E, N, 2, K], one program per tile or the persistent walk; the last column tile is
    # partial (N/2 = 80 at BLOCK_N = 64), remote and empty slots included.
    fp8 = kind == "fp8_requantized"
    M, K, E, topk, N = 11, 128 if fp8 else 192, 4, 2, 512 if fp8 else 160
    ids = torch.randint(-1, E, (M, topk), device=device)
    a, w = torch.randn(M, K, device=device), torch.randn(E, N, K, device=device) / K**0.5
    kw, dtype = {}, torch.bfloat16 if kind == "bf16" else torch.float32
    if fp8:
        (a, a_s), (w, w_s) = quantize_fp8_per_token_group(a), quantize_fp8_block(w)
        kw = dict(a_scale=a_s, w_scale=w_s)
        expected = silu_and_mul(gemm_spec(dequantize_fp8_per_token_group(a, a_s), dequantize_fp8_block(w, w_s), ids, 2))
    else:
        a, w = a.to(dtype), w.to(dtype)
        expected = silu_and_mul(gemm_spec(a, w, ids, topk))
    placed = ids.reshape(-1) >= 0
    cases = [(16, False, False, 0), (16, True, False, 0), (16, True, True, 0), (32, True, False, 16)]  # fmt: skip
    for block_m, tma, persistent, tail in cases:  # (BLOCK_M, TMA weights, persistent walk, TAIL_M)
        bn = 128 if fp8 else 64
        cfg = KernelConfig(block_m, bn, 64, tma=tma, persistent=persistent, TAIL_M=tail, interleave=True)
        blocks = moe_align_block_size(ids, block_m, E, keep_empty=True)
        if fp8:
            out = torch.empty(M, topk, N // 2, device=device, dtype=FP8)
            gated = GatedOutput(out_scale=torch.empty(M * topk, N // 2 // FP8_GROUP, device=device))
        else:
            out, gated = torch.full((M, topk, N // 2), float("nan"), device=device, dtype=dtype), GatedOutput()
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=cfg, gated=gated, **kw)
        got = out.flatten(0, 1).float()
        if fp8:
            got = got * gated.out_scale.repeat_interleave(FP8_GROUP, dim=1)
        assert_close(got[placed], expected[placed], dtype=FP8 if fp8 else dtype)
    if not fp8:  # a row chunk's GEMM1 (written by position), the persistent walk: row r holds pair sorted[s + r]
        cfg = KernelConfig(32, 64, 64, tma=True, persistent=True, interleave=True)  # blocks: the last case's 32 rows
        sorted_ids = blocks.sorted_token_ids.tolist()
        for s in range(0, len(sorted_ids), 32):
            ws = torch.full((32, 1, N // 2), float("nan"), device=device, dtype=dtype)
            chunk = RowWindow(s, s + 32, write="position")
            fused_moe_gemm(a, w, ws, blocks, pairs_per_row=topk, config=cfg, gated=gated, chunk=chunk)
            live = [(r, p) for r, p in enumerate(sorted_ids[s : s + 32]) if p < M * topk and placed[p]]
            rows, pairs = zip(*live, strict=True) if live else ((), ())
            assert_close(ws[list(rows), 0].float(), expected[list(pairs)], dtype=dtype)
    with expect_raises(InvalidInputError, match="interleave is for a gated GEMM"):
        fused_moe_gemm(a, w, torch.empty(M, topk, N, device=device), blocks, pairs_per_row=topk, config=cfg, **kw)


def test_errors(device):
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    blocks = moe_align_block_size(ids, 16, 2)
    a, w = torch.randn(4, 128, device=device), torch.randn(2, 64, 128, device=device)
    out = torch.empty(4, 2, 64, device=device)
    with expect_raises(InvalidInputError, match="BLOCK_M"):
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=2, config=KernelConfig(32, 64, 64))
    with expect_raises(InvalidInputError, match="out must hold 8 rows"):
        fused_moe_gemm(a, w, out[:3], blocks, pairs_per_row=2, config=CFG)
    with expect_raises(InvalidInputError, match="rows for 8 pairs"):
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=1, config=CFG)
    with expect_raises(InvalidInputError, match="share a float dtype"):
        fused_moe_gemm(a.half(), w, out, blocks, pairs_per_row=2, config=CFG)
    aq, a_s = quantize_fp8_per_token_group(a)
    wq, w_s = quantize_fp8_block(w)
    with expect_raises(QuantizationError, match="w_scale"):
        fused_moe_gemm(aq, wq, out.bfloat16(), blocks, pairs_per_row=2, config=CFG, a_scale=a_s)
    with expect_raises(QuantizationError, match="BLOCK_K"):
        fused_moe_gemm(aq, wq, out.bfloat16(), blocks, pairs_per_row=2, config=KernelConfig(16, 64, 256),
                       a_scale=a_s, w_scale=w_s)  # fmt: skip
    with expect_raises(QuantizationError, match="both be fp8"):
        fused_moe_gemm(aq, w, out, blocks, pairs_per_row=2, config=CFG)


def test_a_2d_out_fails_where_upstream_did(device):
    # The launcher reads out.stride(2) first, as vLLM's invoke_fused_moe_kernel read C.stride(2):
    # handed a 2-D [M*topk, N] output, it raises torch's own IndexError (the crash of bug 1).
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    blocks = moe_align_block_size(ids, 16, 2)
    a, w = torch.randn(4, 128, device=device), torch.randn(2, 64, 128, device=device)
    with expect_raises(IndexError, match=r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)"):
        fused_moe_gemm(a, w, torch.empty(8, 64, device=device), blocks, pairs_per_row=2, config=CFG)


# ---------------------------------------------------------------------------------------------
# RowWindow: one chunk of the sorted layout's rows, written by position then read back by position


@pytest.mark.parametrize(
    "block_m, tma, persistent",
    [(16, False, False), (32, False, False), (32, True, False), (16, False, True), (32, True, True)],
)
def test_row_chunks_by_position_compose_to_the_whole_layout(device, block_m, tma, persistent):
    """GEMM1 of each 64-row chunk (read by pair, write by position) then GEMM2 (read by position,
    write by pair) gives, over all chunks, what one call over every block gives; padding positions
    hold finite values, remote blocks zeros."""
    from moekit.hopper.gemm_args import RowWindow

    E, M, topk, K, N = 5, 30, 2, 64, 64
    ids = torch.randint(-1, E, (M, topk), device=device)
    emap = torch.tensor([0, -1, 1, 2, 3], dtype=torch.int32, device=device)
    a = torch.randn(M, K, device=device)
    w1 = torch.randn(4, N, K, device=device) / K**0.5
    w2 = torch.randn(4, K, N, device=device) / N**0.5
    blocks = moe_align_block_size(ids, 64, E, emap, num_local_experts=4, keep_empty=True)
    # tma: the weights and, read by position, the activation rows through TMA descriptors. persistent:
    # GEMM1 by position walks every block (zeros past the layout), chunks past its rows walk nothing.
    cfg = KernelConfig(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2, tma=tma,
                       persistent=persistent)  # fmt: skip
    out = torch.full((M, topk, K), 7.0, device=device)
    total = blocks.sorted_token_ids.numel()
    for s in range(0, total, 64):
        ws = torch.full((64, 1, N), float("nan"), device=device)
        fused_moe_gemm(a, w1, ws, blocks, pairs_per_row=topk, config=cfg, chunk=RowWindow(s, s + 64, write="position"))
        assert ws.isfinite().all()
        fused_moe_gemm(ws.view(64, N), w2, out, blocks, pairs_per_row=1, config=cfg,
                       chunk=RowWindow(s, s + 64, read="position"))  # fmt: skip
    mid = gemm_spec(a, w1, ids, topk, emap)
    want = torch.stack([w2[int(emap[g])] @ mid[i] if g >= 0 and emap[g] >= 0 else torch.zeros(K, device=device)
                        for i, g in enumerate(ids.reshape(-1).tolist())])  # fmt: skip
    assert_close(out.flatten(0, 1), want, dtype=torch.float32)


def test_a_row_chunk_off_the_blocks_is_named(device):
    from moekit.hopper.gemm_args import RowWindow

    ids = torch.randint(0, 4, (8, 2), device=device)
    blocks = moe_align_block_size(ids, 32, 4)
    a, w = torch.randn(8, 64, device=device), torch.randn(4, 64, 64, device=device)
    ws = torch.empty(32, 1, 64, device=device)
    with expect_raises(InvalidInputError, match="must start on a block of 32"):
        fused_moe_gemm(a, w, ws, blocks, pairs_per_row=2, config=CFG, chunk=RowWindow(16, 48, write="position"))
    with expect_raises(InvalidInputError, match="out must hold 32 rows"):
        fused_moe_gemm(a, w, ws[:16], blocks, pairs_per_row=2, config=CFG, chunk=RowWindow(0, 32, write="position"))
