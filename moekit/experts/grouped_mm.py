"""``GroupedMMExperts``: torch's grouped GEMM over expert-sorted rows (Standard format).

One call (M tokens, R = M * topk (token, slot) pairs, E local experts)::

    sort        pairs by local expert (empty and remote pairs last)     order [R]
    gather      rows = hidden[order // topk]                           workspace13 [R, K]
    offsets     offs = cumsum(tokens per expert)                       int32 [E]
    GEMM1       h = torch._grouped_mm(rows, w1^T, offs)                [R, N]
    activation  a = silu(h[:, :N/2]) * h[:, N/2:]                      workspace2 [R, N/2]
    GEMM2       y = torch._grouped_mm(a, w2^T, offs)                   [R, K]
    scatter     output.view(R, K)[order] = y (zeros for empty/remote)  [M, topk, K]

This is the layout that grouped-GEMM MoE implementations use (transformers' ``grouped_mm``
experts, SonicMoE): rows sorted by expert, one group per expert, **group boundaries from the
tokens per expert**. When ``tokens_meta`` is given (a dispatcher counted them already), those
counts set the boundaries and nothing is recounted: no extra launch, no host sync. That makes
this class a consumer for which stale counts (bug 2 of PR #20392) are not a soft cost but a
wrong answer: with whole-batch counts handed to a chunk, rows are multiplied by the wrong
experts' weights, and ``torch._grouped_mm`` raises nothing. Upstream vLLM had no standard-format
consumer of this kind; moekit adds it to show what per-chunk counts protect.

Under the guard (``ModularKernel(guard=True)``, the default) counts that are not the chunk's own
raise StaleMetadataError first (see :meth:`GroupedMMExperts._counts`: no host read when they are
the chunk's own, the default). GEMM outputs are allocated by torch (it has
no ``out=`` for grouped GEMMs); the workspaces hold the gathered rows and the activation.
"""

from __future__ import annotations

import torch

from moekit.errors import QuantizationError, StaleMetadataError
from moekit.experts.base import Experts, carve
from moekit.kernels.activation import launch_silu_and_mul
from moekit.reference import local_expert_ids
from moekit.types import ExpertsCall, ExpertTokensMetadata, MoEWeights, ProblemSize, QuantScheme, WorkspaceShapes


class GroupedMMExperts(Experts):
    """Unquantized experts on ``torch._grouped_mm``, grouped by the tokens per expert.

    Args:
        quant: must be ``QuantScheme.NONE`` (bf16 on a GPU; bf16/fp16/fp32 on the CPU).
    """

    supports_chunking = True
    supports_expert_map = True
    uses_tokens_meta = True

    def backend_for(self, problem: ProblemSize) -> str:
        return "torch_grouped_mm"

    def check(self, problem: ProblemSize, weights: MoEWeights, *, a2_scale=None) -> None:
        """Unquantized only; rows of 16 bytes or multiples (``torch._grouped_mm``'s alignment)."""
        if self.quant is not QuantScheme.NONE:
            raise QuantizationError(f"GroupedMMExperts runs unquantized weights only, got quant={self.quant}")
        super().check(problem, weights, a2_scale=a2_scale)
        item = weights.w1.element_size()
        if (problem.K * item) % 16 or (problem.N // 2 * item) % 16:
            raise QuantizationError(
                f"torch._grouped_mm needs K and N/2 rows of a multiple of 16 bytes, got K={problem.K}, "
                f"N/2={problem.N // 2} in {weights.w1.dtype}"
            )

    def workspace_shapes(
        self, problem: ProblemSize, *, act_dtype: torch.dtype, tokens_meta: ExpertTokensMetadata | None = None
    ) -> WorkspaceShapes:
        """``(M * topk, K)`` gathered rows, ``(M * topk, N/2)`` activation, output ``(M, topk, K)``."""
        R = problem.M * problem.topk
        return WorkspaceShapes((R, problem.K), (R, problem.N // 2), (problem.M, problem.topk, problem.K), act_dtype)

    def apply(self, call: ExpertsCall) -> str:
        """Sort, gather, two grouped GEMMs and the activation, scatter; returns ``"torch_grouped_mm"``."""
        p, w = call.problem, call.weights
        R, E, H = p.M * p.topk, p.num_local_experts, p.N // 2
        if R == 0:
            return "torch_grouped_mm"
        local = local_expert_ids(call.topk_ids.reshape(-1), E, call.expert_map)  # -1: empty slot or remote
        valid = local >= 0
        order = torch.argsort(torch.where(valid, local, E), stable=True)  # by expert, invalid last
        rows = carve(call.workspace13, (R, p.K))
        torch.index_select(call.hidden, 0, order // p.topk, out=rows)
        offs = torch.cumsum(self._counts(call), 0, dtype=torch.int32)
        keep = valid[order, None]  # empty and remote pairs sit past offs[-1]: their rows are garbage
        h = torch._grouped_mm(rows, w.w1.transpose(1, 2), offs=offs)  # [R, N]
        act = launch_silu_and_mul(
            torch.where(keep, h, 0), carve(call.workspace2, (R, H)), R, H, x_stride=p.N, out_stride=H
        )
        y = torch.where(keep, torch._grouped_mm(act, w.w2.transpose(1, 2), offs=offs), 0)
        call.output.view(R, p.K).index_copy_(0, order, y.to(call.output.dtype))
        return "torch_grouped_mm"

    def _counts(self, call: ExpertsCall) -> torch.Tensor:
        """The group sizes: the tokens per expert the call was handed, checked under the guard.

        The modular kernel hands every chunk its own device counts (``call.counts``). When the
        metadata's counts are that very tensor (the default, ``metadata_policy="per_chunk"``) they are
        the chunk's own and nothing is checked. Otherwise (``"whole_batch"``, bug 2) the guard compares
        them: first the CPU copy's sum against the pairs the call holds (no device read), then every
        entry against the chunk's own counts (one host read, on this path only). Under an expert_map
        the sums alone miss it: most pairs go to other ranks, so a whole batch's local counts can sum
        to fewer pairs than one chunk holds and still place every group wrongly.
        """
        meta = call.tokens_meta
        if meta is None:
            return call.counts  # the modular kernel counted this chunk
        handed = meta.expert_num_tokens
        if call.guard and handed is not call.counts:
            _check_fresh(call, meta)
        return handed


def _check_fresh(call: ExpertsCall, meta: ExpertTokensMetadata) -> None:
    """StaleMetadataError unless ``meta`` counts the rows of ``call`` (see ``GroupedMMExperts._counts``)."""
    p, cpu = call.problem, meta.expert_num_tokens_cpu
    pairs = p.M * p.topk
    fix = "(bug 2 of vLLM PR #20392). Recount per chunk (ModularKernel(metadata_policy='per_chunk'))."
    if cpu is not None and int(cpu.sum()) > pairs:
        raise StaleMetadataError(
            f"tokens_meta counts {int(cpu.sum())} (token, slot) pairs, but this call holds only "
            f"{p.M} rows x {p.topk} slots = {pairs}: the counts describe a larger batch {fix}"
        )
    own = call.counts
    if own is None:
        return  # called outside the modular kernel: nothing to compare with
    handed = meta.expert_num_tokens
    if handed.shape != own.shape or not torch.equal(handed, own.to(handed.device)):
        got = (cpu if cpu is not None else handed).tolist()
        raise StaleMetadataError(
            f"tokens_meta counts {got} rows per local expert, but the {p.M} rows x {p.topk} slots of this "
            f"call count {own.tolist()}: the counts describe other rows {fix}"
        )
