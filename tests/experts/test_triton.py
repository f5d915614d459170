"""TritonExperts through the modular kernel, against moekit.reference (CPU: the interpreter)."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit import QuantScheme
from moekit.errors import InvalidInputError, QuantizationError
from moekit.experts.triton import TritonExperts
from moekit.hopper.configs import KernelConfig
from moekit.hopper.experts import HopperTritonExperts
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import (
    FP8,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import local_expert_ids, moe_reference, silu_and_mul
from moekit.testing import assert_close, expect_raises, experts_call
from moekit.types import ExpertPlacement, MoEWeights, ProblemSize
from moekit.workspace import WorkspacePool


def make_layer(device, *, M, K=128, N=128, E=8, topk=2, dtype=torch.float32, empty_slots=True):
    hidden = torch.randn(M, K, device=device).to(dtype)
    w1 = (torch.randn(E, N, K, device=device) / K**0.5).to(dtype)
    w2 = (torch.randn(E, K, N // 2, device=device) / (N // 2) ** 0.5).to(dtype)
    ids = torch.randint(-1 if empty_slots else 0, E, (M, topk), device=device)
    weights = torch.rand(M, topk, device=device)
    return hidden, w1, w2, weights, ids


def kernel(quant=QuantScheme.NONE, chunk_size=None, *, fused=False, **kw):
    # fused: the wing's class with its fused activation; else the book's (the wing's own tests: tests/hopper)
    experts = HopperTritonExperts(quant=quant, fuse_activation=True) if fused else TritonExperts(quant=quant)
    return moekit.ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=chunk_size, trace_counts=False, **kw)


def same(a, b, dtype):
    # What moekit promises: chunking changes a result by no more than the dtype's rounding. Not
    # bit-identity: under the interpreter tl.dot is numpy's matmul, whose OpenBLAS kernel (picked
    # per CPU) may round a row differently depending on its place in the tile (seen on AMD EPYC,
    # and here with OPENBLAS_CORETYPE=Zen); on a GPU the tiles themselves depend on the chunk's M.
    assert_close(a, b, dtype=dtype)


@pytest.mark.parametrize("M, C", [(1, 1), (2, 1), (5, 1), (1, 16), (15, 16), (16, 16), (17, 16), (35, 16), (129, 128)])
def test_chunked_equals_unchunked_equals_reference(device, M, C):
    layer = make_layer(device, M=M)
    whole = kernel()(*layer)
    chunked = kernel(chunk_size=C)(*layer)
    assert_close(whole, moe_reference(*layer), dtype=torch.float32)
    same(chunked, whole, torch.float32)


@pytest.mark.parametrize("M, C", [(1, 1), (17, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_activation(device, M, C, dtype):
    layer = make_layer(device, M=M, dtype=dtype)
    whole = kernel(fused=True)(*layer)
    assert_close(whole, moe_reference(*layer), dtype=dtype)
    same(kernel(chunk_size=C, fused=True)(*layer), whole, dtype)
    shapes = HopperTritonExperts(fuse_activation=True).workspace_shapes(
        ProblemSize(M, 128, 128, 2, 8, 8), act_dtype=dtype
    )
    assert shapes.workspace13 == (M, 2, 64) and shapes.workspace2 == (2 * M, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(device, dtype):
    # bf16 under the interpreter is right only because the GEMM upcasts its tiles (UPCAST_BF16).
    layer = make_layer(device, M=21, dtype=dtype)
    out = kernel(chunk_size=8)(*layer)
    assert out.dtype == dtype
    assert_close(out, moe_reference(*layer), dtype=dtype)


@pytest.mark.parametrize("world, fused", [(2, False), (4, False), (2, True)])
def test_expert_map_ranks_sum_to_reference(device, world, fused):
    E = 8
    hidden, w1, w2, weights, ids = make_layer(device, M=19, E=E, topk=3)
    E_local = E // world
    total = torch.zeros(hidden.shape, device=device)
    for rank in range(world):
        emap = torch.full((E,), -1, dtype=torch.int32, device=device)
        emap[rank * E_local : (rank + 1) * E_local] = torch.arange(E_local, dtype=torch.int32, device=device)
        lo, hi = rank * E_local, (rank + 1) * E_local
        rank_layer = (hidden, w1[lo:hi], w2[lo:hi], weights, ids)
        out = kernel(chunk_size=8, fused=fused)(*rank_layer, expert_map=emap)
        assert_close(out, moe_reference(*rank_layer, expert_map=emap), dtype=torch.float32)
        total += out
    assert_close(total, moe_reference(hidden, w1, w2, weights, ids), dtype=torch.float32)


def test_weird_shapes(device):
    # K=96, N/2=40, E=7 (not powers of two), topk=3; ids beyond the local experts are not local.
    hidden, w1, w2, weights, _ = make_layer(device, M=11, K=96, N=80, E=7, topk=3)
    ids = torch.randint(-1, 9, (11, 3), device=device)
    out = kernel()(hidden, w1, w2, weights, ids, global_num_experts=9)
    assert_close(out, moe_reference(hidden, w1, w2, weights, ids), dtype=torch.float32)


def _direct_call(device, *, M, K=128, N=128, E=4, topk=2, fill=float("nan"), fused=False):
    """An ExpertsCall whose workspaces and output hold ``fill`` before apply."""
    hidden, w1, w2, _, ids = make_layer(device, M=M, K=K, N=N, E=E, topk=topk)
    ids[0, 0] = -1
    experts = HopperTritonExperts(fuse_activation=True) if fused else TritonExperts()
    emap = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32, device=device)  # 2 remote experts
    placement = ExpertPlacement(E + 2, E, emap)
    call = experts_call(experts, hidden, ids, MoEWeights(w1, w2), placement=placement, fill=fill)
    return experts, call


@pytest.mark.parametrize("fused", [False, True])
def test_canary_every_output_element_written(device, fused):
    experts, call = _direct_call(device, M=9, fused=fused)
    assert experts.apply(call) == "triton"
    assert not call.output.isnan().any()
    ones = torch.ones(call.topk_ids.shape, device=device)
    layer = (call.hidden, call.weights.w1, call.weights.w2, ones, call.topk_ids)
    expected = moe_reference(*layer, expert_map=call.expert_map, apply_weights=False)
    assert_close(call.output, expected, dtype=torch.float32)
    local = local_expert_ids(call.topk_ids, 4, call.expert_map)
    assert (call.output[local < 0] == 0).all()  # remote experts and empty slots: zeros


def test_canary_poisoned_pool_through_the_kernel(device):
    layer = make_layer(device, M=20)
    pool = WorkspacePool(device)
    shapes = TritonExperts().workspace_shapes(ProblemSize(20, 128, 128, 2, 8, 8), act_dtype=torch.float32)
    views = pool.take(shapes)
    views.workspace13.fill_(float("nan"))
    views.workspace2.fill_(float("nan"))
    out = kernel(chunk_size=7, pool=pool)(*layer)
    assert not out.isnan().any()
    assert_close(out, moe_reference(*layer), dtype=torch.float32)


def test_m_zero(device):
    layer = make_layer(device, M=0)
    assert kernel(chunk_size=4)(*layer).shape == (0, 128)
    hidden, w1, w2, _, ids = make_layer(device, M=0)
    call = experts_call(TritonExperts(), hidden, ids, MoEWeights(w1, w2))
    assert call.problem.M == 0 and TritonExperts().apply(call) == "triton"


# ---------------------------------------------------------------------------------------------
# fp8 block


def fp8_layer(device, *, M, K=128, N=256, E=4, topk=2):
    hidden, w1, w2, weights, ids = make_layer(device, M=M, K=K, N=N, E=E, topk=topk)
    (q1, s1), (q2, s2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
    return hidden.bfloat16(), q1, q2, weights, ids, s1, s2


def fp8_reference(hidden, q1, q2, weights, ids, s1, s2, *, a2_scale=None, fused=False):
    """The fp8 path step by step in fp32: quantized input, GEMM1 output (rounded to bf16 unless
    the activation is fused into GEMM1), requantized intermediate (dynamic 1x128 groups, or the
    static per-tensor/per-token a2_scale). That bf16 rounding can flip an e4m3 code, so each
    path has its own reference."""
    x = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(hidden))
    w1, w2 = dequantize_fp8_block(q1, s1), dequantize_fp8_block(q2, s2)
    M, topk = ids.shape
    local = local_expert_ids(ids, w1.shape[0])
    out = torch.zeros(M, topk, w2.shape[1], device=hidden.device)
    for e in range(w1.shape[0]):
        rows, slots = torch.nonzero(local == e, as_tuple=True)
        h = x[rows] @ w1[e].t()
        y = silu_and_mul(h if fused else h.bfloat16().float())
        if a2_scale is None:
            y = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(y))
        else:
            s = a2_scale.reshape(-1)
            s = (s if s.numel() == 1 else s[rows]).view(-1, 1)
            y = (y / s).clamp(-448, 448).to(FP8).float() * s
        out[rows, slots] = y @ w2[e].t()
    return (out * weights.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_block_chunked(device, fused):
    hidden, q1, q2, weights, ids, s1, s2 = fp8_layer(device, M=19)
    fp8 = kernel(QuantScheme.FP8_BLOCK, chunk_size=8, fused=fused)
    out = fp8(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)
    assert out.dtype == torch.bfloat16
    assert_close(out, fp8_reference(hidden, q1, q2, weights, ids, s1, s2, fused=fused), dtype=torch.bfloat16)
    # Against the fp32 layer on the dequantized operands, which does not requantize the
    # intermediate: that step alone moves single outputs by a few percent.
    x = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(hidden))
    dequantized = moe_reference(x, dequantize_fp8_block(q1, s1), dequantize_fp8_block(q2, s2), weights, ids)
    assert_close(out, dequantized, dtype=FP8)
    whole = kernel(QuantScheme.FP8_BLOCK, fused=fused)(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)
    same(out, whole, torch.bfloat16)


@pytest.mark.parametrize("per_token, fused", [(True, False), (False, False), (True, True)])
def test_fp8_a2_scale_chunked_equals_unchunked(device, per_token, fused):
    # Upstream #28728 sliced a per-token a2_scale as [e:e]: every chunk got an empty scale.
    hidden, q1, q2, weights, ids, s1, s2 = fp8_layer(device, M=13)
    a2 = (torch.rand(13, 1, device=device) + 0.5) * 0.01 if per_token else torch.tensor([0.012], device=device)
    args = (hidden, q1, q2, weights, ids)
    whole = kernel(QuantScheme.FP8_BLOCK, fused=fused)(*args, w1_scale=s1, w2_scale=s2, a2_scale=a2)
    chunked = kernel(QuantScheme.FP8_BLOCK, chunk_size=5, fused=fused)(*args, w1_scale=s1, w2_scale=s2, a2_scale=a2)
    same(chunked, whole, torch.bfloat16)
    assert_close(whole, fp8_reference(*args, s1, s2, a2_scale=a2, fused=fused), dtype=torch.bfloat16)


def test_fp8_errors(device):
    hidden, q1, q2, weights, ids, s1, s2 = fp8_layer(device, M=4)
    with expect_raises(QuantizationError, match="quant=QuantScheme.FP8_BLOCK"):
        kernel()(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)  # fp8 weights, unquantized experts
    with expect_raises(QuantizationError, match="a2_scale"):
        kernel()(*make_layer(device, M=4), a2_scale=torch.ones(1, device=device))
    with expect_raises(QuantizationError, match="a2_scale must hold"):
        kernel(QuantScheme.FP8_BLOCK)(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2,
                                      a2_scale=torch.ones(3, 1, device=device))  # fmt: skip
    h96, w1, w2, wts, ids96 = make_layer(device, M=3, K=96, N=256)
    (p1, t1), (p2, t2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
    with expect_raises(QuantizationError, match="multiples of 128"):
        kernel(QuantScheme.FP8_BLOCK)(h96, p1, p2, wts, ids96, w1_scale=t1, w2_scale=t2)


def test_strided_hidden_and_subclassed_tiles(device):
    # The GEMMs read activations through their strides: a non-contiguous hidden needs no copy.
    hidden, w1, w2, weights, ids = make_layer(device, M=6)
    strided = torch.empty(12, 128, device=device)[::2].copy_(hidden)
    assert not strided.is_contiguous()
    assert_close(kernel()(strided, w1, w2, weights, ids), moe_reference(hidden, w1, w2, weights, ids),
                 dtype=torch.float32)  # fmt: skip

    class FixedTiles(TritonExperts):  # how a benchmark forces tiles: override the public hook
        def tile_configs(self, problem, dtype):
            return KernelConfig(16, 32, 32), KernelConfig(32, 32, 32)

    out = moekit.ModularKernel(NoEPPrepareFinalize(), FixedTiles(), trace_counts=False)(hidden, w1, w2, weights, ids)
    assert_close(out, moe_reference(hidden, w1, w2, weights, ids), dtype=torch.float32)
    with expect_raises(InvalidInputError, match="hidden's dtype"):
        kernel()(hidden.double(), w1, w2, weights, ids)


def test_once_policy_works_for_one_backend(device):
    # Pre-fix upstream declared workspaces once, at the chunk size; a shorter last chunk of the
    # same backend takes their leading rows. Only a backend switch breaks it (see
    # test_triton_or_deep_gemm.py).
    layer = make_layer(device, M=10)
    for guard in (True, False):
        k = kernel(chunk_size=8, workspace_policy="once", guard=guard)
        assert_close(k(*layer), moe_reference(*layer), dtype=torch.float32)
        assert [c.shapes for c in k.last_trace][0] == [c.shapes for c in k.last_trace][1]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 256, 2048])
@pytest.mark.parametrize("quant", [QuantScheme.NONE, QuantScheme.FP8_BLOCK])
@pytest.mark.parametrize("fused", [False, True])
def test_realistic_sizes_on_gpu(device, M, quant, fused):
    K, N, E, topk = 2048, 1536, 64, 8
    hidden, w1, w2, weights, _ = make_layer(device, M=M, K=K, N=N, E=E, topk=topk, dtype=torch.bfloat16)
    ids = torch.rand(M, E, device=device).topk(topk, dim=1).indices  # distinct experts per token
    if quant is QuantScheme.NONE:
        out = kernel(chunk_size=1024, fused=fused)(hidden, w1, w2, weights, ids)
        assert_close(out, moe_reference(hidden, w1, w2, weights, ids), dtype=torch.bfloat16)
        return
    (q1, s1), (q2, s2) = quantize_fp8_block(w1.float()), quantize_fp8_block(w2.float())
    out = kernel(quant, chunk_size=1024, fused=fused)(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)
    assert_close(out, fp8_reference(hidden, q1, q2, weights, ids, s1, s2, fused=fused), dtype=torch.bfloat16)
