"""``TritonExperts``: align -> grouped GEMM1 -> silu_and_mul -> grouped GEMM2 (Standard format).

Shapes (M tokens in this chunk, topk slots, K hidden, N = w1 rows = 2 x intermediate)::

    hidden       [M, K]           bf16/fp16/fp32, or fp8 with hidden_scale [M, K/128]
    workspace13  [M, topk, N]     GEMM1 output, one row per (token, slot) pair
    workspace2   [M * topk, N/2]  silu_and_mul output; with fp8, its bytes hold the fp8
                                  requantization [M*topk, N/2] and its scales [M*topk, N/256]
    output       [M, topk, K]     GEMM2 output, unweighted; rows of remote experts and empty
                                  slots are zeros

No tensor is permuted: both GEMMs gather their rows through ``sorted_token_ids`` and scatter
their results back to the pair's own row.

With ``fuse_activation=True`` GEMM1 applies silu_and_mul (and the fp8 requantization) in its
epilogue: workspace13 becomes ``[M, topk, N/2]`` (the activation, or its fp8 bytes and scales)
and workspace2 is empty. One launch and one ``[M*topk, N]`` round trip through memory fewer.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moekit.errors import InvalidInputError, QuantizationError
from moekit.experts.base import Experts, carve, view_workspace
from moekit.kernels.activation import silu_and_mul, silu_and_mul_fp8_group
from moekit.kernels.align import moe_align_block_size
from moekit.kernels.configs import KernelConfig, get_config
from moekit.kernels.fused_moe import GatedOutput, fused_moe_gemm
from moekit.types import ActivationFormat, ExpertsCall, ExpertTokensMetadata, ProblemSize, QuantScheme, WorkspaceShapes
from moekit.validate import check_ids

FP8 = torch.float8_e4m3fn
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class TritonExperts(Experts):
    """Triton grouped GEMMs over expert-aligned blocks, for any M (Standard format).

    Args:
        quant: ``QuantScheme.NONE`` (bf16/fp16/fp32) or ``QuantScheme.FP8_BLOCK`` (fp8 e4m3
            weights with 128x128 block scales, activations with 1x128 group scales).
        configs: force ``(gemm1, gemm2)`` tile configs for every M (benchmarks); by default
            they come from :func:`moekit.kernels.configs.get_config`.
        fuse_activation: run silu_and_mul (and the fp8 requantization) inside GEMM1's epilogue
            instead of as a separate kernel (see the module docstring). Off by default: the
            separate steps are the upstream pipeline that the notebooks take apart.
    """

    activation_format = ActivationFormat.STANDARD
    supports_chunking = True
    supports_expert_map = True

    def __init__(
        self,
        *,
        quant: QuantScheme = QuantScheme.NONE,
        configs: tuple[KernelConfig, KernelConfig] | None = None,
        fuse_activation: bool = False,
    ):
        super().__init__(quant=quant)
        self.fuse_activation = bool(fuse_activation)
        pair = isinstance(configs, tuple | list) and len(configs) == 2
        if configs is not None and not (pair and all(isinstance(c, KernelConfig) for c in configs)):
            raise InvalidInputError(f"configs must be (KernelConfig, KernelConfig) or None, got {configs!r}")
        self.configs = configs

    def __repr__(self) -> str:
        return f"{self.name}(quant={self.quant.value}, fuse_activation={self.fuse_activation})"

    def workspace_shapes(
        self,
        problem: ProblemSize,
        *,
        act_dtype: torch.dtype,
        tokens_meta: ExpertTokensMetadata | None = None,
    ) -> WorkspaceShapes:
        """``(M, topk, N)``, ``(M * topk, N/2)`` and output ``(M, topk, K)`` in the compute dtype
        (fused activation: ``(M, topk, N/2)`` and ``(M * topk, 0)``)."""
        M, N, K, topk = problem.M, problem.N, problem.K, problem.topk
        dtype = self.compute_dtype(act_dtype)
        if self.fuse_activation:
            return WorkspaceShapes((M, topk, N // 2), (M * topk, 0), (M, topk, K), dtype)
        return WorkspaceShapes((M, topk, N), (M * topk, N // 2), (M, topk, K), dtype)

    def _validate(self, call: ExpertsCall) -> bool:
        h = call.hidden
        if not isinstance(h, torch.Tensor):
            raise InvalidInputError(f"hidden must be a torch.Tensor, got {type(h).__name__}")
        if h.dim() != 2 or not h.is_contiguous():
            got = f"{h.dtype} {tuple(h.shape)} strides {h.stride()}"
            raise InvalidInputError(f"hidden must be a contiguous 2-D [M, K] tensor, got {got}")
        check_ids(call.topk_ids)
        if call.topk_ids.shape[0] != h.shape[0]:
            raise InvalidInputError(f"topk_ids must have M={h.shape[0]} rows, got {tuple(call.topk_ids.shape)}")
        call.weights.check(self.quant)
        fp8 = self.quant is QuantScheme.FP8_BLOCK
        if not fp8:
            if h.dtype not in _FLOATS:
                raise (QuantizationError if h.dtype == FP8 else InvalidInputError)(
                    f"unquantized TritonExperts need bf16/fp16/fp32 hidden, got {h.dtype}"
                    + ("; build them with quant=QuantScheme.FP8_BLOCK" if h.dtype == FP8 else "")
                )
            if call.weights.w1.dtype != h.dtype:
                raise InvalidInputError(f"hidden is {h.dtype} but the weights are {call.weights.w1.dtype}")
            if call.a2_scale is not None:
                raise QuantizationError("a2_scale requantizes the intermediate to fp8; these experts are unquantized")
            return False
        M, K = h.shape
        N = call.weights.w1.shape[1]
        if h.dtype != FP8:
            raise QuantizationError(
                f"fp8 block experts need float8_e4m3fn hidden (quantized by prepare), got {h.dtype}"
            )
        if K % 128 or N % 256:
            raise QuantizationError(f"fp8 block needs K and N/2 to be multiples of 128, got K={K}, N={N}")
        s = call.hidden_scale
        if s is None or tuple(s.shape) != (M, K // 128) or s.dtype != torch.float32:
            got = "None" if s is None else f"{s.dtype} {tuple(s.shape)}"
            raise QuantizationError(f"fp8 block needs hidden_scale float32 [M, K/128] = {(M, K // 128)}, got {got}")
        a2 = call.a2_scale
        if a2 is not None and (a2.numel() not in (1, M) or not a2.is_floating_point()):
            raise QuantizationError(
                f"a2_scale must hold 1 (per tensor) or M={M} (per token) scales, got {tuple(a2.shape)}"
            )
        return True

    def _configs(self, M: int, N: int, K: int, E: int, topk: int, dtype) -> tuple[KernelConfig, KernelConfig]:
        if self.configs is not None:
            cfg1, cfg2 = self.configs
        else:
            cfg1 = get_config(M, N, K, E, topk, dtype, stage=1, gated=self.fuse_activation)
            cfg2 = get_config(M, K, N // 2, E, topk, dtype, stage=2)
        if self.fuse_activation and dtype == FP8:  # one program per 128-wide scale group
            cfg1 = replace(cfg1, BLOCK_N=128)
        return cfg1, cfg2

    def apply(self, call: ExpertsCall) -> str:
        """Compute one chunk into ``call.output``; returns ``"triton"``."""
        fp8 = self._validate(call)
        w = call.weights
        (M, K), (E_local, N, _), topk = call.hidden.shape, w.w1.shape, call.topk_ids.shape[1]
        problem = ProblemSize(M, N, K, topk, call.global_num_experts, E_local)
        shapes = self.workspace_shapes(problem, act_dtype=call.hidden.dtype)
        # Strict views first: buffers declared for another backend or M fail here (as upstream).
        ws13 = view_workspace(call.workspace13, shapes.workspace13)
        ws2 = view_workspace(call.workspace2, shapes.workspace2)
        out = view_workspace(call.output, shapes.output)
        if M == 0:
            return "triton"
        R = M * topk
        cfg1, cfg2 = self._configs(M, N, K, call.global_num_experts, topk, call.hidden.dtype)

        def align(block_m: int):
            # keep_empty: empty slots get zero rows too, so every element of the output is written.
            return moe_align_block_size(
                call.topk_ids, block_m, call.global_num_experts, call.expert_map,
                num_local_experts=E_local, keep_empty=True,
            )  # fmt: skip

        blocks1 = align(cfg1.BLOCK_M)
        blocks2 = blocks1 if cfg2.BLOCK_M == cfg1.BLOCK_M else align(cfg2.BLOCK_M)
        static = None
        if fp8 and call.a2_scale is not None:  # per tensor, or per token (shared by its topk rows)
            static = call.a2_scale.reshape(-1).float()
        if self.fuse_activation:
            self._fused(call, ws13, out.view(R, K), blocks1, blocks2, cfg1, cfg2, static)
            return "triton"
        h1 = ws13.view(R, N)
        fused_moe_gemm(
            call.hidden, w.w1, h1, blocks1, pairs_per_row=topk, config=cfg1,
            a_scale=call.hidden_scale, w_scale=w.w1_scale,
        )  # fmt: skip
        if not fp8:
            act = silu_and_mul(h1, out=ws2)
            fused_moe_gemm(act, w.w2, out.view(R, K), blocks2, pairs_per_row=1, config=cfg2)
            return "triton"
        # fp8: activation and requantization in one pass, written into workspace2's bytes
        # (the fp8 values, then their fp32 scales); GEMM1's output in workspace13 is read once.
        q, scale = _fp8_views(ws2, R, N // 2)
        if static is not None and static.numel() > 1:
            static = static.repeat_interleave(topk)
        silu_and_mul_fp8_group(h1, out_q=q, out_scale=scale, static_scale=static)
        fused_moe_gemm(
            q, w.w2, out.view(R, K), blocks2, pairs_per_row=1, config=cfg2, a_scale=scale, w_scale=w.w2_scale
        )
        return "triton"

    def _fused(self, call, ws13, out, blocks1, blocks2, cfg1, cfg2, static) -> None:
        """GEMM1 with silu_and_mul (and fp8 requantization) in its epilogue, then GEMM2."""
        w, topk = call.weights, call.topk_ids.shape[1]
        R, H = out.shape[0], w.w1.shape[1] // 2
        if call.hidden.dtype != FP8:
            act = ws13.view(R, H)
            fused_moe_gemm(call.hidden, w.w1, act, blocks1, pairs_per_row=topk, config=cfg1, gated=GatedOutput())
            fused_moe_gemm(act, w.w2, out, blocks2, pairs_per_row=1, config=cfg2)
            return
        q, scale = _fp8_views(ws13, R, H)
        div = topk if static is not None and static.numel() > 1 else 1
        fused_moe_gemm(
            call.hidden, w.w1, q, blocks1, pairs_per_row=topk, config=cfg1,
            a_scale=call.hidden_scale, w_scale=w.w1_scale,
            gated=GatedOutput(out_scale=scale, static_scale=static, static_div=div),
        )  # fmt: skip
        fused_moe_gemm(q, w.w2, out, blocks2, pairs_per_row=1, config=cfg2, a_scale=scale, w_scale=w.w2_scale)


def _fp8_views(buffer: torch.Tensor, R: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``[R, H]`` values, then fp32 ``[R, H/128]`` scales, carved from a bf16 buffer's bytes."""
    q = carve(buffer, (R, H), dtype=FP8)
    scale = carve(buffer.reshape(-1)[R * H // 2 :], (R, H // 128), dtype=torch.float32)
    return q, scale
