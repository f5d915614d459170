"""The persistent grouped GEMM (one program per SM walking the tiles) against the one-program-per-tile
kernel and the per-pair torch loop: the same tiles, so the same answer, for every epilogue. Row chunks
by position: ``test_fused_moe.test_row_chunks_by_position_compose_to_the_whole_layout``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekit.device import interpreting
from moekit.errors import InvalidInputError
from moekit.hopper.configs import KernelConfig
from moekit.hopper.grouped_gemm import INTERPRETER_SMS, GatedOutput, fused_moe_gemm
from moekit.kernels.align import moe_align_block_size
from moekit.quant import FP8, FP8_GROUP, quantize_fp8_block, quantize_fp8_per_token_group
from moekit.testing import assert_close, expect_raises

from .test_grouped_gemm import gemm_spec


def persistent(cfg: KernelConfig) -> KernelConfig:
    return dataclasses.replace(cfg, persistent=True)


def same_tiles(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical under the interpreter (the same operations in the same order); on a GPU the
    compiler may schedule the flattened loop's MMAs differently, so only the summation order may differ."""
    if interpreting():
        assert torch.equal(got, want) or (got.isnan() == want.isnan()).all() and torch.equal(
            got.nan_to_num(), want.nan_to_num()
        )
    else:
        assert (got.float() - want.float()).abs().max() <= 1e-6 * want.float().abs().max()


@pytest.mark.parametrize("kind", ["fp32", "bf16", "bf16_gated", "fp8", "fp8_gated", "tma"])
def test_persistent_matches_one_program_per_tile(device, kind):
    # An expert_map with remote experts (blocks of expert -1: zero k-steps) and more tiles than
    # programs, so each program walks several tiles of several experts.
    E, M, topk, K = 6, 37, 2, 256
    N = 256 if kind.startswith("fp8") or kind == "bf16_gated" else 192
    emap = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32, device=device)
    ids = torch.randint(-1, E, (M, topk), device=device)
    a = torch.randn(M, K, device=device)
    w = torch.randn(4, N, K, device=device) / K**0.5
    kw, dtype = {}, torch.float32
    width = N // 2 if "gated" in kind else N
    if kind.startswith("bf16") or kind == "tma":
        a, w, dtype = a.bfloat16(), w.bfloat16(), torch.bfloat16
    elif kind.startswith("fp8"):
        (a, a_s), (w, w_s) = quantize_fp8_per_token_group(a), quantize_fp8_block(w)
        kw, dtype = dict(a_scale=a_s, w_scale=w_s), torch.bfloat16
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=128 if kind.startswith("fp8") else 64, BLOCK_K=128, GROUP_M=2,
                       tma=kind == "tma")  # fmt: skip
    blocks = moe_align_block_size(ids, 16, E, emap, num_local_experts=4)
    tiles = blocks.max_padded // 16 * -(-width // cfg.BLOCK_N)
    assert tiles > 2 * INTERPRETER_SMS
    results = []
    for c in (cfg, persistent(cfg)):
        if kind == "fp8_gated":
            out = torch.full((M, topk, width), 3.0, device=device).to(FP8)
            kw["gated"] = GatedOutput(out_scale=torch.full((M * topk, width // FP8_GROUP), 5.0, device=device))
        else:
            out = torch.full((M, topk, width), 7.0, device=device, dtype=dtype)
            kw["gated"] = GatedOutput() if "gated" in kind else None
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=c, **kw)
        back = out.flatten(0, 1).float()
        if kind == "fp8_gated":
            back = back * kw["gated"].out_scale.repeat_interleave(128, dim=1)
        results.append(back)
    same_tiles(results[1], results[0])
    flat = ids.reshape(-1)
    assert (results[1][flat < 0] == (3.0 * 5.0 if kind == "fp8_gated" else 7.0)).all()  # dropped: untouched
    if kind in ("fp32", "bf16", "tma"):
        placed = flat >= 0
        assert_close(results[1][placed], gemm_spec(a, w, ids, topk, emap)[placed], dtype=dtype)


def test_persistent_walks_only_the_laid_out_blocks(device):
    # The grid is sized by the layout's upper bound; the used rows are read on the device. Pairs all
    # of one expert: one block used out of E's worth, and the stale bytes past it are never read.
    E, M, topk, K, N = 8, 5, 1, 64, 64
    ids = torch.full((M, topk), 3, device=device)
    a, w = torch.randn(M, K, device=device), torch.randn(E, N, K, device=device) / K**0.5
    blocks = moe_align_block_size(ids, 16, E)
    assert blocks.max_padded // 16 > 1
    out = torch.empty(M, topk, N, device=device)
    fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=persistent(KernelConfig(16, 64, 64)))
    assert_close(out.flatten(0, 1), gemm_spec(a, w, ids, topk), dtype=torch.float32)


def test_persistent_config_is_checked():
    with expect_raises(InvalidInputError, "no TAIL_M tile"):
        KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, TAIL_M=16, persistent=True)
    with expect_raises(InvalidInputError, "needs persistent=True"):
        KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, warp_specialize=True)
    for name in ("persistent", "warp_specialize"):
        with expect_raises(InvalidInputError, f"KernelConfig.{name} must be a bool"):
            KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, **{name: 1})
