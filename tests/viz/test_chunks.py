"""moekit.viz.chunks, headless: the numbers behind the plots, and that every plot draws."""

from __future__ import annotations

import io

import pytest
import torch

from moekit import reference, routing, viz
from moekit.quant import FP8

pytest.importorskip("matplotlib")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


@pytest.mark.parametrize("M", [1, 7, 64, 130])
@pytest.mark.parametrize("C", [1, 16, 128, None])
@pytest.mark.parametrize("ep_size", [1, 4])
def test_chunk_counts_match_per_chunk_reference(M, C, ep_size):
    E, topk = 16, 3
    ids = routing.skewed_router(M, E, topk, seed=M, device="cpu").topk_ids
    ids[0, 0] = -1  # an empty slot is never counted
    emap = routing.contiguous_expert_map(E, ep_size, 1) if ep_size > 1 else None
    E_local = E // ep_size
    got = viz.chunk_counts(ids, C, E_local, expert_map=emap)
    from moekit.plan import chunk_ranges

    want = [reference.count_reference(ids[r.start : r.end], E_local, emap) for r in chunk_ranges(M, C)]
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.stack(want).long())


def test_chunk_counts_empty_input():
    assert viz.chunk_counts(torch.zeros(0, 2, dtype=torch.int32), 4, 8).shape == (0, 8)


@pytest.mark.interpreter
def test_chunk_counts_agree_with_count_kernel():
    import moekit

    ids = routing.uniform_router(40, 8, 2, seed=3, device="cpu").topk_ids
    got = viz.chunk_counts(ids, 16, 8)
    want = torch.stack([moekit.count_expert_num_tokens(ids[s : s + 16], 8) for s in range(0, 40, 16)])
    assert torch.equal(got, want.cpu().long())


def test_weight_bytes():
    counts = torch.tensor([[3, 0, 1], [0, 0, 2]])
    assert viz.weight_bytes_read(counts, 10) == 30  # three (chunk, expert) pairs touched
    assert viz.expert_weight_bytes(256, 128, dtype=torch.bfloat16) == (256 * 128 + 128 * 128) * 2
    # fp8: one byte per element plus fp32 scales, 2 blocks for w1 [256, 128] and 1 for w2 [128, 128]
    assert viz.expert_weight_bytes(256, 128, dtype=FP8) == 256 * 128 + 128 * 128 + 4 * 3


def test_every_plot_draws():
    counts = viz.chunk_counts(routing.skewed_router(64, 8, 2, device="cpu").topk_ids, 16, 8)
    figs = [
        viz.plot_tokens_per_expert(counts.sum(0)),
        viz.plot_counts_heatmap(counts),
        viz.plot_stacked_chunks(counts),
        viz.plot_workspace_bytes({"a": [1024, 2048], "b": [4096, 4096]}, labels=["deep_gemm", "triton"]),
        viz.plot_weight_bytes([1, 2, 4], {"r": [300, 200, 100]}, whole=100, mark=2),
        viz.plot_counts_vs_whole(counts, counts.sum(0)),
    ]
    for fig in figs:
        assert _png(fig).startswith(b"\x89PNG")


def test_heatmap_annotates_small_matrices_only():
    small = viz.plot_counts_heatmap(torch.ones(2, 3, dtype=torch.int64))
    assert len(small.axes[0].texts) == 6
    big = viz.plot_counts_heatmap(torch.ones(20, 20, dtype=torch.int64))
    assert len(big.axes[0].texts) == 0
