"""The ``Experts`` role: permute -> GEMM1 -> silu_and_mul -> GEMM2 -> unpermute, for one chunk.

An experts class declares, for a problem size, the workspaces it needs
(:meth:`Experts.workspace_shapes`) and then computes into them (:meth:`Experts.apply`). It knows
nothing of chunking: the modular kernel calls it once per chunk with that chunk's M.

Contract:

- :meth:`Experts.check` runs once per forward, at the modular kernel's door, before anything is
  written: it raises a named error for whatever this class cannot run (shapes, quantization,
  scales). ``apply`` then trusts its call.
- ``call.workspace13``/``call.workspace2`` are flat buffers at least as large as the shapes in
  ``call.shapes``; ``apply`` carves its caches out of their first elements with :func:`carve`
  (upstream's ``_resize_cache``). A smaller buffer fails there, with WorkspaceShapeError.
- ``call.output`` is the chunk's slice of the whole-batch output; ``apply`` writes every element
  of it (rows of non-local experts get zeros), unweighted and unreduced. Batched-format experts
  are the exception: rows past ``expert_num_tokens[e]`` are padding that finalize never reads,
  and may stay unwritten.
- ``apply`` returns the name of the backend that actually ran (for the trace).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from moekit.errors import InvalidInputError, QuantizationError, WorkspaceShapeError
from moekit.quant import FP8
from moekit.types import (
    ActivationFormat,
    ExpertPlacement,
    ExpertsCall,
    ExpertTokensMetadata,
    MoEWeights,
    ProblemSize,
    QuantScheme,
    WorkspaceShapes,
)


class Experts(ABC):
    """Base class of every experts implementation.

    Class attributes say what the modular kernel may ask: ``supports_chunking`` (the token
    dimension may be split), ``supports_row_chunks`` (chunks of expert-sorted rows:
    :meth:`row_workspace_shapes` and :meth:`apply_rows`), ``supports_expert_map`` (expert
    parallelism), ``uses_tokens_meta`` (``apply`` reads the tokens per expert,
    :meth:`ExpertsCall.tokens_per_expert`, so stale ones change its result; the modular kernel
    counts every chunk for it).
    """

    activation_format: ClassVar[ActivationFormat] = ActivationFormat.STANDARD
    supports_chunking: ClassVar[bool] = True
    supports_row_chunks: ClassVar[bool] = False
    supports_expert_map: ClassVar[bool] = True
    uses_tokens_meta: ClassVar[bool] = False
    # the activation dtypes apply computes in (checked at the modular kernel's door, by name)
    act_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)

    def __init__(self, *, quant: QuantScheme = QuantScheme.NONE):
        if not isinstance(quant, QuantScheme):
            raise InvalidInputError(f"quant must be a moekit.QuantScheme, got {quant!r}")
        self.quant = quant

    @property
    def name(self) -> str:
        return type(self).__name__

    def compute_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        """The dtype of workspaces and outputs: the activation dtype, or bf16 behind fp8."""
        return torch.bfloat16 if act_dtype == FP8 else act_dtype

    def backend_for(self, problem: ProblemSize) -> str:
        """The backend ``apply`` will run for this problem (used by the trace before the call)."""
        return "triton"

    def why(self, problem: ProblemSize) -> str:
        """Why this problem ran the backend it ran, when that was a fallback (for the trace); else ""."""
        return ""

    def check(self, problem: ProblemSize, weights: MoEWeights, *, a2_scale: torch.Tensor | None = None) -> None:
        """Raise a named error unless this class can run ``problem`` (the whole batch's M).

        The base checks the weights against ``self.quant`` and the a2 scale (per tensor, or one
        per token, and only behind fp8); every scale given must be a tensor on the weights' device.
        Subclasses add their own shape rules.
        """
        if a2_scale is not None and self.quant is not QuantScheme.FP8_BLOCK:
            raise QuantizationError(
                f"a2_scale requantizes the intermediate activations to fp8; {self.name} is unquantized "
                "(quant=QuantScheme.NONE)"
            )
        check_scale_tensors(weights, a2_scale)
        weights.check(self.quant)
        if a2_scale is None:
            return
        if not isinstance(a2_scale, torch.Tensor) or not a2_scale.is_floating_point():
            raise QuantizationError(f"a2_scale must be a float tensor, got {type(a2_scale).__name__}")
        shape = tuple(a2_scale.shape)
        per_token = shape in ((problem.M,), (problem.M, 1))  # M = 0: no token, no scale
        if a2_scale.numel() != 1 and not per_token:
            raise QuantizationError(
                f"a2_scale must hold 1 scale (per tensor) or one per token, [M={problem.M}] or [M, 1], got {shape}"
            )

    def count_tokens(self, topk_ids: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
        """int32 ``[E_local]``: a chunk's rows per local expert, with ``count_expert_num_tokens``'s
        kernel (the modular kernel asks once per chunk; bug 2's fix). A subclass may launch the same
        kernel differently (the Hopper wing launches it without Triton's per-call binding)."""
        from moekit.kernels.count import launch_count  # on first use: `import moekit` loads no kernel module

        return launch_count(topk_ids, placement.num_local_experts, placement.expert_map)

    @abstractmethod
    def workspace_shapes(
        self, problem: ProblemSize, *, act_dtype: torch.dtype, tokens_meta: ExpertTokensMetadata | None = None
    ) -> WorkspaceShapes:
        """Declare workspace13, workspace2 and the output for ``problem`` (this chunk's M)."""

    @abstractmethod
    def apply(self, call: ExpertsCall) -> str:
        """Compute a chunk of tokens (or the slabs) into ``call.output``; return the backend that ran."""

    def row_workspace_shapes(self, rows: int, problem: ProblemSize, *, act_dtype: torch.dtype) -> WorkspaceShapes:
        """Declare the workspaces for a chunk of ``rows`` expert-sorted rows of the batch ``problem``
        (:meth:`apply_rows`); the output is the whole batch's ``[M, topk, K]``."""
        raise InvalidInputError(f"{self.name} does not support chunks of sorted rows (chunk_by='rows')")

    def apply_rows(self, call: ExpertsCall) -> str:
        """Compute the sorted rows of ``call.chunk`` (a ``RowChunk``) into the pairs' rows of
        ``call.output``; return the backend that ran."""
        raise InvalidInputError(f"{self.name} does not support chunks of sorted rows (chunk_by='rows')")

    def __repr__(self) -> str:
        return f"{self.name}(quant={self.quant.value})"


def check_scale_tensors(weights: MoEWeights, a2_scale: torch.Tensor | None = None) -> None:
    """Each scale given (``w1_scale``, ``w2_scale``, ``a2_scale``) is a tensor on ``w1``'s device,
    checked before anything reads its shape or values.

    Raises:
        QuantizationError: a scale that is not a tensor (a list, say).
        InvalidInputError: a scale on another device than the weights (another GPU, the CPU, meta).
    """
    w1 = weights.w1
    for name, scale in (("w1_scale", weights.w1_scale), ("w2_scale", weights.w2_scale), ("a2_scale", a2_scale)):
        if scale is None:
            continue
        if not isinstance(scale, torch.Tensor):
            raise QuantizationError(f"{name} must be a float tensor, got {type(scale).__name__}")
        if scale.get_device() != w1.get_device() or scale.is_meta != w1.is_meta:  # -1 on the CPU and meta
            raise InvalidInputError(f"{name} must be on the weights' device ({w1.device}), got {scale.device}")


def carve(
    buffer: torch.Tensor, shape: tuple[int, ...], *, dtype: torch.dtype | None = None, offset: int = 0
) -> torch.Tensor:
    """A contiguous ``shape`` view over the first elements of ``buffer`` (upstream's ``_resize_cache``).

    ``dtype`` reinterprets the bytes (for example fp8 requantized activations inside a bf16
    workspace); ``offset`` skips that many of ``buffer``'s own elements first. Any buffer with
    enough elements fits, whatever shape it was declared with: that
    is why, before PR #20392, a smaller Triton chunk could run in DeepGEMM's larger buffers.
    The view is remembered on ``buffer`` (a torch view costs microseconds of host time, and the
    pool hands out the same buffers again), so carving the same shape again returns it.

    Raises:
        WorkspaceShapeError: the buffer holds fewer elements than ``shape`` needs.
    """
    memo = getattr(buffer, "_moekit_carved", None)
    key = (shape, dtype, offset)
    if memo is not None and type(shape) is tuple and key in memo:
        return memo[key]
    flat = buffer.reshape(-1)[offset:]
    if dtype is not None and dtype != flat.dtype:
        flat = flat.view(torch.uint8).view(dtype) if flat.numel() else flat.new_empty(0, dtype=dtype)
    need = math.prod(shape)
    if need > flat.numel():
        raise WorkspaceShapeError(
            f"workspace holds {flat.numel()} {flat.dtype} elements, {need} needed for {tuple(shape)}"
        )
    view = flat[:need].view(shape)
    if type(shape) is tuple:
        if memo is None or len(memo) > 32:
            memo = buffer._moekit_carved = {}
        memo[key] = view
    return view
