"""ModularKernel(chunk_by="rows"): chunks of expert-sorted rows with the real experts classes.

Each chunk must give what one call over the whole batch gives (within the dtype's tolerance:
the sums of a row are the same, but the GEMM tiles may differ), every (token, slot) row must be
written by exactly one chunk, and the workspaces must stay bounded by the chunk's rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekit.errors import ChunkSizeError, InvalidInputError, QuantizationError
from moekit.experts import DeepGemmExperts, TritonExperts, TritonOrDeepGemmExperts
from moekit.experts.grouped_mm import GroupedMMExperts
from moekit.hopper.experts import HopperTritonExperts
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.reference import count_reference, local_expert_ids
from moekit.testing import assert_close, expect_raises, make_problem
from moekit.types import ALIGN_M as ROW_BLOCK
from moekit.types import QuantScheme

FP8 = QuantScheme.FP8_BLOCK
EXPERTS = {
    "triton-fp32": (lambda: TritonExperts(), torch.float32, QuantScheme.NONE),
    "triton-bf16-fused": (lambda: HopperTritonExperts(fuse_activation=True), torch.bfloat16, QuantScheme.NONE),
    "triton-fp8": (lambda: TritonExperts(quant=FP8), torch.bfloat16, FP8),
    "triton-fp8-fused": (lambda: HopperTritonExperts(quant=FP8, fuse_activation=True), torch.bfloat16, FP8),
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
    assert torch.equal(trace.counts_matrix().sum(0), total.cpu())


def _sizes(p):
    from moekit.types import ProblemSize

    E, N, K = p.w1.shape
    return ProblemSize(p.M, N, K, p.topk_ids.shape[1], p.global_num_experts or E, E)


EDGE = {"triton": (lambda: TritonExperts(), torch.float32, QuantScheme.NONE),
        "deep_gemm": (lambda: DeepGemmExperts(), torch.bfloat16, FP8)}  # fmt: skip


@pytest.mark.parametrize("name", list(EDGE))
@pytest.mark.parametrize("R, M", [(128, 1), (128, 127), (128, 128), (128, 129), (384, 383), (384, 385)])
def test_row_chunks_at_the_edges_of_R(name, R, M):
    """M tokens around R (M*topk rows around 2R): correct, and the workspace peak bounded by R."""
    make, dtype, quant = EDGE[name]
    p = make_problem(M, E=4, topk=2, K=128, N=256, dtype=dtype, quant=quant, seed=M)
    kernel = _kernel(make(), R)
    p.check(kernel(*p.inputs(), **p.options()))
    trace = kernel.last_trace
    # Chunks cover the layout's bound; those past the rows in use find only padding.
    assert sum(c.M for c in trace) >= _layout_rows(p, 4) and all(c.M <= R for c in trace)
    assert (
        trace.peak_workspace_bytes
        <= make().row_workspace_shapes(R, _sizes(p), act_dtype=p.hidden.dtype).workspace_bytes
    )


@pytest.mark.parametrize("name", list(EDGE))
def test_one_expert_owning_most_rows_spans_several_chunks(name):
    make, dtype, quant = EDGE[name]
    p = make_problem(300, E=4, topk=1, K=128, N=256, dtype=dtype, quant=quant, seed=1)
    ids = p.topk_ids.clone()
    ids[torch.arange(300) % 7 != 0] = 2  # expert 2 owns 257 of the 300 rows: three blocks of 128
    p = dataclasses.replace(p, topk_ids=ids)
    kernel = _kernel(make(), 128)
    p.check(kernel(*p.inputs(), **p.options()))
    reads = kernel.last_trace.reads()
    counts = count_reference(local_expert_ids(p.topk_ids, 4), 4).cpu()
    big = int(counts.argmax())
    spanned = [
        r
        for r in reads
        if r["experts"] != "-" and int(r["experts"].split("..")[0]) <= big <= int(r["experts"].split("..")[1])
    ]
    assert counts[big] > 256 and len(spanned) >= int(counts[big]) // 128


@pytest.mark.parametrize("name", list(EDGE))
def test_expert_map_and_empty_slots(name):
    """A rank's share: remote experts and -1 slots contribute zero; shards sum to the whole."""
    make, dtype, quant = EDGE[name]
    p = make_problem(160, E=8, topk=2, K=128, N=256, dtype=dtype, quant=quant, empty_every=3, seed=5)
    total = sum(_kernel(make(), 128)(*s.inputs(), **s.options()).float() for s in (p.shard(r, 2) for r in range(2)))
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
        kernel(*p.inputs(), **p.options(), a2_scale=torch.ones(40, 1, device=p.w1.device))
    assert kernel.last_trace is None or len(kernel.last_trace) == 0


@pytest.mark.gpu
def test_the_real_deep_gemm_takes_row_chunks():
    """On a GPU with deep_gemm: the real backend's row chunks equal one call and the reference."""
    from moekit.backends import deep_gemm as dg

    if not dg.status().usable:
        pytest.skip(f"deep_gemm not usable here: {dg.status().reason}")
    p = make_problem(1000, E=16, topk=4, K=512, N=1024, quant=FP8, seed=9)
    whole = ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts(backend="deep_gemm"))(*p.inputs(), **p.options())
    kernel = _kernel(DeepGemmExperts(backend="deep_gemm"), 1024)
    out = kernel(*p.inputs(), **p.options())
    assert set(kernel.last_trace.backends) == {"deep_gemm"}
    assert_close(out, whole, dtype=p.dtype)
    p.check(out)
