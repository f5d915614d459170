"""TritonOrDeepGemmExperts: the per-chunk backend switch of bug 1 (vLLM PR #20392)."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.errors import MoekitError, WorkspaceShapeError
from moekit.experts.triton_or_deep_gemm import TritonOrDeepGemmExperts
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import (
    FP8,
    FP8_GROUP,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import moe_reference
from moekit.routing import uniform_router
from moekit.testing import expect_raises
from moekit.types import ProblemSize, QuantScheme

K, N, E, TOPK = 128, 256, 4, 2


def layer(M, device, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, K, generator=g).to(torch.bfloat16).to(device)
    w1q, w1s = quantize_fp8_block((torch.randn(E, N, K, generator=g) / K**0.5).to(device))
    w2q, w2s = quantize_fp8_block((torch.randn(E, K, N // 2, generator=g) / (N // 2) ** 0.5).to(device))
    weights, ids = uniform_router(M, E, TOPK, seed=seed, device=device)
    return hidden, (w1q, w1s, w2q, w2s), weights, ids


def run(kernel, hidden, w, weights, ids):
    w1q, w1s, w2q, w2s = w
    return kernel(hidden, w1q, w2q, weights, ids, w1_scale=w1s, w2_scale=w2s)


def check(out, hidden, w, weights, ids):
    """Within ~3e-2 of the fp32 oracle on the dequantized inputs (the fp8 requant of the
    activation between the GEMMs adds ~2.5% noise that the oracle does not have)."""
    w1q, w1s, w2q, w2s = w
    x = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(hidden))
    ref = moe_reference(x, dequantize_fp8_block(w1q, w1s), dequantize_fp8_block(w2q, w2s), weights, ids)
    err = out.float() - ref
    assert float(err.norm() / ref.norm()) < 4e-2
    assert float(err.abs().max()) < 6e-2 * float(ref.abs().max())


def kernel(**kw):
    return moekit.ModularKernel(NoEPPrepareFinalize(), TritonOrDeepGemmExperts(), **kw)


def deep_gemm_ish(name: str) -> bool:
    return name.startswith("deep_gemm")  # "deep_gemm" (real) or "deep_gemm[triton]" (moekit's GEMM)


@pytest.mark.parametrize("M,backends", [(130, ["dg", "triton"]), (257, ["dg", "dg", "triton"])])
def test_switches_backend_inside_one_forward(M, backends, device):
    hidden, w, weights, ids = layer(M, device)
    k = kernel(chunk_size=128)
    out = run(k, hidden, w, weights, ids)
    got = k.last_trace.backends
    assert ["dg" if deep_gemm_ish(b) else b for b in got] == backends, got
    shapes = [c.shapes for c in k.last_trace]
    assert shapes[0].workspace13 != shapes[-1].workspace13  # each chunk declared its own
    assert len({s.output[1:] for s in shapes}) == 1  # one output layout: (M, topk, K)
    check(out, hidden, w, weights, ids)


def test_once_policy_fails_named_under_the_guard(device):
    hidden, w, weights, ids = layer(130, device)
    with expect_raises(WorkspaceShapeError, match="bug 1"):
        run(kernel(chunk_size=128, workspace_policy="once"), hidden, w, weights, ids)


@pytest.mark.parametrize("M,C", [(130, 128), (257, 128), (300, 256)])
def test_the_pre_fix_run_crashes_as_upstream_did(M, C, device):
    # The parent commit (41060c6e0): workspaces declared once at the chunk size and carved with
    # prefix views (the Triton chunk's caches fit in DeepGEMM's larger buffers), the whole output
    # declared by DeepGEMM's rule as 2-D (M*topk, K), and the Triton chunk handed a 2-D slice:
    # its launcher reads output.stride(2), and torch raises IndexError. No moekit check involved.
    hidden, w, weights, ids = layer(M, device)
    pre_fix = moekit.ModularKernel(NoEPPrepareFinalize(), TritonOrDeepGemmExperts(flat_output=True), chunk_size=C,
                                   workspace_policy="once", guard=False)  # fmt: skip
    upstream = r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)"
    with pytest.raises(IndexError, match=upstream) as raw:
        run(pre_fix, hidden, w, weights, ids)
    assert not isinstance(raw.value, MoekitError)
    *full, last = pre_fix.last_trace.chunks
    assert all(deep_gemm_ish(c.backend) and c.completed for c in full)
    assert last.backend == "triton" and not last.completed and last.output_shape == ((M - C * len(full)) * TOPK, K)
    assert last.shapes == full[0].shapes != last.needed  # handed DeepGEMM's buffers, needed Triton's


def test_the_fix_has_two_parts(device):
    # (b) alone, one output layout, avoids this crash (the Triton caches fit DeepGEMM's buffers);
    # (a) alone, per-chunk workspaces, does not: the 2-D output still reaches the Triton chunk.
    hidden, w, weights, ids = layer(130, device)
    b_only = moekit.ModularKernel(NoEPPrepareFinalize(), TritonOrDeepGemmExperts(), chunk_size=128,
                                  workspace_policy="once", guard=False)  # fmt: skip
    check(run(b_only, hidden, w, weights, ids), hidden, w, weights, ids)
    a_only = moekit.ModularKernel(NoEPPrepareFinalize(), TritonOrDeepGemmExperts(flat_output=True), chunk_size=128,
                                  guard=False)  # fmt: skip
    with pytest.raises(IndexError):
        run(a_only, hidden, w, weights, ids)
    named = moekit.ModularKernel(NoEPPrepareFinalize(), TritonOrDeepGemmExperts(flat_output=True), chunk_size=128)
    with expect_raises(WorkspaceShapeError, match="same output layout"):
        run(named, hidden, w, weights, ids)


@pytest.mark.parametrize("M,dg", [(127, False), (128, True)])
def test_threshold_is_m_ge_128_unchunked(M, dg, device):
    hidden, w, weights, ids = layer(M, device)
    k = kernel()
    check(run(k, hidden, w, weights, ids), hidden, w, weights, ids)
    (backend,) = k.last_trace.backends
    assert deep_gemm_ish(backend) == dg


def test_small_chunks_stay_on_triton_although_m_is_large(device):
    hidden, w, weights, ids = layer(130, device)
    k = kernel(chunk_size=64)
    out = run(k, hidden, w, weights, ids)
    assert k.last_trace.backends == ["triton"] * 3
    check(out, hidden, w, weights, ids)


def test_one_predicate_decides_everything():
    ex = TritonOrDeepGemmExperts(deep_gemm_backend="triton")
    for M, N_, K_ in [(127, 256, 128), (128, 256, 128), (4096, 384, 256), (500, 256, 192), (128, 192, 128)]:
        p = ProblemSize(M, N_, K_, 2, 8, 8)
        dg = ex.uses_deep_gemm(p)
        assert dg == (M >= 128 and N_ % FP8_GROUP == 0 and K_ % FP8_GROUP == 0)  # M: the switch
        assert deep_gemm_ish(ex.backend_for(p)) == dg
        want = (ex.deep_gemm if dg else ex.triton).workspace_shapes(p, act_dtype=FP8)
        assert ex.workspace_shapes(p, act_dtype=FP8) == want


def test_flags_and_unquantized():
    ex = TritonOrDeepGemmExperts()
    assert ex.supports_chunking and ex.supports_expert_map and ex.uses_tokens_meta
    plain = TritonOrDeepGemmExperts(quant=QuantScheme.NONE)
    assert plain.deep_gemm is None
    assert plain.backend_for(ProblemSize(4096, 256, 256, 2, 4, 4)) == "triton"


@pytest.mark.gpu
def test_realistic_size_crosses_the_switch(device):
    g = torch.Generator().manual_seed(0)
    M, K_, N_, E_, topk = 300, 2048, 1536, 32, 8
    hidden = torch.randn(M, K_, generator=g).to(torch.bfloat16).to(device)
    w1q, w1s = quantize_fp8_block((torch.randn(E_, N_, K_, generator=g) / K_**0.5).to(device))
    w2q, w2s = quantize_fp8_block((torch.randn(E_, K_, N_ // 2, generator=g) / (N_ // 2) ** 0.5).to(device))
    weights, ids = uniform_router(M, E_, topk, seed=0, device=device)
    k = kernel(chunk_size=256)
    w = (w1q, w1s, w2q, w2s)
    out = run(k, hidden, w, weights, ids)
    assert deep_gemm_ish(k.last_trace.backends[0]) and k.last_trace.backends[1] == "triton"
    check(out, hidden, w, weights, ids)
