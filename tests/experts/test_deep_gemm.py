"""DeepGemmExperts (Triton contiguous GEMM here; real deep_gemm where usable) vs the reference."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.errors import BackendUnavailableError, InvalidInputError, QuantizationError, StaleMetadataError
from moekit.experts.deep_gemm import DeepGemmExperts
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import (
    FP8,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import count_reference, moe_reference
from moekit.routing import contiguous_expert_map, uniform_router
from moekit.testing import assert_close, expect_raises, experts_call
from moekit.types import ExpertPlacement, ExpertTokensMetadata, MoEWeights, ProblemSize, QuantScheme


def layer(M, K, N, E, topk, device, *, E_global=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, K, generator=g).to(torch.bfloat16).to(device)
    w1q, w1s = quantize_fp8_block((torch.randn(E, N, K, generator=g) / K**0.5).to(device))
    w2q, w2s = quantize_fp8_block((torch.randn(E, K, N // 2, generator=g) / (N // 2) ** 0.5).to(device))
    weights, ids = uniform_router(M, E_global or E, topk, seed=seed, device=device)
    return hidden, MoEWeights(w1q, w2q, w1s, w2s), weights, ids


def reference(hidden, w: MoEWeights, weights, ids, **kw):
    """The fp32 oracle on the same fp8 inputs the kernel sees (dequantized acts and weights)."""
    x = dequantize_fp8_per_token_group(*quantize_fp8_per_token_group(hidden))
    w1, w2 = dequantize_fp8_block(w.w1, w.w1_scale), dequantize_fp8_block(w.w2, w.w2_scale)
    return moe_reference(x, w1, w2, weights, ids, **kw)


def check(out, hidden, w, weights, ids, **kw):
    """Within ~3e-2 of the oracle. The kernel also requantizes the activation between the GEMMs
    (1x128 fp8 groups: ~2.5% relative noise in norm, up to ~3.5% of the max on one element),
    which the fp32 oracle does not, so the bounds sit just above that noise."""
    ref = reference(hidden, w, weights, ids, **kw)
    err = out.float() - ref
    assert float(err.norm() / ref.norm()) < 4e-2
    assert float(err.abs().max()) < 6e-2 * float(ref.abs().max())


def run(kernel, hidden, w: MoEWeights, weights, ids, **kw):
    return kernel(hidden, w.w1, w.w2, weights, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale, **kw)


def apply_direct(experts, hidden, w, ids, *, tokens_meta=None, expert_map=None, E_global=None, guard=True):
    """One experts call outside the modular kernel; returns (backend, unweighted [M, topk, K])."""
    E = w.w1.shape[0]
    q, s = quantize_fp8_per_token_group(hidden)
    placement = ExpertPlacement(E_global or E, E, expert_map)
    call = experts_call(experts, q, ids, w, hidden_scale=s, placement=placement, tokens_meta=tokens_meta,
                        fill=float("nan"))  # fmt: skip
    call.guard = guard
    return experts.apply(call), call.output


@pytest.mark.parametrize("M,K,N,E,topk", [(40, 128, 256, 4, 2), (13, 256, 128, 3, 3)])
def test_matches_reference(M, K, N, E, topk, device):
    hidden, w, weights, ids = layer(M, K, N, E, topk, device)
    ids[0, -1] = -1  # an empty slot
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts())
    out = run(kernel, hidden, w, weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (M, K)
    check(out, hidden, w, weights, ids)
    assert kernel.last_trace.backends == [DeepGemmExperts().backend_for(ProblemSize(M, N, K, topk, E, E))]


def test_chunked_equals_unchunked(device):
    hidden, w, weights, ids = layer(40, 128, 256, 4, 2, device)
    whole = run(moekit.ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts()), hidden, w, weights, ids)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts(), chunk_size=16)
    chunked = run(kernel, hidden, w, weights, ids)
    assert len(kernel.last_trace) == 3
    # Within the fp8 tolerance, not bit for bit: a row's place in a tile moves with the chunking,
    # and the interpreter's matmul (OpenBLAS, chosen per CPU) may round it differently there.
    assert_close(chunked, whole, dtype=torch.bfloat16)


def test_expert_map_zeroes_non_local_slots(device):
    """Upstream computed non-local rows with expert 0 and relied on zero router weights
    (reference note 7.4 #28); moekit writes zeros, so non-zero weights cannot leak garbage."""
    E_global, ep = 8, 2
    hidden, w, weights, ids = layer(24, 128, 128, E_global // ep, 2, device, E_global=E_global)
    emap = contiguous_expert_map(E_global, ep, 1, device=device)
    backend, out = apply_direct(DeepGemmExperts(), hidden, w, ids, expert_map=emap, E_global=E_global)
    check(out, hidden, w, weights, ids, expert_map=emap, apply_weights=False)
    non_local = emap[ids.long()] < 0
    assert non_local.any() and bool((out[non_local] == 0).all())
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts(), chunk_size=10)
    full = run(kernel, hidden, w, weights.abs() + 0.5, ids, expert_map=emap, global_num_experts=E_global)
    check(full, hidden, w, weights.abs() + 0.5, ids, expert_map=emap)


def test_exact_rows_from_cpu_counts(device):
    hidden, w, weights, ids = layer(40, 128, 256, 4, 2, device)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(return_counts=True), DeepGemmExperts(), chunk_size=16)
    out = run(kernel, hidden, w, weights, ids)
    check(out, hidden, w, weights, ids)
    for rec in kernel.last_trace:
        counts = count_reference(ids[rec.start : rec.end], 4).long()
        assert rec.shapes.workspace13[0] == int(((counts + 127) // 128 * 128).sum())  # exact M_sum


def test_whole_batch_counts_are_a_hard_error(device):
    hidden, w, weights, ids = layer(40, 128, 256, 4, 2, device)
    pf = NoEPPrepareFinalize(return_counts=True)
    stale = moekit.ModularKernel(pf, DeepGemmExperts(), chunk_size=16, metadata_policy="whole_batch")
    with expect_raises(StaleMetadataError, match="bug 2"):
        run(stale, hidden, w, weights, ids)
    fixed = moekit.ModularKernel(pf, DeepGemmExperts(), chunk_size=16, metadata_policy="per_chunk")
    check(run(fixed, hidden, w, weights, ids), hidden, w, weights, ids)


def test_undercounting_device_counts_are_caught(device):
    hidden, w, weights, ids = layer(20, 128, 128, 2, 2, device)
    counts = count_reference(ids, 2)
    counts[0] -= 1  # device counts only: the layout would put a row in expert 1's segment
    with pytest.raises(StaleMetadataError, match="belongs to another batch"):
        apply_direct(DeepGemmExperts(), hidden, w, ids, tokens_meta=ExpertTokensMetadata(counts))


def test_no_local_pairs_gives_zeros(device):
    hidden, w, weights, ids = layer(6, 128, 128, 2, 2, device, E_global=4)
    emap = torch.tensor([-1, -1, 0, 1], dtype=torch.int32, device=device)
    ids = ids % 2  # every slot on the other rank
    counts = torch.zeros(2, dtype=torch.int32, device=device)
    meta = ExpertTokensMetadata(counts, counts.cpu())
    _, out = apply_direct(DeepGemmExperts(), hidden, w, ids, tokens_meta=meta, expert_map=emap, E_global=4)
    assert bool((out == 0).all())


def test_gemm2_k_not_a_multiple_of_128(device):
    hidden, w, weights, ids = layer(20, 128, 384, 2, 2, device)  # I = N/2 = 192 (a K tail)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts())
    check(run(kernel, hidden, w, weights, ids), hidden, w, weights, ids)
    assert kernel.last_trace.backends == ["deep_gemm[triton]"]  # deep_gemm needs I % 128 == 0


def test_workspace_shapes():
    dg = DeepGemmExperts()
    p = ProblemSize(M=4, N=256, K=512, topk=2, global_num_experts=64, num_local_experts=16)
    shapes = dg.workspace_shapes(p, act_dtype=FP8)
    # At most M*topk = 8 experts are non-empty, so the worst case pads 8 segments, not 16.
    M_sum = (8 + 127 * 8 + 127) // 128 * 128
    assert shapes.workspace13 == (M_sum, 512) and shapes.workspace2[0] > M_sum
    assert shapes.workspace2[1] == 512 and shapes.output == (4, 2, 512) and shapes.dtype == torch.bfloat16
    big = dg.workspace_shapes(p.with_M(4096), act_dtype=FP8)
    assert big.workspace13[0] == (4096 * 2 + 127 * 16 + 127) // 128 * 128
    cpu = torch.tensor([0] * 15 + [129], dtype=torch.int32)
    meta = ExpertTokensMetadata(torch.zeros(16, dtype=torch.int32), cpu)
    assert dg.workspace_shapes(p.with_M(100), act_dtype=FP8, tokens_meta=meta).workspace13[0] == 256
    # Counts for a larger batch size the layout all the same: 256 rows for M=4 (the soft cost
    # of stale counts); it is apply that refuses them, under the guard.
    assert dg.workspace_shapes(p, act_dtype=FP8, tokens_meta=meta).workspace13[0] == 256
    (q1, s1), (q2, s2) = quantize_fp8_block(torch.randn(16, 192, 512)), quantize_fp8_block(torch.randn(16, 512, 96))
    with pytest.raises(QuantizationError, match="multiples of 128"):
        dg.check(ProblemSize(4, 192, 512, 2, 16, 16), MoEWeights(q1, q2, s1, s2))


def test_stale_counts_are_refused_under_the_guard_and_trusted_without(device):
    hidden, w, weights, ids = layer(4, 128, 256, 4, 2, device)
    # Whole-batch counts over-count every expert of a chunk: 8 + 9 = 17 pairs for 4 x 2 slots.
    stale = count_reference(ids, 4).cpu() + torch.tensor([5, 0, 1, 3], dtype=torch.int32)
    meta = ExpertTokensMetadata(stale.to(device), stale)
    with pytest.raises(StaleMetadataError, match="M\\*topk = 4 tokens x 2 slots = 8 pairs"):
        apply_direct(DeepGemmExperts(), hidden, w, ids, tokens_meta=meta)
    # Unguarded, as upstream after #20903: a larger layout (the soft cost), the same result.
    _, out = apply_direct(DeepGemmExperts(), hidden, w, ids, tokens_meta=meta, guard=False)
    check(out, hidden, w, weights, ids, apply_weights=False)


def test_construction_errors():
    with pytest.raises(QuantizationError):
        DeepGemmExperts(quant=QuantScheme.NONE)
    with pytest.raises(InvalidInputError):
        DeepGemmExperts(backend="cutlass")
    if not moekit.backends.deep_gemm.status().usable:
        with pytest.raises(BackendUnavailableError, match="deep_gemm"):
            DeepGemmExperts(backend="deep_gemm")
    p = ProblemSize(128, 256, 256, 2, 4, 4)
    assert DeepGemmExperts(backend="triton").backend_for(p) == "deep_gemm[triton]"
    assert DeepGemmExperts.uses_tokens_meta and DeepGemmExperts.supports_chunking


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_realistic_size(backend, device):
    hidden, w, weights, ids = layer(512, 2048, 1536, 32, 8, device)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts(backend=backend), chunk_size=200)
    check(run(kernel, hidden, w, weights, ids), hidden, w, weights, ids)
