"""moekit.viz.rows: the arithmetic of sorted-row chunks against what a row-chunked forward records."""

from __future__ import annotations

import pytest
import torch

from moekit.experts import TritonExperts
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.reference import count_reference, local_expert_ids
from moekit.testing import make_problem
from moekit.viz import chunks_per_expert, plot_chunks_per_expert, plot_sorted_rows, row_chunk_counts


@pytest.mark.parametrize("R", [128, 256])
def test_row_chunk_counts_match_the_kernels_trace(R):
    p = make_problem(150, E=6, topk=2, K=128, N=256, dtype=torch.float32, skew=0.7, seed=4)
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=R, chunk_by="rows")
    kernel(*p.inputs())
    recorded = kernel.last_trace.counts_matrix()
    counts = count_reference(local_expert_ids(p.topk_ids, 6), 6).cpu()
    predicted = row_chunk_counts(counts, R)
    # The kernel's chunks cover the layout's bound; past the rows in use they hold nothing.
    assert torch.equal(recorded[: len(predicted)], predicted)
    assert recorded[len(predicted) :].sum() == 0
    assert torch.equal(predicted.sum(0), counts)
    # A chunk holds a contiguous run of experts: each expert is cut at most by its rows / R + 1.
    rows = (counts + 127) // 128 * 128
    assert (chunks_per_expert(predicted) <= rows // R + 2).all()


def test_bad_rows_per_chunk():
    with pytest.raises(ValueError, match="multiple of 128"):
        row_chunk_counts(torch.tensor([3, 4]), 100)


def test_plots_draw():
    counts = torch.tensor([200, 10, 0, 300])
    fig = plot_sorted_rows(counts, 256)
    assert len(fig.axes) == 1 and fig.axes[0].get_xlim()[1] == 768
    fig = plot_chunks_per_expert({"rows": row_chunk_counts(counts, 256), "tokens": torch.ones(3, 4)})
    assert len(fig.axes[0].patches) == 8
