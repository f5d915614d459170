"""``HopperTritonExperts``: the book's ``TritonExperts`` at Hopper speed (the wing's one experts class).

Shapes (M tokens in this chunk, topk slots, K hidden, N = w1 rows = 2 x intermediate)::

    hidden       [M, K]           bf16/fp16/fp32, or fp8 with hidden_scale [M, K/128]
    workspace13  [M, topk, N]     GEMM1 output, one row per (token, slot) pair
    workspace2   [M * topk, N/2]  silu_and_mul output; with fp8, its bytes hold the fp8
                                  requantization [M*topk, N/2] and its scales [M*topk, N/256]
    output       [M, topk, K]     GEMM2 output, unweighted; rows of remote experts and empty
                                  slots are zeros

No tensor is permuted: both GEMMs gather their rows through ``sorted_token_ids`` and scatter
their results back to the pair's own row. Up to ``moekit.hopper.pair_blocks.PAIR_MAX`` pairs
(decode) there is no align: each pair is a block of its own and the GEMMs read its expert from
``topk_ids``.

With ``fuse_activation=True`` GEMM1 applies silu_and_mul (and the fp8 requantization) in its
epilogue: workspace13 becomes ``[M, topk, N/2]`` (the activation, or its fp8 bytes and scales)
and workspace2 is empty. One launch and one ``[M*topk, N]`` round trip through memory fewer.

Beside the book's steps it launches through :class:`moekit.hopper.launch.LeanLauncher` with PDL
(:mod:`moekit.hopper.pdl`), takes its tiles from the measured table (:mod:`moekit.hopper.configs`,
TMA, tail tiles, the persistent walk) and aligns with the one-launch fast paths
(:mod:`moekit.hopper.align`). ``moekit.fused_moe``, the transformers integration and the harness
choose it by default on sm90 GPUs (:func:`default_triton_experts`); its tests hold it to the book's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moekit.experts.base import carve
from moekit.experts.triton import TritonExperts
from moekit.hopper import pair_blocks, pdl
from moekit.hopper.align import launch_align
from moekit.hopper.configs import KernelConfig, get_config
from moekit.hopper.gemm_args import GatedOutput
from moekit.hopper.grouped_gemm import fused_moe_gemm
from moekit.hopper.launch import launch_stream, memo, run_lean
from moekit.hopper.pair_blocks import PairBlocks
from moekit.kernels.align import AlignedBlocks
from moekit.kernels.count import count_launch
from moekit.quant import FP8, FP8_GROUP
from moekit.types import ExpertPlacement, ExpertsCall, ExpertTokensMetadata, ProblemSize, QuantScheme, WorkspaceShapes
from moekit.validate import check_flag


class HopperTritonExperts(TritonExperts):
    """The book's ``TritonExperts`` with the wing's kernels and launches (Standard format).

    Args:
        quant: ``QuantScheme.NONE`` (bf16/fp16/fp32) or ``QuantScheme.FP8_BLOCK`` (fp8 e4m3
            weights with 128x128 block scales, activations with 1x128 group scales).
        fuse_activation: run silu_and_mul (and the fp8 requantization) inside GEMM1's epilogue
            instead of as a separate kernel (see the module docstring). Off by default: the
            separate steps are the upstream pipeline that the notebooks take apart. On the H200
            it was faster at decode (Qwen3-30B-A3B, M=1 under a CUDA graph: 33.7 vs 35.6 us).

    Tile sizes come from :meth:`tile_configs` (the committed table); a subclass may override it.
    """

    def __init__(self, *, quant: QuantScheme = QuantScheme.NONE, fuse_activation: bool = False):
        super().__init__(quant=quant)
        self.fuse_activation = check_flag(fuse_activation, "fuse_activation")
        self._tiles: dict = {}  # (problem, dtype) -> the tiles of both GEMMs (a pure function of them)
        self._shapes: dict = {}  # (problem, dtype) -> the declared workspaces (eager speed only)

    def __repr__(self) -> str:
        return f"{self.name}(quant={self.quant.value}, fuse_activation={self.fuse_activation})"

    def workspace_shapes(
        self, problem: ProblemSize, *, act_dtype: torch.dtype, tokens_meta: ExpertTokensMetadata | None = None
    ) -> WorkspaceShapes:
        """The book's ``(M, topk, N)``, ``(M * topk, N/2)`` and output ``(M, topk, K)`` (fused
        activation: ``(M, topk, N/2)`` and ``(M * topk, 0)``). Asked per chunk, as in the book;
        answered from a memo (the shapes are a pure function of the sizes and the dtype)."""
        book = super().workspace_shapes
        return memo(self._shapes, (problem, act_dtype), lambda: self._fused(book(problem, act_dtype=act_dtype)))

    def row_workspace_shapes(self, rows: int, problem: ProblemSize, *, act_dtype: torch.dtype) -> WorkspaceShapes:
        """The book's ``(rows, 1, N)`` and ``(rows, N/2)`` (fused: ``(rows, 1, N/2)`` and ``(rows, 0)``);
        the output is the whole ``(M, topk, K)``."""
        return self._fused(super().row_workspace_shapes(rows, problem, act_dtype=act_dtype))

    def _fused(self, shapes: WorkspaceShapes) -> WorkspaceShapes:
        if not self.fuse_activation:
            return shapes
        *lead, N = shapes.workspace13  # GEMM1 writes the activation itself: N/2 wide, no workspace2
        return replace(shapes, workspace13=(*lead, N // 2), workspace2=(shapes.workspace2[0], 0))

    def tile_configs(self, problem: ProblemSize, dtype: torch.dtype) -> tuple[KernelConfig, KernelConfig]:
        """``(GEMM1, GEMM2)`` tiles for this chunk, from :func:`moekit.hopper.configs.get_config`."""
        return memo(self._tiles, (problem, dtype), lambda: self._pick_tiles(problem, dtype))

    def _pick_tiles(self, problem: ProblemSize, dtype: torch.dtype) -> tuple[KernelConfig, KernelConfig]:
        M, N, K, E, topk = problem.M, problem.N, problem.K, problem.global_num_experts, problem.topk
        cfg1 = get_config(M, N, K, E, topk, dtype, stage=1, gated=self.fuse_activation)
        cfg2 = get_config(M, K, N // 2, E, topk, dtype, stage=2)
        if self.fuse_activation and dtype == FP8 and cfg1.BLOCK_N != FP8_GROUP:  # one program per scale group
            cfg1 = replace(cfg1, BLOCK_N=FP8_GROUP)
        return cfg1, cfg2

    def apply(self, call: ExpertsCall) -> str:
        """Compute one chunk of tokens into ``call.output``; returns ``"triton"``."""
        if call.problem.M * call.problem.topk <= pdl.MAX_ROWS:
            return self._apply(call)
        with pdl.disabled():  # large chunks: no gain from it, and a few percent lost (moekit.hopper.pdl)
            return self._apply(call)

    def _apply(self, call: ExpertsCall) -> str:
        ws13 = carve(call.workspace13, call.shapes.workspace13)
        ws2 = carve(call.workspace2, call.shapes.workspace2)
        if call.problem.M == 0:
            return "triton"
        stream = launch_stream(call.hidden.device)
        cfg1, cfg2 = self.tile_configs(call.problem, call.hidden.dtype)
        # decode: one pair per block, no align launch (moekit.hopper.pair_blocks)
        pairs = call.topk_ids.numel() <= pair_blocks.PAIR_MAX and not (cfg1.persistent or cfg2.persistent)
        blocks1 = self._layout(call, cfg1.BLOCK_M, pairs=pairs, stream=stream)
        same = cfg2.BLOCK_M == cfg1.BLOCK_M
        blocks2 = blocks1 if same else self._layout(call, cfg2.BLOCK_M, pairs=pairs, stream=stream)
        self.gemms(call, ws13, ws2, (cfg1, cfg2), (blocks1, blocks2), (None, None))
        return "triton"

    def apply_rows(self, call: ExpertsCall) -> str:
        """The book's chunk of sorted rows (its steps run :meth:`gemms`, the wing's)."""
        if call.chunk.size <= pdl.MAX_ROWS:
            return super().apply_rows(call)
        with pdl.disabled():
            return super().apply_rows(call)

    def gemms(self, call: ExpertsCall, ws13, ws2, tiles: tuple, blocks: tuple, windows: tuple) -> None:
        """The book's GEMM1 -> activation -> GEMM2, launched lean on the current stream; with
        ``fuse_activation`` silu_and_mul (and the fp8 requantization) run in GEMM1's epilogue."""
        p, w = call.problem, call.weights
        R, H = call.shapes.workspace2[0], p.N // 2
        lean = dict(stream=launch_stream(call.hidden.device), check=False)  # the door checked the forward
        out1, gated = ws13, None
        if self.fuse_activation and call.hidden.dtype == FP8:
            # fp8 [R, H] values, then fp32 [R, H/128] scales, in workspace13's bf16 bytes
            act = carve(ws13, (R, H), dtype=FP8)
            act_scale = carve(ws13, (R, H // FP8_GROUP), dtype=torch.float32, offset=R * H // 2)
            static = call.a2_scale.reshape(-1).float() if call.a2_scale is not None else None
            div = p.topk if static is not None and static.numel() > 1 else 1  # a per-token scale
            out1 = carve(act, call.shapes.workspace13)
            gated = GatedOutput(out_scale=act_scale, static_scale=static, static_div=div)
        elif self.fuse_activation:
            act, act_scale, gated = carve(ws13, (R, H)), None, GatedOutput()
        args1 = dict(a_scale=call.hidden_scale, w_scale=w.w1_scale, gated=gated, chunk=windows[0], **lean)
        fused_moe_gemm(call.hidden, w.w1, out1, blocks[0], pairs_per_row=p.topk, config=tiles[0], **args1)
        if not self.fuse_activation:
            act, act_scale = self.activation(call, carve(ws13, (R, p.N)), ws2)  # the book's step
        args2 = dict(a_scale=act_scale, w_scale=w.w2_scale, chunk=windows[1], **lean)
        fused_moe_gemm(act, w.w2, call.output, blocks[1], pairs_per_row=1, config=tiles[1], **args2)

    def count_tokens(self, topk_ids: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
        """The book's count kernel, launched lean (:func:`moekit.hopper.launch.run_lean`)."""
        out, launch = count_launch(topk_ids, placement.num_local_experts, placement.expert_map)
        if launch is not None:
            run_lean(launch)
        return out

    def activation(self, call: ExpertsCall, x: torch.Tensor, ws2: torch.Tensor):
        """The book's activation step, launched lean."""
        act, scale, launch = self.activation_launch(call, x, ws2)
        if launch is not None:
            run_lean(launch)
        return act, scale

    @staticmethod
    def _layout(call: ExpertsCall, block_m: int, *, pairs: bool, stream) -> AlignedBlocks | PairBlocks:
        placement = call.placement
        args = (call.topk_ids, block_m, placement.global_num_experts, placement.expert_map)
        if pairs:
            return pair_blocks.pair_blocks(*args, num_local_experts=placement.num_local_experts, check=False)
        # keep_empty: empty slots get zero rows too, so every element of the output is written.
        return launch_align(*args, num_local_experts=placement.num_local_experts, keep_empty=True, stream=stream)
