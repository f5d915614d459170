"""Batched-format experts: per-expert slabs in, per-expert slabs out.

Shapes (E local experts, T = max tokens per expert, K hidden, N = w1 rows)::

    hidden       [E, T, K]     slab e holds expert e's tokens in rows [0, n_e)
    workspace13  [E, T, N]     GEMM1 output
    workspace2   [E, T, N/2]   silu_and_mul output (fp8 block: its fp8 requantization)
    output       [E, T, K]     output[e, :n_e] = silu_and_mul(hidden[e, :n_e] @ w1[e]^T) @ w2[e]^T

``n_e = tokens_meta.expert_num_tokens[e]``. Rows past n_e are padding. The output's padding rows
are never written (they keep whatever the buffer held; finalize never reads them), so unlike the
Standard-format contract in ``base.py`` not every output element is written.

The expert map was already applied by the batched prepare stage (slab e *is* local expert e), so
these classes accept a placement with a map and ignore ``call.expert_map``.
"""

from __future__ import annotations

import torch

from moekit.errors import InvalidInputError, QuantizationError, StaleMetadataError
from moekit.experts.base import Experts, carve
from moekit.quant import FP8, dequantize_fp8_block, dequantize_fp8_per_token_group
from moekit.reference import silu_and_mul
from moekit.types import (
    ActivationFormat,
    ExpertsCall,
    ExpertTokensMetadata,
    MoEWeights,
    ProblemSize,
    QuantScheme,
    WorkspaceShapes,
)


def _desc(scale) -> str:
    return f"shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else f"a {type(scale).__name__}"


class _BatchedExperts(Experts):
    """What both batched classes share: format flags, workspace shapes, the metadata check."""

    activation_format = ActivationFormat.BATCHED
    supports_chunking = False  # slabs are per expert, not per token: there is no M to split
    # True although these classes never read a map: the batched prepare stage maps global ids to
    # local slabs, and the modular kernel must let the map through to it.
    supports_expert_map = True
    uses_tokens_meta = True

    def workspace_shapes(
        self, problem: ProblemSize, *, act_dtype: torch.dtype, tokens_meta: ExpertTokensMetadata | None = None
    ) -> WorkspaceShapes:
        """``(E, T, N)``, ``(E, T, N/2)`` and output ``(E, T, K)``, where ``T = problem.M``.

        For the batched format the modular kernel sets ``problem.M`` to the slab height
        (max tokens per expert), not to the caller's token count.
        """
        E, T, N, K = problem.num_local_experts, problem.M, problem.N, problem.K
        return WorkspaceShapes((E, T, N), (E, T, N // 2), (E, T, K), self.compute_dtype(act_dtype))

    def check(self, problem: ProblemSize, weights: MoEWeights, *, a2_scale=None) -> None:
        """A static ``a2_scale`` is refused: the batched fp8 path always requantizes the
        intermediate with dynamic 1x128 scales, and a scale it ignored would be a silent lie."""
        super().check(problem, weights, a2_scale=None)
        if a2_scale is not None:
            raise QuantizationError(
                f"{self.name} requantizes between the GEMMs with dynamic 1x128 scales and does not take "
                f"a static a2_scale (got {_desc(a2_scale)}); pass a2_scale=None"
            )

    def _counts(self, call: ExpertsCall) -> ExpertTokensMetadata:
        meta = call.tokens_meta
        if meta is None:
            raise InvalidInputError(
                f"{self.name} needs tokens_meta (tokens per local expert), got None; pair it with "
                "BatchedPrepareFinalize, which returns ExpertTokensMetadata"
            )
        E = call.hidden.shape[0]
        if tuple(meta.expert_num_tokens.shape) != (E,):
            raise StaleMetadataError(
                f"{self.name}: expert_num_tokens must have one entry per local expert slab, expected "
                f"[{E}], got {list(meta.expert_num_tokens.shape)}"
            )
        return meta


class NaiveBatchedExperts(_BatchedExperts):
    """The reference batched experts: a plain torch loop over local experts, math in fp32.

    Reads the counts on the host (a sync) and skips experts with no tokens. fp8 block inputs
    and weights are dequantized to fp32 first.

    Args:
        quant: ``QuantScheme.NONE`` or ``QuantScheme.FP8_BLOCK``.
    """

    act_dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # a torch loop: fp64 too

    def backend_for(self, problem: ProblemSize) -> str:
        return "torch"

    def apply(self, call: ExpertsCall) -> str:
        """Compute ``output[e, :n_e]`` for every local expert with tokens; returns ``"torch"``."""
        meta = self._counts(call)
        fp8 = self.quant is QuantScheme.FP8_BLOCK
        T = call.problem.M
        ws13 = carve(call.workspace13, call.shapes.workspace13)
        ws2 = carve(call.workspace2, call.shapes.workspace2)
        counts = meta.expert_num_tokens if meta.expert_num_tokens_cpu is None else meta.expert_num_tokens_cpu
        w = call.weights
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            if n > T:
                raise StaleMetadataError(f"expert_num_tokens[{e}] = {n} exceeds the slab height T={T}")
            if fp8:
                x = dequantize_fp8_per_token_group(call.hidden[e, :n], call.hidden_scale[e, :n])
                w1 = dequantize_fp8_block(w.w1[e], w.w1_scale[e])
                w2 = dequantize_fp8_block(w.w2[e], w.w2_scale[e])
            else:
                x, w1, w2 = call.hidden[e, :n].float(), w.w1[e].float(), w.w2[e].float()
            ws13[e, :n] = x @ w1.t()
            ws2[e, :n] = silu_and_mul(ws13[e, :n].float())
            call.output[e, :n] = ws2[e, :n].float() @ w2.t()
        return "torch"


class BatchedTritonExperts(_BatchedExperts):
    """Two Triton batched GEMMs masked by the counts, with silu_and_mul between them.

    ``GEMM1 -> workspace13 -> silu_and_mul -> workspace2 -> GEMM2 -> output``. Tiles past an
    expert's token count exit at once, so an expert with 0 tokens costs one early return per
    tile. No host sync. With ``QuantScheme.FP8_BLOCK`` the activation kernel also requantizes
    its output per 1x128 group, as the fp8 block GEMM2 consumes it.

    Args:
        quant: ``QuantScheme.NONE`` or ``QuantScheme.FP8_BLOCK``.
    """

    def apply(self, call: ExpertsCall) -> str:
        """Run GEMM1, the activation and GEMM2 on every slab; returns ``"triton"``."""
        from moekit.kernels.activation import silu_and_mul, silu_and_mul_fp8_group
        from moekit.kernels.batched_gemm import batched_gemm

        counts = self._counts(call).expert_num_tokens
        fp8 = self.quant is QuantScheme.FP8_BLOCK
        E, T, N = call.problem.num_local_experts, call.problem.M, call.problem.N
        w = call.weights
        ws13 = carve(call.workspace13, call.shapes.workspace13)
        ws2 = carve(call.workspace2, call.shapes.workspace2)
        # The activation runs over every row of the slabs (one launch, no host sync), so GEMM1
        # zeroes the padding rows: stale workspace bytes could hold inf/NaN. GEMM2 never reads them.
        x, x_scale = call.hidden, call.hidden_scale
        batched_gemm(x, w.w1, counts, out=ws13, a_scale=x_scale, b_scale=w.w1_scale, zero_padding=True)
        rows = ws13.view(E * T, N)
        if fp8:
            # Quantize in the same pass; the fp8 activations fit in workspace2's first half.
            q = carve(call.workspace2, (E * T, N // 2), dtype=FP8)
            a2, a2_scale = silu_and_mul_fp8_group(rows, out_q=q)
            a2, a2_scale = a2.view(E, T, N // 2), a2_scale.view(E, T, -1)
        else:
            a2, a2_scale = silu_and_mul(rows, out=ws2.view(E * T, N // 2)).view(E, T, N // 2), None
        batched_gemm(a2, w.w2, counts, out=call.output, a_scale=a2_scale, b_scale=w.w2_scale)
        return "triton"
