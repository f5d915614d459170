"""One pair per block (decode without an align): the grouped GEMM gives each pair the align layout's row."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import InvalidIdsError, InvalidInputError
from moekit.hopper import pair_blocks as pb
from moekit.hopper.configs import KernelConfig
from moekit.hopper.experts import HopperTritonExperts as TritonExperts
from moekit.hopper.gemm_args import RowWindow
from moekit.hopper.grouped_gemm import GatedOutput, fused_moe_gemm
from moekit.kernels.align import moe_align_block_size
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.quant import (
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import moe_reference, silu_and_mul
from moekit.testing import assert_close, expect_raises, make_problem

CFG = KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)


def pair_spec(a, w, ids, pairs_per_row, expert_map=None, num_local=None):
    """out[i] = a[i // pairs_per_row] @ w[local(i)].T in fp32; zero for a remote expert or an empty slot."""
    E, num_local = len(expert_map) if expert_map is not None else w.shape[0], num_local or w.shape[0]
    out = torch.zeros(ids.numel(), w.shape[1])
    for i, g in enumerate(ids.reshape(-1).tolist()):
        if not 0 <= g < E:
            continue
        e = g if expert_map is None else int(expert_map[g])
        if 0 <= e < num_local:
            out[i] = a[i // pairs_per_row].float().cpu() @ w[e].float().cpu().t()
    return out


def _ids(device, M, topk, E, dtype=torch.int64):
    ids = torch.randint(0, E, (M, topk), dtype=dtype)
    ids.view(-1)[1] = ids.view(-1)[0]  # two slots of one expert: two blocks, one weight read each
    ids.view(-1)[-1] = -1  # an empty slot
    return ids.to(device)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_every_pair_gets_its_row(device, stage, ids_dtype):
    M, topk, E, K, N = 2, 3, 5, 64, 48  # N % BLOCK_N != 0
    ids = _ids(device, M, topk, E, ids_dtype)
    rows, ppr = (M, topk) if stage == 1 else (M * topk, 1)
    a = torch.randn(rows, K, device=device)
    w = torch.randn(E, N, K, device=device) / K**0.5
    out = torch.full((M, topk, N), 7.0, device=device)
    fused_moe_gemm(a, w, out, pb.pair_blocks(ids, CFG.BLOCK_M, E), pairs_per_row=ppr, config=CFG)
    assert_close(out.flatten(0, 1).cpu(), pair_spec(a, w, ids, ppr), dtype=torch.float32)  # empty slot: zeros


def test_expert_map_and_out_of_range_ids_as_the_align_places_them(device):
    E, M, topk, K, N = 6, 3, 2, 64, 32
    ids = torch.tensor([[0, 1], [5, 7], [-1, 4]], device=device)  # 7 >= E: an empty slot too
    emap = torch.tensor([0, -1, 1, -1, 2, 3], dtype=torch.int32, device=device)
    a = torch.randn(M, K, device=device)
    w = torch.randn(3, N, K, device=device)  # local expert 3 (global 5) is past num_local=3: remote
    outs = []
    for blocks in (pb.pair_blocks(ids, 16, E, emap, num_local_experts=3),
                   moe_align_block_size(ids, 16, E, emap, num_local_experts=3, keep_empty=True)):  # fmt: skip
        out = torch.full((M, topk, N), 7.0, device=device)
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=CFG)
        outs.append(out.flatten(0, 1).cpu())
    expected = pair_spec(a, w, ids, topk, emap, num_local=3)
    assert (expected.abs().sum(1) > 0).tolist() == [True, False, False, False, False, True]
    for out in outs:
        assert_close(out, expected, dtype=torch.float32)


@pytest.mark.parametrize("fp8", [False, True])
def test_gated_and_fp8(device, fp8):
    M, topk, E, K, N = 1, 4, 6, 128, 256
    ids = _ids(device, M, topk, E)
    a, w = torch.randn(M, K, device=device), torch.randn(E, N, K, device=device) / K**0.5
    blocks = pb.pair_blocks(ids, 16, E)
    out = torch.empty(M, topk, N // 2, device=device, dtype=torch.bfloat16)
    if fp8:
        aq, a_s = quantize_fp8_per_token_group(a)
        wq, w_s = quantize_fp8_block(w)
        cfg = KernelConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128)
        fused_moe_gemm(aq, wq, out, blocks, pairs_per_row=topk, config=cfg, a_scale=a_s, w_scale=w_s,
                       gated=GatedOutput())  # fmt: skip
        a, w = dequantize_fp8_per_token_group(aq, a_s), dequantize_fp8_block(wq, w_s)
    else:
        fused_moe_gemm(a.bfloat16(), w.bfloat16(), out, blocks, pairs_per_row=topk, config=CFG, gated=GatedOutput())
        a, w = a.bfloat16(), w.bfloat16()
    assert_close(out.flatten(0, 1).cpu(), silu_and_mul(pair_spec(a, w, ids, topk)), dtype=torch.bfloat16)


def test_tail_tile_config(device):
    # A TAIL_M config runs its short tile for every pair block (one real row each).
    M, topk, E, K, N = 2, 2, 3, 64, 64
    ids = _ids(device, M, topk, E)
    a, w = torch.randn(M, K, device=device), torch.randn(E, N, K, device=device) / 8
    out = torch.empty(M, topk, N, device=device)
    cfg = KernelConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, TAIL_M=16)
    fused_moe_gemm(a, w, out, pb.pair_blocks(ids, 32, E), pairs_per_row=topk, config=cfg)
    assert_close(out.flatten(0, 1).cpu(), pair_spec(a, w, ids, topk), dtype=torch.float32)


def test_refused_where_it_does_not_apply(device):
    ids = torch.zeros(2, 2, dtype=torch.int64, device=device)
    a, w = torch.randn(2, 32, device=device), torch.randn(2, 32, 32, device=device)
    out = torch.empty(2, 2, 32, device=device)
    blocks = pb.pair_blocks(ids, 16, 2)
    with expect_raises(InvalidInputError, match="PairBlocks"):
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=2, config=CFG, chunk=RowWindow(0, 16))
    with expect_raises(InvalidInputError, match="PairBlocks"):
        fused_moe_gemm(a, w, out, blocks, pairs_per_row=2, config=KernelConfig(16, 32, 32, persistent=True))
    with expect_raises(InvalidInputError, match="blocks must be"):
        fused_moe_gemm(a, w, out, ids, pairs_per_row=2, config=CFG)
    with expect_raises(InvalidIdsError):
        pb.pair_blocks(ids.to(torch.uint8), 16, 2)
    with expect_raises(InvalidIdsError):
        pb.pair_blocks(ids.t(), 16, 2)
    with expect_raises(InvalidInputError, match="expert_map"):
        pb.pair_blocks(ids, 16, 2, torch.zeros(3, dtype=torch.int32, device=device))
    with expect_raises(InvalidInputError, match="block_m"):
        pb.pair_blocks(ids, 0, 2)


@pytest.fixture
def align_calls(monkeypatch):
    """The align launches HopperTritonExperts makes, counted."""
    import moekit.hopper.experts as triton_experts

    calls = []
    real = triton_experts.launch_align

    def counted(*args, **kwargs):
        calls.append(kwargs.get("block_m", args[1] if len(args) > 1 else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_experts, "launch_align", counted)
    return calls


@pytest.mark.parametrize("fuse", [False, True])
def test_triton_experts_skip_the_align_up_to_pair_max(device, align_calls, monkeypatch, fuse):
    p = make_problem(2, E=6, topk=4, K=64, N=64, empty_every=2, seed=3, device=device)
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(fuse_activation=fuse), trace_counts=False)
    ref = moe_reference(p.hidden.float(), p.w1.float(), p.w2.float(), p.topk_weights, p.topk_ids)
    assert p.topk_ids.numel() <= pb.PAIR_MAX
    out = kernel(p.hidden, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert align_calls == []
    assert_close(out, ref, dtype=torch.bfloat16)
    monkeypatch.setattr(pb, "PAIR_MAX", 0)
    aligned = kernel(p.hidden, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert align_calls
    assert_close(aligned, out, dtype=torch.bfloat16)


def test_counts_asked_for_still_skip_the_align(device, align_calls):
    # The chunk's counts (trace_counts) come from the count kernel, launched by the modular kernel
    # once per chunk: decode keeps its pair blocks and the trace its counts.
    p = make_problem(1, E=6, topk=4, K=64, N=64, seed=5, device=device)
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), trace_counts=True)
    kernel(p.hidden, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert align_calls == []
    counts = kernel.last_trace.chunks[0].counts
    assert counts.tolist() == torch.bincount(p.topk_ids[p.topk_ids >= 0].long().cpu(), minlength=6).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("mapped", [False, True])
def test_bit_identical_to_the_align_layout_on_gpu(device, M, mapped):
    # Qwen3-30B-A3B's GEMM1 at decode with the table's tile: each row of a tile is its own dot
    # product, so one pair per block changes no bit of any pair's row.
    from moekit.hopper.configs import get_config

    E, topk, K, N = 128, 8, 2048, 1536
    ids = torch.rand(M, E, device=device).topk(topk, dim=1).indices
    ids[0, -1] = -1
    emap = (torch.arange(E, device=device, dtype=torch.int32) - 32) if mapped else None
    local = 96 if mapped else E
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    w = (torch.randn(local, N, K, device=device) / K**0.5).bfloat16()
    cfg = get_config(M, N, K, E, topk, torch.bfloat16, stage=1)
    outs = []
    layouts = (pb.pair_blocks(ids, cfg.BLOCK_M, E, emap, num_local_experts=local),
               moe_align_block_size(ids, cfg.BLOCK_M, E, emap, num_local_experts=local, keep_empty=True))  # fmt: skip
    for blocks in layouts:
        out = torch.empty(M, topk, N, device=device, dtype=torch.bfloat16)
        outs.append(fused_moe_gemm(a, w, out, blocks, pairs_per_row=topk, config=cfg))
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[0].flatten(0, 1).cpu(), pair_spec(a, w, ids, topk, emap, local), dtype=torch.bfloat16)


@pytest.mark.parametrize("M, aligned", [(2, False), (3, True)])
def test_the_limit_picks_the_layout(device, align_calls, monkeypatch, M, aligned):
    monkeypatch.setattr(pb, "PAIR_MAX", 4)  # M=2 at top-2: 4 pairs, one block each; M=3: 6, aligned
    p = make_problem(M, E=4, topk=2, K=32, N=64, seed=M, device=device)
    out = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), trace_counts=False)(*p.inputs())
    assert bool(align_calls) == aligned
    p.check(out)
