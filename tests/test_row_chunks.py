"""ModularKernel(chunk_by="rows"): chunks of expert-sorted rows with the real experts classes.

Each chunk must give what one call over the whole batch gives (within the dtype's tolerance:
the sums of a row are the same, but the GEMM tiles may differ), every (token, slot) row must be
written by exactly one chunk, and the workspaces must stay bounded by the chunk's rows.
"""

from __future__ import annotations

import pytest
import torch

from moekit.errors import ChunkSizeError, InvalidInputError, QuantizationError
from moekit.experts import DeepGemmExperts, TritonExperts, TritonOrDeepGemmExperts
from moekit.experts.grouped_mm import GroupedMMExperts
from moekit.modular_kernel import ROW_BLOCK, ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.reference import count_reference, local_expert_ids
from moekit.testing import assert_close, expect_raises, make_problem
from moekit.types import QuantScheme

FP8 = QuantScheme.FP8_BLOCK
EXPERTS = {
    "triton-fp32": (lambda: TritonExperts(), torch.float32, QuantScheme.NONE),
    "triton-bf16-fused": (lambda: TritonExperts(fuse_activation=True), torch.bfloat16, QuantScheme.NONE),
    "triton-fp8": (lambda: TritonExperts(quant=FP8), torch.bfloat16, FP8),
    "triton-fp8-fused": (lambda: TritonExperts(quant=FP8, fuse_activation=True), torch.bfloat16, FP8),
    "deep_gemm": (lambda: DeepGemmExperts(), torch.bfloat16, FP8),
    "triton_or_deep_gemm": (lambda: TritonOrDeepGemmExperts(quant=FP8), torch.bfloat16, FP8),
}


def _kernel(experts, R, **kw):
    return ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=R, chunk_by="rows", **kw)


def _layout_rows(p, E) -> int:
    """Rows the sorted layout really uses: every local expert padded to 128 (empty ones too)."""
    counts = count_reference(local_expert_ids(p.topk_ids, E, p.expert_map), E)
    return int(((counts + ROW_BLOCK - 1) // ROW_BLOCK * ROW_BLOCK).sum())


@pytest.mark.parametrize("name", list(EXPERTS))
def test_row_chunks_equal_one_call_and_the_reference(name):
    make, dtype, quant = EXPERTS[name]
    p = make_problem(200, E=4, topk=2, K=128, N=256, dtype=dtype, quant=quant, skew=0.5, seed=3)
    whole = ModularKernel(NoEPPrepareFinalize(), make())(*p.inputs(), **p.options())
    kernel = _kernel(make(), 256)
    out = kernel(*p.inputs(), **p.options())
    assert_close(out, whole, dtype=p.dtype)
    p.check(out)
    trace = kernel.last_trace
    assert trace.chunk_by == "rows" and all(c.M <= 256 for c in trace)
    # The chunks' own counts add up to the batch's: every (token, slot) row sits in one chunk.
    total = count_reference(local_expert_ids(p.topk_ids, 4, p.expert_map), 4)
    assert torch.equal(trace.counts_matrix().sum(0), total)


@pytest.mark.parametrize("M", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("R", [128, 384])
def test_row_chunks_at_block_edges(M, R):
    """M around the 128-row block (topk=2: 64 tokens fill one expert's block when skewed)."""
    p = make_problem(M, E=4, topk=2, K=128, N=256, dtype=torch.float32, skew=0.8, seed=M)
    kernel = _kernel(TritonExperts(), R)
    p.check(kernel(*p.inputs(), **p.options()))
    trace = kernel.last_trace
    # Chunks cover the layout's bound; those past the rows in use find only padding.
    covered = sum(c.M for c in trace)
    assert covered >= _layout_rows(p, 4)
    assert (
        trace.peak_workspace_bytes
        <= TritonExperts().row_workspace_shapes(R, p_size(p), act_dtype=p.dtype).workspace_bytes
    )


def p_size(p):
    from moekit.types import ProblemSize

    return ProblemSize(p.M, p.w1.shape[1], p.w1.shape[2], p.topk_ids.shape[1], p.w1.shape[0], p.w1.shape[0])


def test_expert_map_and_empty_slots():
    """A rank's share: remote experts and -1 slots contribute zero; shards sum to the whole."""
    p = make_problem(160, E=8, topk=2, K=128, N=256, dtype=torch.float32, empty_every=3, seed=5)
    total = sum(_kernel(TritonExperts(), 128)(*s.inputs(), **s.options()) for s in (p.shard(r, 2) for r in range(2)))
    p.check(total)


def test_row_chunks_are_deterministic():
    p = make_problem(300, E=4, topk=2, K=128, N=256, dtype=torch.bfloat16, quant=FP8, seed=7)
    kernel = _kernel(DeepGemmExperts(), 256)
    first = kernel(*p.inputs(), **p.options())
    assert torch.equal(first, kernel(*p.inputs(), **p.options()))


def test_fewer_weight_reads_than_token_chunks():
    """The point of the plan: a skewed batch cut into token chunks re-reads most experts' weights
    in every chunk; cut into row chunks, each expert is read about once (twice at a boundary)."""
    p = make_problem(512, E=8, topk=2, K=128, N=256, dtype=torch.float32, seed=11)
    by_tokens = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=128)
    by_rows = _kernel(TritonExperts(), 256)
    assert_close(by_rows(*p.inputs()), by_tokens(*p.inputs()), dtype=p.dtype)
    rows, tokens = by_rows.last_trace, by_tokens.last_trace
    expert = rows.chunks[0].expert_bytes
    # Each expert is touched by at most (its rows / R + 2) row chunks; the bound is the plan's.
    assert rows.weight_bytes <= (8 + len(rows)) * expert
    assert tokens.weight_bytes == sum(int((c.counts > 0).sum()) for c in tokens) * expert
    assert rows.weight_bytes < tokens.weight_bytes


@pytest.mark.parametrize("R", [None, 0, 100, 130])
def test_a_row_count_that_is_not_whole_blocks_is_named(R):
    with expect_raises(ChunkSizeError, match="must be > 0" if R == 0 else "multiple of 128"):
        _kernel(TritonExperts(), R)


def test_experts_without_row_chunks_and_other_policies_are_named():
    with expect_raises(InvalidInputError, match="does not support chunks of sorted rows"):
        _kernel(GroupedMMExperts(), 128)
    with expect_raises(InvalidInputError, match="workspace_policy must be 'per_chunk', got 'once'"):
        _kernel(TritonExperts(), 128, workspace_policy="once")
    with expect_raises(InvalidInputError, match="chunk_by"):
        ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=128, chunk_by="experts")


def test_a_per_token_a2_scale_is_named_before_anything_runs():
    p = make_problem(40, E=4, topk=2, K=128, N=256, quant=FP8, seed=2)
    kernel = _kernel(TritonExperts(quant=FP8), 128)
    with expect_raises(QuantizationError, match="cannot follow rows sorted by expert"):
        kernel(*p.inputs(), **p.options(), a2_scale=torch.ones(40, 1))
    assert kernel.last_trace is None or len(kernel.last_trace) == 0
