"""Exercise 2: declare the workspaces of a new experts backend, per chunk."""

from __future__ import annotations

from moekit.types import WorkspaceShapes
from moekit.workbook.backends import GatedTorchExperts


class MyExperts(GatedTorchExperts):
    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        pairs = problem.M * problem.topk  # this chunk's (token, slot) rows
        return WorkspaceShapes(
            workspace13=(pairs, problem.N),  # GEMM1's output, gate and up halves
            workspace2=(pairs, problem.N // 2),  # silu(gate) * up
            output=(problem.M, problem.topk, problem.K),  # one row per pair, the layout every backend shares
            dtype=act_dtype,
        )
