"""``BatchedPrepareFinalize``: one process, Batched format. Gather tokens into per-expert slabs.

Shapes (M tokens, K hidden, E local experts, T = min(max_tokens, M * topk): no slab is taller
than the pairs that came, whatever max_tokens allows)::

    prepare:   hidden [M, K], topk_ids [M, topk]  ->  a1q [E, T, K], counts int32 [E]
               a1q[e, :counts[e]] are the tokens that chose local expert e, in token order;
               rows past counts[e] are zero padding.
    finalize:  fused_out [E, T, K]  ->  output [M, K]
               output[m] = sum over the slab rows (e, r) holding token m of
                           topk_weights[m, slot(e, r)] * fused_out[e, r]

Example (E=2, topk=2, no expert map)::

    topk_ids = [[0, 1],      a1q[0] = [x0, x2, pad, ...]   counts = [2, 2]
                [1, 2],      a1q[1] = [x0, x1, pad, ...]   (expert 2 is not local: skipped)
                [0, 2]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import CapacityError, InvalidInputError
from moekit.prepare_finalize.base import PrepareFinalize, quantize_activations
from moekit.reference import local_expert_ids
from moekit.types import ActivationFormat, ExpertPlacement, ExpertTokensMetadata, Prepared, QuantScheme
from moekit.validate import check_positive_int


@dataclass
class BatchedHandle:
    """Where every filled slab row came from: what ``finalize`` needs to combine.

    All four are int64 ``[R]`` for the R (token, slot) pairs routed to a local expert, sorted by
    expert then token: row ``rank[i]`` of slab ``expert[i]`` holds token ``token[i]``, which
    chose that expert in its slot ``slot[i]``.
    """

    expert: torch.Tensor
    rank: torch.Tensor
    token: torch.Tensor
    slot: torch.Tensor


class BatchedPrepareFinalize(PrepareFinalize):
    """Gather each local expert's tokens into a slab of ``max_tokens`` rows; combine after.

    The expert map (global -> local id) is applied here, so the batched experts after it only
    ever see local slabs. ``tokens_meta.expert_num_tokens`` is sized by the *local* expert count
    (upstream sized it by the global count and used the first E_local entries).

    Args:
        max_tokens: the most tokens one expert may receive. An expert chosen by more tokens
            than this raises :class:`~moekit.errors.CapacityError` before anything is written.
            Slabs hold ``T = min(max_tokens, M * topk)`` rows, so a large bound costs no memory.

    Raises:
        InvalidInputError: ``max_tokens`` is not a positive int.
    """

    activation_format = ActivationFormat.BATCHED
    dispatches = True

    def __init__(self, *, max_tokens: int):
        self.max_tokens = check_positive_int(max_tokens, "max_tokens")

    def prepare(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        quant: QuantScheme,
        placement: ExpertPlacement,
    ) -> Prepared:
        """Slabs ``a1q [E_local, T, K]`` (fp8 with ``[E_local, T, K/128]``
        scales for ``QuantScheme.FP8_BLOCK``) and tokens per local expert.

        Raises:
            CapacityError: a local expert received more than ``max_tokens`` tokens.
        """
        M, K = hidden.shape  # [M, K] and [M, topk]: checked at the modular kernel's door
        topk = topk_ids.shape[1]
        E, T = placement.num_local_experts, min(self.max_tokens, M * topk)  # slabs no taller than the pairs
        device = hidden.device

        # Sort the (token, slot) pairs by local expert; a stable sort keeps token order inside
        # each expert, so a pair's rank within its expert is its row in the slab.
        local = local_expert_ids(topk_ids, E, placement.expert_map).reshape(-1)  # [M * topk], -1: not local
        pair = torch.nonzero(local >= 0).reshape(-1)  # flat index m * topk + j, ascending
        expert, order = torch.sort(local[pair], stable=True)
        pair = pair[order]
        counts = torch.bincount(expert, minlength=E)  # [E] int64
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(pair.numel(), device=device) - starts[expert]
        self._check_capacity(counts, placement)

        x, x_scale = quantize_activations(hidden, quant)  # per row, so once per token
        token, slot = pair // topk, pair % topk
        a1q = torch.zeros((E, T, K), dtype=x.dtype, device=device)
        a1q.view(torch.uint8)[expert, rank] = x[token].view(torch.uint8)  # through the bytes: CPU index_put lacks fp8
        a1q_scale = None
        if x_scale is not None:
            a1q_scale = torch.zeros((E, T, x_scale.shape[1]), dtype=x_scale.dtype, device=device)
            a1q_scale[expert, rank] = x_scale[token]
        meta = ExpertTokensMetadata(counts.to(torch.int32), None)
        handle = BatchedHandle(expert, rank, token, slot)
        return Prepared(a1q, a1q_scale, meta, topk_ids, topk_weights, handle)

    def _check_capacity(self, counts: torch.Tensor, placement: ExpertPlacement) -> None:
        worst = int(counts.max()) if counts.numel() else 0  # one host sync
        if worst <= self.max_tokens:
            return
        over = torch.nonzero(counts > self.max_tokens).reshape(-1).tolist()
        e = over[0]
        name = f"local expert {e}"
        if placement.expert_map is not None:
            glob = torch.nonzero(placement.expert_map.cpu() == e).reshape(-1).tolist()
            name += f" (global {glob[0]})" if glob else ""
        more = f"; {len(over) - 1} more expert(s) also overflow" if len(over) > 1 else ""
        raise CapacityError(
            f"{name} received {int(counts[e])} tokens but max_tokens={self.max_tokens}{more}. "
            f"Expected at most max_tokens tokens per expert; build BatchedPrepareFinalize with "
            f"max_tokens >= {worst} (M * topk is always enough)."
        )

    def finalize(self, fused_out: torch.Tensor, prepared: Prepared, *, output: torch.Tensor) -> torch.Tensor:
        """``output[m] = sum of topk_weights[m, slot] * fused_out[e, row]`` over m's slab rows.

        Rows past ``expert_num_tokens`` are never read. Accumulates in fp32; tokens that chose
        no local expert get zeros.
        """
        h = prepared.handle
        if not isinstance(h, BatchedHandle):
            raise InvalidInputError(
                f"expected a Prepared from BatchedPrepareFinalize.prepare, got handle {type(h).__name__}"
            )
        M, K = output.shape
        if fused_out.dim() != 3 or fused_out.shape[2] != K:
            raise InvalidInputError(f"expected fused_out [E_local, max_tokens, K={K}], got {tuple(fused_out.shape)}")
        rows = fused_out[h.expert, h.rank].float()  # [R, K]
        w = prepared.topk_weights[h.token, h.slot].float()  # [R]
        acc = torch.zeros((M, K), dtype=torch.float32, device=output.device)
        acc.index_add_(0, h.token, rows * w[:, None])
        return output.copy_(acc)

    def __repr__(self) -> str:
        return f"BatchedPrepareFinalize(max_tokens={self.max_tokens})"
