"""moekit.trace: the record of one forward's chunks, built through ModularKernel with TritonExperts."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.experts import TritonExperts
from moekit.plan import chunk_ranges
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.reference import count_reference
from moekit.testing import make_problem
from moekit.trace import ChunkRecord, Trace
from moekit.types import WorkspaceShapes

E, TOPK, K, N = 8, 2, 64, 64


def run(M: int, C: int | None, **kernel_options):
    p = make_problem(M, E=E, topk=TOPK, K=K, N=N, empty_every=7)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=C, **kernel_options)
    kernel(*p.inputs(), **p.options())
    return p, kernel.last_trace


class FailsAfterTheFirstChunk(TritonExperts):
    def apply(self, call):
        if call.problem.M != 16:
            raise RuntimeError("chunk failed")
        return super().apply(call)


def test_trace_fields():
    p, trace = run(40, 16)
    assert isinstance(trace, Trace)
    assert (trace.M, trace.chunk_size, trace.experts) == (40, 16, "TritonExperts")
    assert (trace.workspace_policy, trace.metadata_policy) == ("per_chunk", "per_chunk")
    assert len(trace) == 3 and list(trace) == trace.chunks and trace.expert_rows == 40
    assert trace.peak_workspace_bytes == max(c.workspace_bytes for c in trace)


def test_chunk_record_fields():
    _, trace = run(40, 16)
    for c, r in zip(trace, chunk_ranges(40, 16), strict=True):
        assert isinstance(c, ChunkRecord)
        assert (c.index, c.start, c.end, c.M) == (r.index, r.start, r.end, r.size)
        assert c.backend == "triton" and c.completed and c.note == ""
        assert c.output_shape == (r.size, TOPK, K)
        assert isinstance(c.shapes, WorkspaceShapes) and c.needed == c.shapes  # per_chunk: what it declared
        assert c.workspace_bytes == c.shapes.workspace_bytes > 0
        assert c.counts.dtype == torch.int32 and c.counts.shape == (E,)


def test_backends():
    assert run(40, 16)[1].backends == ["triton"] * 3
    assert run(40, None)[1].backends == ["triton"]


def test_rows():
    _, trace = run(40, 16)
    rows = trace.rows()
    assert [r["tokens"] for r in rows] == ["[0, 16)", "[16, 32)", "[32, 40)"]
    assert list(rows[0]) == ["chunk", "tokens", "M", "backend", "workspace13", "workspace2", "output", "bytes"]
    assert rows[2] == trace.chunks[2].row()
    assert (rows[2]["M"], rows[2]["output"], rows[2]["bytes"]) == (8, (8, TOPK, K), trace.chunks[2].workspace_bytes)


def test_table_has_a_header_and_a_line_per_chunk():
    _, trace = run(40, 16)
    lines = trace.table().splitlines()
    assert len(lines) == 4
    assert lines[0].split() == ["chunk", "tokens", "M", "backend", "workspace13", "workspace2", "output", "bytes"]
    assert lines[3].startswith("2") and "[32, 40)" in lines[3] and "triton" in lines[3]
    assert all(line[lines[0].index("backend") :].startswith("triton") for line in lines[1:])  # columns line up
    assert Trace(0, None, "X", "per_chunk", "per_chunk").table().split() == lines[0].split()


def test_counts_matrix_is_tokens_per_chunk_and_expert():
    p, trace = run(40, 16)
    matrix = trace.counts_matrix()
    assert matrix.dtype == torch.int64 and matrix.device.type == "cpu" and matrix.shape == (3, E)
    ids = p.topk_ids.cpu()
    want = torch.stack([count_reference(ids[r.start : r.end], E) for r in chunk_ranges(40, 16)]).long()
    assert torch.equal(matrix, want)
    assert int(matrix.sum()) == int((ids >= 0).sum())  # the empty slots are not counted


def test_counts_matrix_without_counts_is_empty():
    _, trace = run(20, 8, trace_counts=False)
    assert len(trace) == 3 and all(c.counts is None for c in trace)
    assert trace.counts_matrix().shape == (0, 0) and trace.counts_matrix().dtype == torch.int64


def test_handed_vs_needed_shows_the_declared_once_buffers():
    _, trace = run(40, 16, workspace_policy="once")
    assert trace.workspace_policy == "once"
    rows = trace.handed_vs_needed()
    assert [r["chunk"] for r in rows] == [0, 1, 2] and [r["M"] for r in rows] == [16, 16, 8]
    last = rows[2]
    assert last["workspace13 handed"] == (16, TOPK, N) and last["workspace13 needed"] == (8, TOPK, N)
    assert last["output handed"] == last["output needed"] == (8, TOPK, K)
    assert trace.chunks[2].shapes != trace.chunks[2].needed
    per_chunk = run(40, 16)[1].handed_vs_needed()
    assert all(r["workspace13 handed"] == r["workspace13 needed"] for r in per_chunk)


def test_a_failed_forward_keeps_its_chunks():
    p = make_problem(40, E=E, topk=TOPK, K=K, N=N)
    kernel = moekit.ModularKernel(NoEPPrepareFinalize(), FailsAfterTheFirstChunk(), chunk_size=16)
    with pytest.raises(RuntimeError, match="chunk failed"):
        kernel(*p.inputs(), **p.options())
    trace = kernel.last_trace
    assert len(trace) == 3 and [c.completed for c in trace] == [True, True, False]
    assert trace.rows()[2]["backend"] == "triton (failed)"
    assert trace.handed_vs_needed()[2]["backend"] == "triton (failed)" and "triton (failed)" in trace.table()
    assert trace.counts_matrix().shape == (3, E)


def test_a_chunk_record_needs_only_its_shapes():
    shapes = WorkspaceShapes((4, 2, 64), (8, 32), (4, 2, 64), torch.bfloat16)
    c = ChunkRecord(1, 4, 8, "triton", shapes, (4, 2, 64))
    assert c.needed is shapes and c.counts is None and c.completed and c.M == 4
    assert c.workspace_bytes == (4 * 2 * 64 + 8 * 32) * 2
    trace = Trace(8, 4, "TritonExperts", "per_chunk", "per_chunk", chunks=[c])
    assert trace.backends == ["triton"] and trace.rows() == [c.row()]


def test_no_tokens_no_chunks():
    _, trace = run(0, 16)
    assert trace.M == 0 and len(trace) == 0 and trace.rows() == [] and trace.counts_matrix().shape == (0, 0)
