"""GroupedMMExperts: torch._grouped_mm grouped by the tokens per expert, against the reference."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.errors import QuantizationError, StaleMetadataError
from moekit.experts import GroupedMMExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.routing import contiguous_expert_map
from moekit.testing import assert_close, expect_raises, make_problem


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C", [None, 7, 16])
def test_matches_reference_chunked(dtype, C):
    p = make_problem(37, E=6, topk=2, K=64, N=96, dtype=dtype, empty_every=4, seed=3)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), GroupedMMExperts(), chunk_size=C)
    assert_close(kernel(*p.inputs(), **p.options()), p.reference(), dtype=dtype)
    assert set(kernel.last_trace.backends) == {"torch_grouped_mm"}


def test_expert_map_ranks_sum_to_the_reference():
    p = make_problem(21, E=8, topk=3, K=32, N=64, dtype=torch.float32, seed=1)
    total = sum(moekit.ModularKernel(NoEPPrepareFinalize(), GroupedMMExperts(), chunk_size=5)(
        *p.shard(r, 2).inputs(), **p.shard(r, 2).options()) for r in range(2))  # fmt: skip
    assert_close(total, p.reference(), dtype=torch.float32)
    assert contiguous_expert_map(8, 2, 1).tolist()[4:] == [0, 1, 2, 3]


def test_counts_set_the_groups_so_stale_ones_give_a_wrong_answer():
    # The counts from prepare (a dispatcher's) are trusted: per chunk they are right; the whole
    # batch's, handed to every chunk, shift every group boundary. No error is raised by torch.
    p = make_problem(48, E=4, topk=2, K=32, N=64, dtype=torch.float32, seed=2)
    pf = NoEPPrepareFinalize(return_counts=True)
    fixed = moekit.ModularKernel(pf, GroupedMMExperts(), chunk_size=16)
    assert_close(fixed(*p.inputs()), p.reference(), dtype=torch.float32)
    stale = moekit.ModularKernel(pf, GroupedMMExperts(), chunk_size=16, metadata_policy="whole_batch", guard=False)
    out = stale(*p.inputs())
    assert float((out - p.reference()).abs().max()) > 0.1 * float(p.reference().abs().max())
    guarded = moekit.ModularKernel(pf, GroupedMMExperts(), chunk_size=16, metadata_policy="whole_batch")
    with expect_raises(StaleMetadataError, match="16 rows x 2 slots = 32"):
        guarded(*p.inputs())


def test_refuses_fp8_and_unaligned_rows():
    with expect_raises(QuantizationError, match="unquantized"):
        p = make_problem(4, K=128, N=256, quant=moekit.QuantScheme.FP8_BLOCK)
        moekit.ModularKernel(NoEPPrepareFinalize(), GroupedMMExperts(quant=moekit.QuantScheme.FP8_BLOCK))(
            *p.inputs(), **p.options())  # fmt: skip
    p = make_problem(4, K=36, N=64, dtype=torch.bfloat16)  # 72-byte rows
    with expect_raises(QuantizationError, match="16 bytes"):
        moekit.ModularKernel(NoEPPrepareFinalize(), GroupedMMExperts())(*p.inputs())


@pytest.mark.parametrize("rank", range(4))
def test_the_guard_catches_whole_batch_counts_under_an_expert_map(rank):
    # Issue 25, item 5: with 4 ranks most pairs go elsewhere, so the whole batch's local counts sum to
    # fewer pairs than one chunk holds (22 < 32 on rank 0): a check of the sum alone let them through.
    p = make_problem(48, E=8, topk=2, K=32, N=64, dtype=torch.float32, seed=2).shard(rank, 4)
    pf = NoEPPrepareFinalize(return_counts=True)
    stale = moekit.ModularKernel(pf, GroupedMMExperts(), chunk_size=16, metadata_policy="whole_batch", guard=False)
    out = stale(*p.inputs(), **p.options())
    assert float((out - p.reference()).abs().max()) > 0.1 * float(p.reference().abs().max())
    guarded = moekit.ModularKernel(pf, GroupedMMExperts(), chunk_size=16, metadata_policy="whole_batch")
    with expect_raises(StaleMetadataError, match=r"rows per local expert, but the 16 rows x 2 slots"):
        guarded(*p.inputs(), **p.options())


@pytest.mark.parametrize("C", [None, 16])
def test_fresh_counts_are_not_read_back(monkeypatch, C):
    # The default path hands each chunk its own counts (the same tensor as call.counts): the guard
    # compares nothing, so it adds no host sync to a GPU forward.
    import moekit.experts.grouped_mm as grouped_mm

    def no_check(call, meta):
        raise AssertionError("the guard compared a chunk's own counts")

    monkeypatch.setattr(grouped_mm, "_check_fresh", no_check)
    p = make_problem(48, E=8, topk=2, K=32, N=64, dtype=torch.float32, seed=2).shard(1, 4)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(return_counts=True), GroupedMMExperts(), chunk_size=C)
    assert_close(kernel(*p.inputs(), **p.options()), p.reference(), dtype=torch.float32)
