"""NaiveBatchedExperts and BatchedTritonExperts, through the modular kernel, against the reference."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.errors import (
    FormatMismatchError,
    InvalidInputError,
    QuantizationError,
    StaleMetadataError,
)
from moekit.experts.base import Experts
from moekit.experts.batched import BatchedTritonExperts, NaiveBatchedExperts
from moekit.prepare_finalize.batched import BatchedPrepareFinalize
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import (
    FP8,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from moekit.reference import count_reference, moe_reference
from moekit.routing import uniform_router
from moekit.testing import assert_close, expect_raises, experts_call
from moekit.types import (
    ActivationFormat,
    ExpertPlacement,
    ExpertTokensMetadata,
    MoEWeights,
    ProblemSize,
    QuantScheme,
)

CLASSES = [NaiveBatchedExperts, BatchedTritonExperts]
POISON = -12345.0

def _layer(M, K, N, E, topk, dtype, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, K, generator=g).to(dtype)
    w1 = (torch.randn(E, N, K, generator=g) / K**0.5).to(dtype)
    w2 = (torch.randn(E, K, N // 2, generator=g) / (N // 2) ** 0.5).to(dtype)
    weights, ids = uniform_router(M, E, topk, seed=seed)
    return hidden, w1, w2, weights, ids


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, K, N, E, topk", [(12, 64, 96, 4, 2), (9, 40, 34, 5, 1)])
def test_matches_reference(cls, dtype, M, K, N, E, topk):
    hidden, w1, w2, weights, ids = _layer(M, K, N, E, topk, dtype)
    ids[0, 0] = -1  # an empty slot
    kernel = moekit.ModularKernel(BatchedPrepareFinalize(max_tokens=M), cls())
    out = kernel(hidden, w1, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (M, K)
    assert_close(out, moe_reference(hidden, w1, w2, weights, ids), dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", CLASSES)
def test_expert_parallel_two_ranks_sum_to_reference(cls):
    """Each rank holds 3 of 6 experts (interleaved); the ranks' outputs add up to the layer."""
    M, K, N, E, topk = 10, 32, 48, 6, 2
    hidden, w1, w2, weights, ids = _layer(M, K, N, E, topk, torch.float32)
    total = torch.zeros(M, K)
    for rank in range(2):
        mine = torch.arange(rank, E, 2)  # global ids of this rank's experts
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[mine] = torch.arange(mine.numel(), dtype=torch.int32)
        kernel = moekit.ModularKernel(BatchedPrepareFinalize(max_tokens=M), cls())
        total += kernel(hidden, w1[mine], w2[mine], weights, ids, expert_map=emap, global_num_experts=E)
        counts = kernel.last_trace.chunks[0].counts
        assert counts.shape == (3,)  # E_local, not E_global
        assert torch.equal(counts, count_reference(ids, 3, emap))
    assert_close(total, moe_reference(hidden, w1, w2, weights, ids), dtype=torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", CLASSES)
def test_fp8_block(cls):
    M, K, N, E = 8, 256, 256, 3
    hidden, w1, w2, weights, ids = _layer(M, K, N, E, 2, torch.bfloat16)
    q1, s1 = quantize_fp8_block(w1)
    q2, s2 = quantize_fp8_block(w2)
    kernel = moekit.ModularKernel(BatchedPrepareFinalize(max_tokens=M), cls(quant=QuantScheme.FP8_BLOCK))
    out = kernel(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)
    hq, hs = quantize_fp8_per_token_group(hidden)
    expected = moe_reference(
        dequantize_fp8_per_token_group(hq, hs), dequantize_fp8_block(q1, s1), dequantize_fp8_block(q2, s2),
        weights, ids,
    )
    assert_close(out, expected, dtype=FP8)


class _Recording(NaiveBatchedExperts):
    def __init__(self):
        super().__init__()
        self.calls = []

    def apply(self, call):
        self.calls.append(call)
        return super().apply(call)


class _RecordingPF(BatchedPrepareFinalize):
    def prepare(self, *args, **kwargs):
        self.prepared = super().prepare(*args, **kwargs)
        return self.prepared


@pytest.mark.interpreter
def test_chunk_size_is_ignored():
    M, K, N, E = 12, 32, 32, 4
    hidden, w1, w2, weights, ids = _layer(M, K, N, E, 2, torch.float32)
    experts, pf = _Recording(), _RecordingPF(max_tokens=M)
    kernel = moekit.ModularKernel(pf, experts, chunk_size=4)
    out = kernel(hidden, w1, w2, weights, ids)
    assert len(experts.calls) == 1 and len(kernel.last_trace) == 1
    assert experts.calls[0].tokens_meta is pf.prepared.tokens_meta  # not recounted per chunk
    assert kernel.last_trace.chunks[0].output_shape == (E, M, K)
    assert_close(out, moe_reference(hidden, w1, w2, weights, ids), dtype=torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", CLASSES)
def test_m_zero_runs_no_experts_and_records_no_chunk(cls):
    hidden, w1, w2, weights, ids = _layer(0, 32, 32, 4, 2, torch.float32)

    class Watched(cls):
        def apply(self, call):
            raise AssertionError("experts ran for M=0")

    kernel = moekit.ModularKernel(BatchedPrepareFinalize(max_tokens=4), Watched())
    out = kernel(hidden, w1, w2, weights, ids)
    assert out.shape == (0, 32) and len(kernel.last_trace) == 0 and kernel.last_trace.M == 0


class _StandardDouble(Experts):
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        raise AssertionError("never called")

    def apply(self, call):
        raise AssertionError("never called")


@pytest.mark.parametrize("cls", CLASSES)
def test_mismatched_formats_raise(cls):
    with expect_raises(FormatMismatchError, match="batched"):
        moekit.ModularKernel(NoEPPrepareFinalize(), cls())
    with expect_raises(FormatMismatchError, match="standard"):
        moekit.ModularKernel(BatchedPrepareFinalize(max_tokens=4), _StandardDouble())


@pytest.mark.parametrize("cls", CLASSES)
def test_flags_and_workspace_shapes(cls):
    experts = cls()
    assert experts.activation_format is ActivationFormat.BATCHED
    assert not experts.supports_chunking and experts.supports_expert_map and experts.uses_tokens_meta
    shapes = experts.workspace_shapes(ProblemSize(16, 96, 64, 2, 8, 4), act_dtype=torch.bfloat16)
    assert (shapes.workspace13, shapes.workspace2, shapes.output) == ((4, 16, 96), (4, 16, 48), (4, 16, 64))
    assert shapes.dtype == torch.bfloat16
    fp8 = cls(quant=QuantScheme.FP8_BLOCK).workspace_shapes(
        ProblemSize(16, 96, 64, 2, 8, 4), act_dtype=FP8
    )
    assert fp8.dtype == torch.bfloat16


def _direct_call(cls, counts, *, meta=True):
    """An ExpertsCall built by hand from BatchedPrepareFinalize, with a poisoned output."""
    E, K, N, M = len(counts), 32, 48, 8
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]).view(-1, 1)
    hidden = torch.randn(ids.shape[0], K)
    w1, w2 = torch.randn(E, N, K) / 6, torch.randn(E, K, N // 2) / 5
    prepared = BatchedPrepareFinalize(max_tokens=M).prepare(
        hidden, torch.ones(ids.shape), ids, quant=QuantScheme.NONE, placement=ExpertPlacement(E, E)
    )
    call = experts_call(cls(), prepared.a1q, ids, MoEWeights(w1, w2), fill=float("nan"),  # stale bytes must not leak
                        tokens_meta=prepared.tokens_meta if meta else None)  # fmt: skip
    call.output.fill_(POISON)
    return call, hidden, ids


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", CLASSES)
def test_empty_experts_and_padding_rows_are_skipped(cls):
    counts = [3, 0, 8, 1]
    call, hidden, ids = _direct_call(cls, counts)
    assert cls().apply(call) == ("torch" if cls is NaiveBatchedExperts else "triton")
    unweighted = moe_reference(hidden, call.weights.w1, call.weights.w2, torch.ones(ids.shape), ids)
    start = 0
    for e, n in enumerate(counts):
        assert_close(call.output[e, :n], unweighted[start : start + n], dtype=torch.float32)
        assert (call.output[e, n:] == POISON).all(), f"expert {e}: padding or empty slab was written"
        start += n


@pytest.mark.parametrize("cls", CLASSES)
def test_apply_needs_matching_tokens_meta(cls):
    call, _, _ = _direct_call(cls, [2, 1], meta=False)
    with expect_raises(InvalidInputError, match="tokens_meta"):
        cls().apply(call)
    call.tokens_meta = ExpertTokensMetadata(torch.tensor([2, 1, 0], dtype=torch.int32))  # E_global-sized
    with expect_raises(StaleMetadataError, match=r"expected \[2\]"):
        cls().apply(call)


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", CLASSES)
def test_fp8_experts_refuse_bf16_weights_and_any_a2_scale(cls):
    hidden, w1, w2, weights, ids = _layer(12, 128, 256, 4, 2, torch.float32)
    fp8 = moekit.ModularKernel(BatchedPrepareFinalize(max_tokens=24), cls(quant=QuantScheme.FP8_BLOCK))
    with expect_raises(QuantizationError, match="fp8"):
        fp8(hidden, w1, w2, weights, ids)
    (q1, s1), (q2, s2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
    # Batched experts requantize with dynamic scales; a static a2_scale used to be ignored silently.
    for a2 in (torch.tensor([0.01]), torch.full((12,), 0.01)):
        with expect_raises(QuantizationError, match="a2_scale"):
            fp8(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2, a2_scale=a2)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [QuantScheme.NONE, QuantScheme.FP8_BLOCK])
def test_gpu_triton_matches_reference(quant):
    M, K, N, E, topk = 200, 256, 512, 8, 2
    hidden, w1, w2, weights, ids = _layer(M, K, N, E, topk, torch.bfloat16)
    hidden, w1, w2, weights, ids = (t.cuda() for t in (hidden, w1, w2, weights, ids))
    kernel = moekit.ModularKernel(BatchedPrepareFinalize(max_tokens=M), BatchedTritonExperts(quant=quant))
    if quant is QuantScheme.NONE:
        out = kernel(hidden, w1, w2, weights, ids)
        expected = moe_reference(hidden, w1, w2, weights, ids)
        assert_close(out, expected, dtype=torch.bfloat16)
        return
    q1, s1 = quantize_fp8_block(w1)
    q2, s2 = quantize_fp8_block(w2)
    out = kernel(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)
    hq, hs = quantize_fp8_per_token_group(hidden)
    expected = moe_reference(
        dequantize_fp8_per_token_group(hq, hs), dequantize_fp8_block(q1, s1), dequantize_fp8_block(q2, s2),
        weights, ids,
    )
    assert_close(out, expected, dtype=FP8)


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", CLASSES)
def test_an_a2_scale_that_is_not_a_tensor_is_named(cls):
    hidden, w1, w2, weights, ids = _layer(12, 128, 256, 4, 2, torch.float32)
    (q1, s1), (q2, s2) = quantize_fp8_block(w1), quantize_fp8_block(w2)
    fp8 = moekit.ModularKernel(BatchedPrepareFinalize(max_tokens=24), cls(quant=QuantScheme.FP8_BLOCK))
    with expect_raises(QuantizationError, match=r"does not take a static a2_scale \(got a list\)"):
        fp8(hidden, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2, a2_scale=[0.01])
