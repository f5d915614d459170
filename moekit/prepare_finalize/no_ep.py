"""``NoEPPrepareFinalize``: one process, Standard format. Quantize before, weight and sum after."""

from __future__ import annotations

import torch

from moekit.prepare_finalize.base import PrepareFinalize, quantize_activations, weight_and_reduce
from moekit.types import ActivationFormat, ExpertPlacement, ExpertTokensMetadata, Prepared, QuantScheme
from moekit.validate import check_flag


class NoEPPrepareFinalize(PrepareFinalize):
    """No dispatch: the rows the experts see are the caller's tokens.

    Args:
        return_counts: also return ``ExpertTokensMetadata`` (device and CPU counts of tokens per
            local expert), as a DeepEP-style all-to-all would. Off by default, as upstream; on,
            it lets one process show how chunking must recount them (bug 2 of PR #20392).

    Raises:
        InvalidInputError: ``return_counts`` is not a bool (``"no"`` would switch it on).
    """

    activation_format = ActivationFormat.STANDARD

    def __init__(self, *, return_counts: bool = False):
        self.return_counts = check_flag(return_counts, "return_counts")

    def prepare(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        quant: QuantScheme,
        placement: ExpertPlacement,
    ) -> Prepared:
        a1q, a1q_scale = quantize_activations(hidden, quant)
        meta = None
        if self.return_counts:
            from moekit.kernels.count import count_expert_num_tokens

            counts = count_expert_num_tokens(topk_ids, placement.num_local_experts, placement.expert_map)
            meta = ExpertTokensMetadata.from_counts(counts, with_cpu=True)
        return Prepared(a1q, a1q_scale, meta, topk_ids, topk_weights)

    def finalize(self, fused_out: torch.Tensor, prepared: Prepared, *, output: torch.Tensor) -> torch.Tensor:
        return weight_and_reduce(fused_out, prepared.topk_weights, output)

    def __repr__(self) -> str:
        return f"{self.name}(return_counts={self.return_counts})"
