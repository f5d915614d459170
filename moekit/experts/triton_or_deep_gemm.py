"""``TritonOrDeepGemmExperts``: DeepGemm for large chunks, Triton for small ones.

The class of bug 1 in vLLM PR #20392. It picks a backend per call from the chunk's M, so one
forward can run both: with M=130 and chunk size 128, chunk 0 (128 tokens) takes DeepGemm and
chunk 1 (2 tokens) takes Triton. Their workspaces differ::

    DeepGemm  workspace13 (M_sum, max(N, K))   workspace2 (M_sum + R_idx, max(N/2, K))
    Triton    workspace13 (M, topk, N)         workspace2 (M * topk, N/2)
    both      output      (M, topk, K)

so workspaces must be declared per chunk (the fix; ``workspace_policy="per_chunk"``), and the
outputs must have one layout so that the whole-batch output slices per chunk.

One predicate, :meth:`TritonOrDeepGemmExperts.uses_deep_gemm`, decides for
``workspace_shapes``, ``apply`` and ``backend_for``. Upstream had two: the workspace rule
checked N = 2I while the apply rule checked I and also the dtypes, contiguity and whether
deep_gemm was installed, so they could disagree (with I=192, 2I is 128-aligned and I is not),
and only "DeepGemm's workspaces are larger" kept that safe.

The rule is ``M >= 128`` in upstream's code (``_valid_deep_gemm_shape``); PR #20392's text says
"num_tokens > 128". moekit follows the code: a chunk of exactly 128 tokens takes DeepGemm.

For chunks of expert-sorted rows (``ModularKernel(chunk_by="rows")``) the rule counts the chunk's
rows instead of tokens. Such a chunk holds a whole number of 128-row blocks, so it always takes
DeepGemm when the shapes fit (and Triton when they do not, or without fp8).
"""

from __future__ import annotations

import torch

from moekit.errors import QuantizationError
from moekit.experts.base import Experts
from moekit.experts.deep_gemm import DeepGemmExperts
from moekit.experts.triton import TritonExperts
from moekit.types import ExpertsCall, ExpertTokensMetadata, MoEWeights, ProblemSize, QuantScheme, WorkspaceShapes
from moekit.validate import check_flag

DEEP_GEMM_MIN_M = 128  # upstream's switch is M >= 128 (the PR text says "> 128")


class TritonOrDeepGemmExperts(Experts):
    """Dispatch each call to a ``DeepGemmExperts`` or a ``TritonExperts`` it owns.

    Args:
        quant: ``QuantScheme.FP8_BLOCK`` (both backends) or ``QuantScheme.NONE`` (Triton only).
        deep_gemm_backend: the ``backend`` of the DeepGemm sub-experts: ``"auto"`` (the real
            deep_gemm where usable, else moekit's Triton contiguous GEMM), ``"deep_gemm"`` or
            ``"triton"``.
        flat_output: the DeepGemm backend declares its output ``(M * topk, K)``, as it did before
            PR #20392 (for teaching: the Triton backend keeps ``(M, topk, K)``, and a forward
            whose chunks cross the switch then fails as upstream did).
    """

    def __init__(
        self, *, quant: QuantScheme = QuantScheme.FP8_BLOCK, deep_gemm_backend: str = "auto", flat_output: bool = False
    ):
        super().__init__(quant=quant)
        check_flag(flat_output, "flat_output")  # checked also when no DeepGemm sub-experts is built
        self.triton = TritonExperts(quant=quant)
        self.deep_gemm = None
        if quant is QuantScheme.FP8_BLOCK:
            self.deep_gemm = DeepGemmExperts(quant=quant, backend=deep_gemm_backend, flat_output=flat_output)
        subs = [e for e in (self.triton, self.deep_gemm) if e is not None]
        # Instance attributes: a dispatcher can chunk only if every backend it may pick can.
        self.supports_chunking = all(e.supports_chunking for e in subs)
        self.supports_row_chunks = all(e.supports_row_chunks for e in subs)
        self.supports_expert_map = all(e.supports_expert_map for e in subs)
        self.uses_tokens_meta = any(e.uses_tokens_meta for e in subs)

    def __repr__(self) -> str:
        return f"TritonOrDeepGemmExperts(quant={self.quant.value}, deep_gemm={self.deep_gemm!r})"

    def uses_deep_gemm(self, problem: ProblemSize) -> bool:
        """True when this call goes to DeepGemm: fp8 block, M >= 128, N and K multiples of 128."""
        return self.deep_gemm is not None and problem.M >= DEEP_GEMM_MIN_M and _fits_blocks(problem)

    def check(self, problem: ProblemSize, weights: MoEWeights, *, a2_scale=None) -> None:
        """Triton's rules (it runs every chunk below 128 tokens); a per-token a2_scale only when no
        chunk can take DeepGemm (which permutes rows by expert)."""
        self.triton.check(problem, weights, a2_scale=a2_scale)
        if self.deep_gemm is not None and _fits_blocks(problem) and a2_scale is not None and a2_scale.numel() != 1:
            raise QuantizationError(
                f"TritonOrDeepGemmExperts takes a per-tensor a2_scale (1 element) when its DeepGemm backend may "
                f"run (N, K multiples of 128), got shape {tuple(a2_scale.shape)}"
            )

    def _pick(self, problem: ProblemSize) -> Experts:
        return self.deep_gemm if self.uses_deep_gemm(problem) else self.triton

    def backend_for(self, problem: ProblemSize) -> str:
        return self._pick(problem).backend_for(problem)

    def why(self, problem: ProblemSize) -> str:
        return self._pick(problem).why(problem)

    def workspace_shapes(
        self, problem: ProblemSize, *, act_dtype: torch.dtype, tokens_meta: ExpertTokensMetadata | None = None
    ) -> WorkspaceShapes:
        """The shapes of the backend :meth:`uses_deep_gemm` picks for ``problem.M``."""
        return self._pick(problem).workspace_shapes(problem, act_dtype=act_dtype, tokens_meta=tokens_meta)

    def row_workspace_shapes(self, rows: int, problem: ProblemSize, *, act_dtype: torch.dtype) -> WorkspaceShapes:
        """The shapes of the backend picked for a chunk of ``rows`` sorted rows."""
        return self._pick(problem.with_M(rows)).row_workspace_shapes(rows, problem, act_dtype=act_dtype)

    def apply(self, call: ExpertsCall) -> str:
        """Run the backend picked for this call's M (the same one ``workspace_shapes`` picked)."""
        return self._pick(call.problem).apply(call)

    def apply_rows(self, call: ExpertsCall) -> str:
        """Run the backend picked for this chunk's count of sorted rows."""
        return self._pick(call.problem.with_M(call.chunk.size)).apply_rows(call)


def _fits_blocks(problem: ProblemSize) -> bool:
    """N and K multiples of 128, the blocks of DeepGemm's layout."""
    return problem.N % 128 == 0 and problem.K % 128 == 0


__all__ = ["DEEP_GEMM_MIN_M", "TritonOrDeepGemmExperts"]
