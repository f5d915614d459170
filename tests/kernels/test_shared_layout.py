"""Tiles of part of a block: one align serves two GEMMs whose BLOCK_M differ."""

from __future__ import annotations

import pytest
import torch

import moekit.experts.triton as triton_experts
from moekit.experts import TritonExperts
from moekit.kernels.align import moe_align_block_size
from moekit.kernels.configs import KernelConfig
from moekit.kernels.fused_moe import GatedOutput, fused_moe_gemm
from moekit.kernels.gemm_args import RowWindow
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.reference import moe_reference
from moekit.testing import assert_close, make_problem

TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)


def _case(device, *, M=9, topk=3, E=4, K=64, N=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (M, topk), generator=g)
    ids.view(-1)[-1] = -1  # an empty slot
    a = torch.randn(M, K, generator=g).to(device)
    w = (torch.randn(E, N, K, generator=g) / K**0.5).to(device)
    return ids.to(device), a, w


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_tiles_of_bigger_blocks_give_each_pair_its_row(device, persistent, gated):
    # 16-row tiles over 64-row blocks: 9 * 3 pairs over 4 experts leave most tiles of a block empty.
    ids, a, w = _case(device)
    M, topk, N = ids.shape[0], ids.shape[1], w.shape[1]
    width = N // 2 if gated else N
    cfg = KernelConfig(**TILE, persistent=persistent)
    outs = []
    for block_m in (16, 64):
        blocks = moe_align_block_size(ids, block_m, w.shape[0], keep_empty=True)
        out = torch.full((M, topk, width), 7.0, device=device)
        outs.append(fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=cfg,
                                   gated=GatedOutput() if gated else None))  # fmt: skip
    assert_close(outs[1], outs[0], dtype=torch.float32)
    assert (outs[1].view(-1, width)[-1] == 0).all()  # the empty slot: zeros, written


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # the interpreter's 0 * inf
@pytest.mark.parametrize("persistent", [False, True])
def test_tiles_past_a_blocks_real_rows_do_no_math(device, persistent):
    # Written by position, every row of the workspace gets a value; a padding row that went through the
    # GEMM is 0 @ w, which is NaN when w holds an inf. The tiles past a block's last real row write
    # zeros there instead: they never ran the product.
    ids, a, w = _case(device, M=3, topk=2, E=2)
    w[:, 0, 0] = float("inf")
    blocks = moe_align_block_size(ids, 64, 2, keep_empty=True)
    rows = blocks.max_padded
    out = torch.full((rows, 1, w.shape[1]), 7.0, device=device)
    cfg = KernelConfig(**TILE, persistent=persistent)
    fused_moe_gemm(a, w, out, blocks, pairs_per_row=2, config=cfg, chunk=RowWindow(0, rows, read="pair",
                                                                                      write="position"))  # fmt: skip
    col0, sorted_ids, experts = out[:, 0, 0].cpu(), blocks.sorted_token_ids.cpu(), blocks.expert_ids.cpu()
    seen = set()
    for start in range(0, rows, TILE["BLOCK_M"]):
        tile = slice(start, start + TILE["BLOCK_M"])
        if (sorted_ids[tile] >= blocks.numel).all():
            assert (col0[tile] == 0).all(), f"the tile at row {start} holds only padding, yet computed"
            seen.add("skipped")
        elif experts[start // 64] >= 0:  # (-1: the empty slot's block, zeros by rule)
            assert not torch.isfinite(col0[tile]).any(), f"the tile at row {start} did not compute"
            seen.add("computed")
    assert seen == {"skipped", "computed"}


@pytest.fixture
def align_sizes(monkeypatch):
    """The block sizes of the aligns TritonExperts launches."""
    sizes = []
    real = triton_experts.launch_align

    def recorded(ids, block_m, *args, **kwargs):
        sizes.append(block_m)
        return real(ids, block_m, *args, **kwargs)

    monkeypatch.setattr(triton_experts, "launch_align", recorded)
    return sizes


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tiles", [(16, 32), (32, 16)])
def test_one_align_serves_both_gemms(device, align_sizes, monkeypatch, fused, tiles):
    class Tiles(TritonExperts):
        def tile_configs(self, problem, dtype):
            return tuple(KernelConfig(BLOCK_M=m, BLOCK_N=32, BLOCK_K=32) for m in tiles)

    p = make_problem(11, E=4, topk=2, K=64, N=64, empty_every=3, seed=2, device=device, dtype=torch.float32)
    kernel = ModularKernel(NoEPPrepareFinalize(), Tiles(fuse_activation=fused), trace_counts=False)
    out = kernel(p.hidden, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert align_sizes == [32]
    assert_close(out, moe_reference(p.hidden, p.w1, p.w2, p.topk_weights, p.topk_ids), dtype=torch.float32)
    monkeypatch.setattr(triton_experts, "ONE_LAYOUT", False)  # the A/B's other side: a layout per GEMM
    own = kernel(p.hidden, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert align_sizes == [32, *tiles]
    assert_close(own, out, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [512, 4096])
def test_bit_identical_to_a_layout_of_its_own_on_gpu(device, M):
    # Qwen3-30B-A3B's gated GEMM1 with the table's tile (64 rows at these M) over the 128-row blocks
    # GEMM2's tile asks for, against a 64-row layout: each output row is its own dot products.
    from moekit.kernels.configs import get_config

    E, topk, K, N = 128, 8, 2048, 1536
    ids = torch.rand(M, E, device=device).topk(topk, dim=1).indices
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=device) / K**0.5).bfloat16()
    cfg = get_config(M, N, K, E, topk, torch.bfloat16, stage=1, gated=True)
    big = get_config(M, K, N // 2, E, topk, torch.bfloat16, stage=2).BLOCK_M
    assert big > cfg.BLOCK_M, "the table's tiles at this M no longer differ"
    outs = []
    for block_m in (cfg.BLOCK_M, big):
        blocks = moe_align_block_size(ids, block_m, E, keep_empty=True)
        out = torch.empty(M, topk, N // 2, device=device, dtype=torch.bfloat16)
        outs.append(fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=cfg, gated=GatedOutput()))
    assert torch.equal(outs[0], outs[1])
