"""moekit.viz.flow: one box per chunk (the middle folded past max_chunks), a failed chunk marked."""

from __future__ import annotations

import torch

from moekit.experts import TritonExperts
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.testing import make_problem
from moekit.viz import plot_data_flow


def _trace(M, C):
    p = make_problem(M, E=4, topk=2, K=32, N=64, dtype=torch.float32, seed=1)
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=C)
    kernel(*p.inputs())
    return kernel.last_trace


def _texts(fig):
    return [t.get_text() for t in fig.axes[0].texts]


def test_one_box_per_chunk():
    texts = _texts(plot_data_flow(_trace(20, 8), K=32, topk=2))
    assert sum(t.startswith("chunk ") for t in texts) == 3
    assert any("tokens [16, 20)" in t for t in texts) and "finalize\nout [20, 32]" in texts


def test_many_chunks_fold_in_the_middle():
    trace = _trace(40, 2)
    texts = _texts(plot_data_flow(trace, max_chunks=5))
    assert sum(t.startswith("chunk ") for t in texts) == 4
    assert any(t.startswith(f"... {len(trace) - 4} more chunks") for t in texts)


def test_a_failed_chunk_is_marked():
    trace = _trace(20, 8)
    trace.chunks[-1].completed = False
    assert any("(failed)" in t for t in _texts(plot_data_flow(trace)))
