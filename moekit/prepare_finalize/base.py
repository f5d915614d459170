"""The ``PrepareFinalize`` role: quantize (and dispatch) before the experts, combine after.

``prepare`` returns a :class:`~moekit.types.Prepared`: the activations the experts read, their
scales, optional tokens-per-expert metadata, the ids and weights that go with the rows, and a
handle for ``finalize``. ``finalize`` turns the experts' unweighted output back into ``[M, K]``
for the caller's M tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from moekit.types import ActivationFormat, ExpertPlacement, Prepared, QuantScheme


class PrepareFinalize(ABC):
    """Base class of every prepare/finalize stage."""

    activation_format: ClassVar[ActivationFormat] = ActivationFormat.STANDARD
    # True for stages whose prepare/finalize are collectives (an all-to-all): every rank must
    # call them, even a rank with M=0, or the others hang.
    collective: ClassVar[bool] = False
    # True when the experts see other rows than the caller's tokens (rows received from other
    # ranks, or per-expert slabs): per-token values such as a per-token a2_scale cannot follow.
    dispatches: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return type(self).__name__

    @abstractmethod
    def prepare(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        quant: QuantScheme,
        placement: ExpertPlacement,
    ) -> Prepared:
        """Quantize as ``quant`` asks (and dispatch); return what the experts consume."""

    @abstractmethod
    def finalize(self, fused_out: torch.Tensor, prepared: Prepared, *, output: torch.Tensor) -> torch.Tensor:
        """Weight by topk_weights and reduce over topk into ``output [M, K]``; return it."""

    def refuse(self, error: Exception) -> None:
        """Called by the modular kernel when its door rejects this rank's inputs (with ``error``,
        which it raises next); a collective stage tells its peers so that they raise too, within
        its timeout. The default does nothing. It must not raise: the caller's error comes first."""
        return None

    def __repr__(self) -> str:
        return f"{self.name}()"


def quantize_activations(x: torch.Tensor, quant: QuantScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(a1q, a1q_scale)`` for ``quant``: fp8 with 1x128 row-major group scales, or ``x`` as is."""
    if quant is QuantScheme.FP8_BLOCK:
        from moekit.kernels.quant import quantize_fp8_group

        return quantize_fp8_group(x)
    return x, None


def weight_and_reduce(fused_out: torch.Tensor, topk_weights: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``output[m] = sum_j topk_weights[m, j] * fused_out[m, j]`` (one Triton pass, fp32 accumulation).

    The arguments were checked at the modular kernel's door; ``output`` is a fresh ``[M, K]`` tensor.
    """
    from moekit.kernels.reduce import launch_weighted_topk_sum

    return launch_weighted_topk_sum(fused_out.contiguous(), topk_weights.contiguous(), output)
