"""``DeepGemmExperts``: fp8 block experts over DeepGEMM's contiguous layout.

One call (M tokens, K hidden, N = w1 rows, E local experts, M_sum rows of the layout)::

    permute     a1q [M, K] -> a [M_sum, K]          rows grouped by local expert, padded to 128
    GEMM1       a @ w1[m_indices]^T -> mm1 [M_sum, N]           deep_gemm, or moekit's Triton
    activation  silu_and_mul + fp8 requant -> q [M_sum, N/2]    1x128 scales, column-major
    GEMM2       q @ w2[m_indices]^T -> mm2 [M_sum, K]
    unpermute   mm2 -> output [M, topk, K]          zeros for empty and non-local slots

Workspaces (bf16; W2 = max(N/2, K)) and what lives in them, phase by phase::

    workspace13 (M_sum, max(N, K))        mm1 [M_sum, N]  then  mm2 [M_sum, K]
    workspace2  (M_sum + R_idx, W2)       a + a_scale     then  q + q_scale   (rows < M_sum)
                                          index arrays in the last R_idx rows: m_indices,
                                          inv_perm, block_rows, expert_start, cursor, overflow

M_sum is exact when the metadata carries CPU counts (``sum(round_up(count, 128))``, upstream
#20903); otherwise it is the worst case ``round_up(M*topk + 127 * min(E, M*topk), 128)``: every
non-empty expert wastes at most 127 rows, and there are at most ``M*topk`` of them. moekit lays
rows out in LOCAL expert space (non-local pairs are dropped), so E is E_local; upstream used
E_global until #20903. The output is ``(M, topk, K)``, the same as ``TritonExperts``: the second
half of the PR #20392 fix, so that a dispatcher can slice one whole-batch output per chunk.
``flat_output=True`` declares it ``(M * topk, K)`` instead, as DeepGemmExperts did before the
fix (parent commit 41060c6e0), for the notebook that replays bug 1.
"""

from __future__ import annotations

import torch

from moekit.backends import deep_gemm as dg
from moekit.errors import BackendUnavailableError, InvalidInputError, QuantizationError, StaleMetadataError
from moekit.experts.base import Experts, carve
from moekit.kernels import permute
from moekit.kernels.activation import launch_silu_and_mul_fp8_group
from moekit.kernels.contiguous_gemm import GemmConfig, contiguous_gemm, default_config
from moekit.kernels.host_math import cdiv
from moekit.quant import FP8, FP8_GROUP
from moekit.types import (
    ALIGN_M,
    ExpertsCall,
    ExpertTokensMetadata,
    MoEWeights,
    ProblemSize,
    QuantScheme,
    WorkspaceShapes,
)
from moekit.validate import check_flag

BACKENDS = ("auto", "deep_gemm", "triton")


def _gemm_shapes(N: int, K: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(N, K)`` of GEMM1 ``[*, K] x [N, K]^T`` and of GEMM2 ``[*, N/2] x [K, N/2]^T``, as deep_gemm builds them."""
    return (N, K), (K, N // 2)


def _index_bytes(M_sum: int, pairs: int, E: int) -> list[int]:
    """Bytes of m_indices, inv_perm, block_rows, expert_start, cursor, flags (16-aligned)."""
    return [cdiv(4 * n, 16) * 16 for n in permute.index_sizes(M_sum, pairs, E)]


def _fp8_region(ws2: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``[rows, cols]`` from workspace2's first byte, then its column-major 1x128 scales ``[cols/128, rows]``."""
    q = carve(ws2, (rows, cols), dtype=FP8)
    scale = carve(ws2, (cdiv(cols, FP8_GROUP), rows), dtype=torch.float32, offset=rows * cols // ws2.element_size())
    return q, scale.t()


# Padding work (multiply-adds) above which one host sync to skip it pays (see _rows_in_use).
_SYNC_WORTH_IT = 1e12


class DeepGemmExperts(Experts):
    """fp8 block experts: permute to the contiguous layout, two grouped GEMMs, unpermute.

    Args:
        quant: must be ``QuantScheme.FP8_BLOCK`` (1x128 activation, 128x128 weight scales).
        backend: ``"auto"`` (deep_gemm when :func:`moekit.backends.deep_gemm.status` says it
            is usable and both GEMMs' K are multiples of 128, else moekit's Triton contiguous
            GEMM; a GEMM whose shape deep_gemm failed to build here runs on the Triton GEMM from
            then on, the other GEMM of the layer keeps deep_gemm), ``"deep_gemm"`` (raise if
            unusable) or ``"triton"``.
        flat_output: declare the output ``(M * topk, K)``, as before PR #20392 (for teaching;
            a dispatcher whose other backend declares ``(M, topk, K)`` then breaks, as upstream did).

    Raises:
        QuantizationError: ``quant`` is not FP8_BLOCK.
        BackendUnavailableError: ``backend="deep_gemm"`` where it cannot run.
    """

    supports_chunking = True
    supports_row_chunks = True
    supports_expert_map = True
    uses_tokens_meta = True

    def __init__(self, *, quant: QuantScheme = QuantScheme.FP8_BLOCK, backend: str = "auto", flat_output: bool = False):
        super().__init__(quant=quant)
        if quant is not QuantScheme.FP8_BLOCK:
            raise QuantizationError(f"DeepGemmExperts needs quant=QuantScheme.FP8_BLOCK, got {quant}")
        if backend not in BACKENDS:
            raise InvalidInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "deep_gemm" and not dg.status().usable:
            raise BackendUnavailableError(f"backend='deep_gemm' asked for, but {dg.status().reason}")
        self.backend = backend
        self.flat_output = check_flag(flat_output, "flat_output")

    def __repr__(self) -> str:
        flat = ", flat_output=True" if self.flat_output else ""
        return f"DeepGemmExperts(backend={self.backend!r}{flat})"

    # ----------------------------------------------------------------------------------------
    def _real_gemms(self, N: int, K: int) -> tuple[bool, bool]:
        """Whether GEMM1 and GEMM2 each go to the real deep_gemm. Decided per GEMM shape: a shape that
        deep_gemm failed to build here stays on moekit's Triton GEMM, the other GEMM does not."""
        if self._layer_reason(N, K):
            return False, False
        return tuple(dg.build_failure(*shape) is None for shape in _gemm_shapes(N, K))

    def _layer_reason(self, N: int, K: int) -> str:
        """Why neither GEMM of this layer can run on the real deep_gemm, or ""."""
        if self.backend == "triton":
            return "backend='triton' was asked for"
        if (N // 2) % 128 or K % 128:
            return f"deep_gemm needs N/2 and K multiples of 128, got N={N}, K={K}"
        if not dg.status().usable:
            return dg.status().reason
        return ""

    def backend_for(self, problem: ProblemSize) -> str:
        """``"deep_gemm"`` (both GEMMs real), ``"deep_gemm[triton]"`` (both on moekit's Triton GEMM), or
        ``"deep_gemm[triton GEMM1]"`` / ``"deep_gemm[triton GEMM2]"`` (one GEMM's shape fell back)."""
        real1, real2 = self._real_gemms(problem.N, problem.K)
        if real1 == real2:
            return "deep_gemm" if real1 else "deep_gemm[triton]"
        return f"deep_gemm[triton GEMM{2 if real1 else 1}]"

    def why(self, problem: ProblemSize) -> str:
        """ "" when the real deep_gemm runs both GEMMs of this shape, else why moekit's Triton GEMM
        runs one (the failed build's message) or both; with ``backend="deep_gemm"`` that raises."""
        reason = self._layer_reason(problem.N, problem.K)
        if not reason:
            failed = [dg.build_failure(*shape) for shape in _gemm_shapes(problem.N, problem.K)]
            reason = "; ".join(f"GEMM{i + 1} on Triton: {why}" for i, why in enumerate(failed) if why)
        if reason and self.backend == "deep_gemm":
            raise BackendUnavailableError(f"backend='deep_gemm' asked for, but {reason}")
        return reason

    def check(self, problem: ProblemSize, weights: MoEWeights, *, a2_scale: torch.Tensor | None = None) -> None:
        """N and K multiples of 128 (the layout's blocks); a per-tensor a2_scale only."""
        super().check(problem, weights, a2_scale=a2_scale)
        if problem.N % 128 or problem.K % 128:
            raise QuantizationError(
                f"DeepGemmExperts needs N and K multiples of 128 (the contiguous layout's blocks), "
                f"got N={problem.N}, K={problem.K}; use TritonExperts or TritonOrDeepGemmExperts"
            )
        if a2_scale is not None and a2_scale.numel() != 1:
            raise QuantizationError(
                f"DeepGemmExperts takes a per-tensor a2_scale (1 element) or None, got shape "
                f"{tuple(a2_scale.shape)}: rows are permuted by expert, so per-token scales would need permuting"
            )
        self.why(problem)  # backend="deep_gemm" with a shape it cannot run: raise now

    def num_rows(self, problem: ProblemSize, tokens_meta: ExpertTokensMetadata | None = None) -> int:
        """M_sum: rows of the contiguous layout for this call (see the module docstring)."""
        pairs = problem.M * problem.topk
        cpu = tokens_meta.expert_num_tokens_cpu if tokens_meta is not None else None
        if cpu is None:
            return cdiv(pairs + (ALIGN_M - 1) * min(problem.num_local_experts, pairs), ALIGN_M) * ALIGN_M
        if cpu.numel() != problem.num_local_experts:
            raise InvalidInputError(
                f"tokens_meta has {cpu.numel()} counts, expected one per local expert ({problem.num_local_experts})"
            )
        return int(((cpu.long() + ALIGN_M - 1) // ALIGN_M).sum()) * ALIGN_M

    def workspace_shapes(
        self, problem: ProblemSize, *, act_dtype: torch.dtype, tokens_meta: ExpertTokensMetadata | None = None
    ) -> WorkspaceShapes:
        """``(M_sum, max(N, K))``, ``(M_sum + R_idx, max(N/2, K))``, output ``(M, topk, K)``, bf16
        (``(M * topk, K)`` with ``flat_output``). M_sum follows the CPU counts when given."""
        M_sum = self.num_rows(problem, tokens_meta)
        index_bytes = sum(_index_bytes(M_sum, problem.M * problem.topk, problem.num_local_experts))
        return self._shapes(M_sum, index_bytes, problem)

    def row_workspace_shapes(self, rows: int, problem: ProblemSize, *, act_dtype: torch.dtype) -> WorkspaceShapes:
        """For a chunk of ``rows`` sorted rows (a multiple of 128, already the contiguous layout):
        ``(rows, max(N, K))``, ``(rows + R_idx, max(N/2, K))`` (R_idx rows hold m_indices and
        block_rows), the whole output ``(M, topk, K)``, bf16."""
        return self._shapes(rows, 4 * rows + 4 * (rows // ALIGN_M) + 64, problem)

    def _shapes(self, rows: int, index_bytes: int, problem: ProblemSize) -> WorkspaceShapes:
        """workspace13 ``(rows, max(N, K))``; workspace2 ``(rows + R_idx, W2 = max(N/2, K))``, whose
        last R_idx rows hold ``index_bytes``; the output (flat with ``flat_output``); bf16."""
        M, N, K, topk = problem.M, problem.N, problem.K, problem.topk
        W2 = max(N // 2, K)
        out = (M * topk, K) if self.flat_output else (M, topk, K)
        return WorkspaceShapes((rows, max(N, K)), (rows + cdiv(index_bytes, 2 * W2), W2), out, torch.bfloat16)

    # ----------------------------------------------------------------------------------------
    @staticmethod
    def _layout(ws2: torch.Tensor, M_sum: int, pairs: int, E: int, K: int) -> permute.ContiguousLayout:
        off = M_sum * ws2.shape[1]  # in ws2's elements: the index rows start after M_sum rows
        views = []
        for nbytes, n in zip(_index_bytes(M_sum, pairs, E), permute.index_sizes(M_sum, pairs, E), strict=True):
            views.append(carve(ws2, (n,), dtype=torch.int32, offset=off))
            off += nbytes // ws2.element_size()
        return permute.ContiguousLayout(*_fp8_region(ws2, M_sum, K), *views)

    def apply(self, call: ExpertsCall) -> str:
        """permute -> GEMM1 -> silu_and_mul + fp8 requant -> GEMM2 -> unpermute into ``call.output``."""
        p = call.problem
        M, topk = p.M, p.topk
        ws2 = carve(call.workspace2, call.shapes.workspace2)
        M_sum = call.shapes.workspace13[0]
        if M == 0 or M_sum == 0:  # no local (token, slot) pair: every slot's output is zero
            call.output.zero_()
            return self.backend_for(p)
        meta = call.tokens_meta
        if meta is not None and call.guard and meta.expert_num_tokens_cpu is not None:
            total = int(meta.expert_num_tokens_cpu.sum())
            if total > M * topk:  # moekit's check: upstream would size and place rows from them
                raise StaleMetadataError(
                    f"tokens_meta counts {total} (token, slot) pairs for this rank's experts, but this call has "
                    f"only M*topk = {M} tokens x {topk} slots = {M * topk} pairs. The counts describe a larger "
                    "batch: whole-batch expert_num_tokens were handed to a chunk (bug 2 of vLLM PR #20392). "
                    "Sizing the layout from them would be wrong; recount per chunk "
                    "(ModularKernel(metadata_policy='per_chunk'))."
                )
        counts = call.tokens_per_expert()  # the modular kernel counted this chunk (or handed stale counts: bug 2)
        layout = self._layout(ws2, M_sum, M * topk, p.num_local_experts, p.K)
        permute.launch_permute(
            call.hidden, call.hidden_scale, call.topk_ids, counts, layout, expert_map=call.expert_map
        )
        if meta is not None and call.guard and int(layout.flags.item()):  # one sync, outside counts only
            routed = (layout.cursor - layout.expert_start[:-1]).tolist()
            raise StaleMetadataError(
                f"tokens_meta.expert_num_tokens = {counts.tolist()}, but this call's topk_ids route "
                f"{routed} (token, slot) pairs to the local experts: the metadata belongs to another "
                "batch (bug 2 of vLLM PR #20392: whole-batch counts handed to a chunk). Recount per chunk."
            )
        rows = self._rows_in_use(call, layout, M_sum)
        blocks = (layout.m_indices[:rows], layout.block_rows[: rows // ALIGN_M])
        mm2 = self._two_gemms(call, layout.a[:rows], layout.a_scale[:rows], *blocks)
        permute.unpermute_from_contiguous(mm2, layout.inv_perm, out=call.output)
        return self.backend_for(p)  # "deep_gemm[triton GEMM2]" if GEMM2 fell back on a build failure

    def apply_rows(self, call: ExpertsCall) -> str:
        """One chunk of the batch's sorted rows: it is already DeepGEMM's contiguous layout (128-row
        blocks of one expert each), so gather its rows, run both GEMMs, scatter each pair's row."""
        p, chunk = call.problem, call.chunk
        layout, R = chunk.layout, chunk.size
        ws2 = carve(call.workspace2, call.shapes.workspace2)
        sorted_ids = layout.sorted_token_ids[chunk.start : chunk.end]
        experts = layout.expert_ids[chunk.start // ALIGN_M : chunk.end // ALIGN_M]  # -1: another rank's
        a, a_scale = _fp8_region(ws2, R, p.K)
        permute.gather_positions(
            call.hidden, call.hidden_scale, sorted_ids, numel=layout.numel, topk=p.topk, out=a, out_scale=a_scale
        )
        # deep_gemm never sees -1 (1.0 reads out of bounds on it): such blocks take expert 0 and
        # their rows are dropped by the scatter; the Triton GEMM skips them (block_rows 0).
        idx = carve(ws2, (R + R // ALIGN_M,), dtype=torch.int32, offset=R * ws2.shape[1])  # the rows past R
        m_indices, block_rows = idx[:R], idx[R:]
        m_indices.copy_(experts.clamp(min=0).repeat_interleave(ALIGN_M))
        filled = (sorted_ids.view(-1, ALIGN_M) < layout.numel).sum(1)
        block_rows.copy_(torch.where(experts >= 0, filled, 0))
        mm2 = self._two_gemms(call, a, a_scale, m_indices, block_rows)
        permute.scatter_positions(mm2, sorted_ids, experts, numel=layout.numel, expert_block=ALIGN_M, out=call.output)
        return self.backend_for(p)

    def _two_gemms(self, call: ExpertsCall, a, a_scale, m_indices, block_rows) -> torch.Tensor:
        """GEMM1 -> silu_and_mul + fp8 requant -> GEMM2 over the rows of ``a`` (the fp8 region at the
        start of workspace2, which the requantized activation then takes over); returns GEMM2's
        output, workspace13 as ``[M_sum, K]`` (M_sum: the rows declared), its first ``len(a)`` rows computed."""
        N, K, w = call.problem.N, call.problem.K, call.weights
        M_sum, rows = call.shapes.workspace13[0], a.shape[0]
        ws13 = carve(call.workspace13, call.shapes.workspace13)
        real1, real2 = self._real_gemms(N, K)
        mm1 = carve(ws13, (M_sum, N))[:rows]
        self._gemm(real1, a, a_scale, w.w1, w.w1_scale, mm1, m_indices, block_rows)
        q, q_scale = _fp8_region(carve(call.workspace2, call.shapes.workspace2), M_sum, N // 2)  # a is dead now
        q, q_scale = q[:rows], q_scale[:rows]
        static = call.a2_scale.reshape(-1).float() if call.a2_scale is not None else None
        launch_silu_and_mul_fp8_group(mm1, q, q_scale, rows, N // 2, static_scale=static)
        mm2 = carve(ws13, (M_sum, K))
        self._gemm(real2, q, q_scale, w.w2, w.w2_scale, mm2[:rows], m_indices, block_rows)
        return mm2

    def _rows_in_use(self, call: ExpertsCall, layout: permute.ContiguousLayout, M_sum: int) -> int:
        """Rows the GEMMs must compute. Without CPU counts M_sum is a worst case (every expert
        padded by 127 rows), and deep_gemm computes every row it is given. Reading the real total
        costs one host sync, after which the GPU idles while the host launches the GEMMs (about
        0.2 ms with deep_gemm 1.0). So read it only when the worst-case padding is large work.
        H200, fp8, M=4096: DeepSeek-V3 shape 6.84 -> 5.54 ms with the sync; Qwen3-30B-A3B shape
        0.80 -> 0.98 ms, so not there. Never under CUDA-graph capture, nor for the Triton GEMM,
        which skips blocks of pure padding on the device."""
        meta = call.tokens_meta
        real = any(self._real_gemms(call.problem.N, call.problem.K))
        if not real or (meta is not None and meta.expert_num_tokens_cpu is not None):
            return M_sum
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return M_sum
        E, N, K = call.weights.w1.shape
        padding_work = (ALIGN_M - 1) * E * (N + K) * K  # multiply-adds of the worst-case padding rows
        if padding_work < _SYNC_WORTH_IT:
            return M_sum
        return int(layout.expert_start[-1].item())

    def gemm_config(self, num_rows: int, N: int, K: int) -> GemmConfig:
        """Tiles of moekit's Triton contiguous GEMM (the fallback); a subclass may override it."""
        return default_config(num_rows, N, K)

    def _gemm(self, real: bool, a, a_scale, b, b_scale, out, m_indices, block_rows) -> None:
        if real:
            try:
                dg.grouped_gemm_contiguous(a, a_scale, b, b_scale, out, m_indices)
                return
            except BackendUnavailableError:  # deep_gemm could not build this shape: remembered, never retried
                if self.backend == "deep_gemm":
                    raise
        config = self.gemm_config(a.shape[0], b.shape[1], b.shape[2])
        contiguous_gemm(a, a_scale, b, b_scale, m_indices, out=out, block_rows=block_rows, config=config)


__all__ = ["DeepGemmExperts"]
