"""The ``Experts`` role: permute -> GEMM1 -> silu_and_mul -> GEMM2 -> unpermute, for one chunk.

An experts class declares, for a problem size, the workspaces it needs
(:meth:`Experts.workspace_shapes`) and then computes into them (:meth:`Experts.apply`). It knows
nothing of chunking: the modular kernel calls it once per chunk with that chunk's M.

Contract of ``apply``:
- ``call.workspace13``/``call.workspace2`` arrive with exactly the shapes that
  ``workspace_shapes`` declared for this call's M; ``apply`` views them to those shapes and
  carves its buffers out of them (so a buffer of the wrong shape fails loudly, as it did
  upstream before PR #20392).
- ``call.output`` has exactly the declared output shape; ``apply`` writes every element of it
  (rows of non-local experts get zeros) and writes the result unweighted and unreduced.
  Batched-format experts are the exception: rows past ``expert_num_tokens[e]`` are padding
  that finalize never reads, and may stay unwritten.
- ``apply`` returns the name of the backend that actually ran (for the trace).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from moekit.errors import InvalidInputError, WorkspaceShapeError
from moekit.types import (
    ActivationFormat,
    ExpertsCall,
    ExpertTokensMetadata,
    ProblemSize,
    QuantScheme,
    WorkspaceShapes,
)


class Experts(ABC):
    """Base class of every experts implementation."""

    activation_format: ClassVar[ActivationFormat] = ActivationFormat.STANDARD
    supports_chunking: ClassVar[bool] = True
    supports_expert_map: ClassVar[bool] = True
    uses_tokens_meta: ClassVar[bool] = False

    def __init__(self, *, quant: QuantScheme = QuantScheme.NONE):
        if not isinstance(quant, QuantScheme):
            raise InvalidInputError(f"quant must be a moekit.QuantScheme, got {quant!r}")
        self.quant = quant

    @property
    def name(self) -> str:
        return type(self).__name__

    def compute_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        """The dtype of workspaces and outputs: the activation dtype, or bf16 behind fp8."""
        return torch.bfloat16 if act_dtype == torch.float8_e4m3fn else act_dtype

    def backend_for(self, problem: ProblemSize) -> str:
        """The backend ``apply`` will run for this problem (used by the trace before the call)."""
        return "triton"

    @abstractmethod
    def workspace_shapes(
        self,
        problem: ProblemSize,
        *,
        act_dtype: torch.dtype,
        tokens_meta: ExpertTokensMetadata | None = None,
    ) -> WorkspaceShapes:
        """Declare workspace13, workspace2 and the output for ``problem`` (this chunk's M)."""

    @abstractmethod
    def apply(self, call: ExpertsCall) -> str:
        """Compute the chunk into ``call.output``; return the backend that ran."""

    def __repr__(self) -> str:
        return f"{self.name}(quant={self.quant.value})"


def view_workspace(buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """View a handed-over workspace as ``shape``.

    Deliberately strict, like the upstream code it teaches: a buffer declared for another
    backend or another M fails here with torch's own error (what users met before the fix).
    """
    return buffer.view(shape)


def carve(buffer: torch.Tensor, shape: tuple[int, ...], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous ``shape`` view over the first bytes of ``buffer`` (a scratch region).

    ``dtype`` reinterprets the bytes (for example fp8 requantized activations inside a bf16
    workspace). Raises WorkspaceShapeError when the buffer is too small.
    """
    flat = buffer.reshape(-1)
    if dtype is not None and dtype != flat.dtype:
        flat = flat.view(torch.uint8).view(dtype) if flat.numel() else flat.new_empty(0, dtype=dtype)
    need = math.prod(shape)
    if need > flat.numel():
        raise WorkspaceShapeError(f"workspace holds {flat.numel()} elements, {need} needed for {shape}")
    return flat[:need].view(shape)
