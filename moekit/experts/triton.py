"""``TritonExperts``: align -> grouped GEMM1 -> silu_and_mul -> grouped GEMM2 (Standard format).

Shapes (M tokens in this chunk, topk slots, K hidden, N = w1 rows = 2 x intermediate)::

    hidden       [M, K]           bf16/fp16/fp32, or fp8 with hidden_scale [M, K/128]
    workspace13  [M, topk, N]     GEMM1 output, one row per (token, slot) pair
    workspace2   [M * topk, N/2]  silu_and_mul output; with fp8, its bytes hold the fp8
                                  requantization [M*topk, N/2] and its scales [M*topk, N/256]
    output       [M, topk, K]     GEMM2 output, unweighted; rows of remote experts and empty
                                  slots are zeros

No tensor is permuted: both GEMMs gather their rows through ``sorted_token_ids`` and scatter
their results back to the pair's own row. A chunk of sorted rows (``chunk_by="rows"``) runs the
same steps over its rows of the batch's layout (:meth:`TritonExperts.apply_rows`).

On Hopper GPUs ``moekit.fused_moe`` and the integrations use the wing's subclass
(``HopperTritonExperts``, the Hopper wing): the same steps, faster.
"""

from __future__ import annotations

import torch

from moekit.errors import QuantizationError
from moekit.experts.base import Experts, carve
from moekit.kernels.activation import silu_and_mul_fp8_group_launch, silu_and_mul_launch
from moekit.kernels.align import AlignedBlocks, launch_align
from moekit.kernels.fused_moe import RowWindow, Tiles, fused_moe_gemm, pick_tiles
from moekit.quant import FP8, FP8_GROUP
from moekit.types import (
    ActivationFormat,
    ExpertsCall,
    ExpertTokensMetadata,
    MoEWeights,
    ProblemSize,
    QuantScheme,
    WorkspaceShapes,
)


class TritonExperts(Experts):
    """Triton grouped GEMMs over expert-aligned blocks, for any M (Standard format).

    Args:
        quant: ``QuantScheme.NONE`` (bf16/fp16/fp32) or ``QuantScheme.FP8_BLOCK`` (fp8 e4m3
            weights with 128x128 block scales, activations with 1x128 group scales).

    Tile sizes come from :meth:`tile_configs`; a subclass may override it.
    """

    activation_format = ActivationFormat.STANDARD
    supports_chunking = True
    supports_row_chunks = True
    supports_expert_map = True

    def check(self, problem: ProblemSize, weights: MoEWeights, *, a2_scale: torch.Tensor | None = None) -> None:
        """fp8 block needs K and N/2 multiples of 128 (whole scale groups); see :meth:`Experts.check`."""
        super().check(problem, weights, a2_scale=a2_scale)
        if self.quant is QuantScheme.FP8_BLOCK and (problem.K % FP8_GROUP or problem.N % (2 * FP8_GROUP)):
            raise QuantizationError(
                f"fp8 block TritonExperts need K and N/2 to be multiples of 128, got K={problem.K}, N={problem.N}"
            )

    def workspace_shapes(
        self, problem: ProblemSize, *, act_dtype: torch.dtype, tokens_meta: ExpertTokensMetadata | None = None
    ) -> WorkspaceShapes:
        """``(M, topk, N)``, ``(M * topk, N/2)`` and output ``(M, topk, K)`` in the compute dtype."""
        M, N, K, topk = problem.M, problem.N, problem.K, problem.topk
        return WorkspaceShapes((M, topk, N), (M * topk, N // 2), (M, topk, K), self.compute_dtype(act_dtype))

    def row_workspace_shapes(self, rows: int, problem: ProblemSize, *, act_dtype: torch.dtype) -> WorkspaceShapes:
        """For a chunk of ``rows`` sorted rows: ``(rows, 1, N)`` and ``(rows, N/2)``; the output
        is the whole ``(M, topk, K)``."""
        N, out = problem.N, (problem.M, problem.topk, problem.K)
        return WorkspaceShapes((rows, 1, N), (rows, N // 2), out, self.compute_dtype(act_dtype))

    def tile_configs(self, problem: ProblemSize, dtype: torch.dtype) -> tuple[Tiles, Tiles]:
        """``(GEMM1, GEMM2)`` tiles for this chunk (:func:`moekit.kernels.fused_moe.pick_tiles`)."""
        tiles = pick_tiles(problem.M * problem.topk / max(problem.global_num_experts, 1), dtype)
        return tiles, tiles

    def apply(self, call: ExpertsCall) -> str:
        """Compute one chunk of tokens into ``call.output``; returns ``"triton"``."""
        ws13 = carve(call.workspace13, call.shapes.workspace13)  # [M, topk, N]
        ws2 = carve(call.workspace2, call.shapes.workspace2)  # [M * topk, N/2]
        if call.problem.M == 0:
            return "triton"
        tiles1, tiles2 = self.tile_configs(call.problem, call.hidden.dtype)
        blocks1 = self._align(call, tiles1.BLOCK_M)
        blocks2 = blocks1 if tiles2.BLOCK_M == tiles1.BLOCK_M else self._align(call, tiles2.BLOCK_M)
        self.gemms(call, ws13, ws2, (tiles1, tiles2), (blocks1, blocks2), (None, None))
        return "triton"

    def apply_rows(self, call: ExpertsCall) -> str:
        """One chunk of the batch's sorted rows: GEMM1 gathers its tokens and writes the chunk's
        workspace by position, GEMM2 reads it by position and writes each pair's output row."""
        chunk = call.chunk
        ws13 = carve(call.workspace13, call.shapes.workspace13)  # [rows, 1, N]
        ws2 = carve(call.workspace2, call.shapes.workspace2)  # [rows, N/2]
        tiles = self.tile_configs(call.problem, call.hidden.dtype)
        gather = RowWindow(chunk.start, chunk.end, read="pair", write="position")
        scatter = RowWindow(chunk.start, chunk.end, read="position", write="pair")
        self.gemms(call, ws13, ws2, tiles, (chunk.layout, chunk.layout), (gather, scatter))
        return "triton"

    def gemms(self, call: ExpertsCall, ws13, ws2, tiles: tuple, blocks: tuple, windows: tuple) -> None:
        """GEMM1, silu_and_mul, GEMM2 over ``R`` rows (a chunk's (token, slot) pairs, or its sorted
        rows); ``tiles``, ``blocks`` and ``windows`` hold GEMM1's, then GEMM2's."""
        p, w = call.problem, call.weights
        # GEMM1: each row's token of hidden times its expert's w1.
        fused_moe_gemm(
            call.hidden,
            w.w1,
            ws13,
            blocks[0],
            pairs_per_row=p.topk,
            tiles=tiles[0],
            a_scale=call.hidden_scale,
            w_scale=w.w1_scale,
            window=windows[0],
            check=False,
        )
        # silu(gate) * up, then GEMM2: each row's activation times its expert's w2.
        act, act_scale = self.activation(call, carve(ws13, (ws2.shape[0], p.N)), ws2)
        fused_moe_gemm(
            act,
            w.w2,
            call.output,
            blocks[1],
            pairs_per_row=1,
            tiles=tiles[1],
            a_scale=act_scale,
            w_scale=w.w2_scale,
            window=windows[1],
            check=False,
        )

    def activation(self, call: ExpertsCall, x: torch.Tensor, ws2: torch.Tensor):
        """``silu(x[:, :H]) * x[:, H:]`` into workspace2: ``(activation, None)``, or with fp8 the
        requantized activation and its scales, both carved from workspace2's bytes."""
        act, scale, launch = self.activation_launch(call, x, ws2)
        if launch is not None:
            launch.run()
        return act, scale

    def activation_launch(self, call: ExpertsCall, x: torch.Tensor, ws2: torch.Tensor):
        """``(activation, scales or None, the KernelLaunch that computes them)`` (see :meth:`activation`)."""
        R, N = x.shape
        H = N // 2
        if self.quant is not QuantScheme.FP8_BLOCK:
            return ws2, None, silu_and_mul_launch(x, ws2, R, H, x_stride=N, out_stride=H)
        q = carve(ws2, (R, H), dtype=FP8)  # the fp8 values, then their fp32 scales, in ws2's bytes
        scale = carve(ws2, (R, H // FP8_GROUP), dtype=torch.float32, offset=R * H // 2)
        static = call.a2_scale.reshape(-1).float() if call.a2_scale is not None else None
        if static is not None and static.numel() > 1:  # (row chunks take a per-tensor scale only)
            static = static.repeat_interleave(call.problem.topk)  # one per token, shared by its topk rows
        return q, scale, silu_and_mul_fp8_group_launch(x, q, scale, R, H, static_scale=static)

    @staticmethod
    def _align(call: ExpertsCall, block_m: int) -> AlignedBlocks:
        # keep_empty: empty slots get zero rows too, so every element of the output is written.
        placement = call.placement
        return launch_align(
            call.topk_ids,
            block_m,
            placement.global_num_experts,
            placement.expert_map,
            num_local_experts=placement.num_local_experts,
            keep_empty=True,
        )
