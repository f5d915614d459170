"""The sync-free dispatch of ``All2AllPrepareFinalize(mode="capacity", max_tokens_per_rank=C)``.

Every rank sends every other rank a fixed block of C token rows, so no split size has to reach
the host before the exchange, and prepare -> experts -> finalize can be captured in one CUDA
graph::

    prepare (rank r, M <= C tokens)
      owner[m, j] = rank owning topk_ids[m, j] (-1: empty slot)
      for each destination d: the tokens with a slot on d, in token order, at rows 0.. of block d
          (a token goes once to each rank it needs, not once per slot)
      send rows [W, C, K], their int32 ids [W, C, topk] (slots on d, else -1), the router weights
          of those slots [W, C, topk], and a flag row (this rank's M > C, bad ids, refused)
      all_to_all x 4 (equal splits)  ->  R = W * C rows for this rank's experts
    experts: unweighted [R, topk, K] (zeros for slots that are not this rank's, and empty rows)
    finalize
      partial[row] = sum_j weight[row, j] * out[row, j]   (fp32, on the expert's rank)
      all_to_all(partial) back; output[m] = sum_d partial from d, in rank order (deterministic)

Compared with ``mode="exact"`` (sizes first, then exactly the rows): no host sync and one row
per (token, rank) instead of one per (token, slot), but every rank computes W * C rows' worth of
ids and moves W * C rows whatever M is; exact wins when M is far below C, or for one-off calls.

Errors that cannot be seen without a sync (another rank's M beyond C, its ids beyond E, its map's
entries out of range) travel as flags with the data, and so does each rank's word on whether its
expert map still holds the values the ranks agreed on (compared on the device with the agreement's
own copy). ``check="sync"`` (the default) reads the flags once, after the exchange and before the
experts run, and raises CapacityError / InvalidIdsError on every rank, nothing written to the
caller's tensors; a changed map makes every rank agree again and send again, in the same call.
``check="deferred"`` reads nothing, so the step can be captured, and
:meth:`All2AllPrepareFinalize.raise_if_failed` raises afterwards (a changed map included: the next
call agrees again). A rank whose own M is beyond C knows it on the host: it still joins every
collective (sending its first C tokens) and raises CapacityError in finalize, without writing the
output. A rank whose inputs the modular
kernel's door rejected after the first call sends empty blocks flagged "refused"
(:func:`refused_blocks`), so that the peers raise its error class instead of waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import CapacityError, InvalidIdsError
from moekit.prepare_finalize.agreement import WIRE_IDS, refusal_error
from moekit.types import QuantScheme

# Columns of the flag rows: REFUSED holds a refusal code, CHANGED says the sender's map is not the
# agreed one, BAD_MAP counts its entries that are neither -1 nor a local id.
OVERFLOW, BAD_IDS, REFUSED, CHANGED, BAD_MAP = 0, 1, 2, 3, 4
FLAGS = 5


@dataclass(frozen=True)
class Layer:
    """What one agreement covered: while a call's layer equals the last agreed one, nothing is exchanged
    but the blocks (and a refusing rank can build blocks of the size its peers expect)."""

    dtype: torch.dtype
    K: int
    E: int
    E_local: int
    topk: int
    quant: QuantScheme
    C: int
    check: str


@dataclass
class CapacityHandle:
    """What finalize needs: where each token sits in each destination's block, and the flags."""

    slot: torch.Tensor  # int64 [W, M]: row of token m in block d, or C (not sent there)
    M: int
    C: int
    flags: torch.Tensor  # int64 [W, FLAGS] received: each source's row (the columns above)
    recv_ids: torch.Tensor  # [W * C, topk] received global ids (-1: not here)
    recv_weights: torch.Tensor  # fp32 [W * C, topk]: the router weights of those slots
    placement: object  # the ExpertPlacement of this rank
    local_overflow: bool

    @property
    def recv_splits(self) -> list[int]:
        """Rows received from each source rank that hold at least one slot here (syncs)."""
        live = (self.recv_ids >= 0).any(1).view(self.flags.shape[0], self.C)
        return live.sum(1).tolist()

    @property
    def recv_counts(self) -> torch.Tensor:
        """int64 [W, E_local] pairs received per (source rank, local expert) (syncs; for inspection)."""
        from moekit.reference import count_reference

        W, p = self.flags.shape[0], self.placement
        per = self.recv_ids.view(W, self.C, -1).cpu()
        emap = None if p.expert_map is None else p.expert_map.cpu()
        return torch.stack([count_reference(per[s], p.num_local_experts, emap).long() for s in range(W)])


def pack(hidden_wire, scale, topk_ids, topk_weights, placement, agreed, C: int, world: int, *, map_flags=(0, 0)):
    """Send buffers of this rank: rows [W*C, K], scales or None, ids [W*C, topk], weights, flags;
    ``map_flags``: (map changed, bad map entries), ints or device scalars, copied into the flags."""
    M, topk = topk_ids.shape
    E = placement.global_num_experts
    device = topk_ids.device
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    owner = torch.where(valid, agreed.owner[ids.clamp(0, E - 1)], -1)  # [M, topk]
    ranks = torch.arange(world, device=device).view(world, 1, 1)
    mine = owner.unsqueeze(0) == ranks  # [W, M, topk]: slot j of token m is on rank d
    sent = mine.any(2) & (torch.arange(M, device=device) < C).view(1, M)  # [W, M]
    row = torch.where(sent, sent.long().cumsum(1) - 1, C)  # C: the spare row, dropped
    flat = (torch.arange(world, device=device).view(world, 1) * (C + 1) + row).view(-1)  # [W * M]
    token = torch.arange(M, device=device).repeat(world)

    def block(values, fill, width):
        out = torch.full((world * (C + 1), *width), fill, dtype=values.dtype, device=device)
        out[flat] = values
        return out.view(world, C + 1, *width)[:, :C].reshape(world * C, *width)

    rows = block(hidden_wire[token], 0, (hidden_wire.shape[1],))
    scales = None if scale is None else block(scale[token], 0, (scale.shape[1],))
    slot_ids = torch.where(mine, ids.unsqueeze(0), -1).view(world * M, topk).to(WIRE_IDS)  # valid ids fit
    weights = torch.where(mine, topk_weights.float().unsqueeze(0), 0.0).view(world * M, topk)
    flags = torch.zeros(world, FLAGS, dtype=torch.int64, device=device)
    flags[:, OVERFLOW] = int(M > C)
    flags[:, BAD_IDS] = ((ids < -1) | (ids >= E)).any().long()
    flags[:, CHANGED], flags[:, BAD_MAP] = map_flags
    return rows, scales, block(slot_ids, -1, (topk,)), block(weights, 0.0, (topk,)), flags, row


def refused_blocks(layer: Layer, world: int, code: int, device):
    """The send buffers of a rank that refused its inputs: no rows, ids all -1, REFUSED = ``code``.
    Same order and sizes as :func:`pack`'s (rows, ids, weights, flags, scales or None)."""
    from moekit.quant import FP8_GROUP

    R, fp8 = world * layer.C, layer.quant is QuantScheme.FP8_BLOCK
    rows = torch.zeros((R, layer.K), dtype=torch.uint8 if fp8 else layer.dtype, device=device)
    ids = torch.full((R, layer.topk), -1, dtype=WIRE_IDS, device=device)
    weights = torch.zeros((R, layer.topk), dtype=torch.float32, device=device)
    flags = torch.zeros((world, FLAGS), dtype=torch.int64, device=device)
    flags[:, REFUSED] = code
    groups = -(-layer.K // FP8_GROUP)
    scales = torch.zeros((R, groups), dtype=torch.float32, device=device) if fp8 else None
    return rows, ids, weights, flags, scales


def map_changed(flags: torch.Tensor) -> list[int]:
    """The ranks whose map was not the agreed one when they sent (``flags`` read on the host)."""
    return flags[:, CHANGED].nonzero().flatten().tolist()


def raise_for(flags: torch.Tensor, C: int, E: int, *, rank: int) -> None:
    """Raise on every rank (this is ``rank``) for what the flag rows say (read on the host: a sync);
    a changed map is left to the caller (:func:`map_changed`), unless another error comes first."""
    f = flags.cpu()
    refused = {r: int(f[r, REFUSED]) for r in f[:, REFUSED].nonzero().flatten().tolist()}
    if refused:
        raise refusal_error(refused, rank)
    bad_maps = f[:, BAD_MAP].nonzero().flatten().tolist()
    if bad_maps:
        raise InvalidIdsError(
            f"expert_map entries must be -1 (another rank's expert) or a local id in [0, E_local) of their rank; "
            f"rank(s) {bad_maps} passed others (seen from rank {rank})"
        )
    over = f[:, OVERFLOW].nonzero().flatten().tolist()
    if over:
        raise CapacityError(
            f"rank(s) {over} passed more tokens than max_tokens_per_rank={C}; raise max_tokens_per_rank "
            "to the largest M any rank passes (mode='capacity' sends fixed blocks of that many rows)"
        )
    bad = f[:, BAD_IDS].nonzero().flatten().tolist()
    if bad:
        raise InvalidIdsError(f"topk_ids must be in [0, E_global={E}) or -1; rank(s) {bad} passed others")


def unpack(back: torch.Tensor, handle: CapacityHandle, output: torch.Tensor) -> torch.Tensor:
    """output[m] = sum over ranks d (in order) of the partial sums rank d sent back for token m."""
    W, M, C = handle.slot.shape[0], handle.M, handle.C
    K = output.shape[1]
    blocks = torch.cat([back.view(W, C, K), back.new_zeros(W, 1, K)], dim=1)  # row C: not sent, zero
    total = torch.zeros(M, K, dtype=torch.float32, device=output.device)
    for d in range(W):  # a fixed order: the same bits every run
        total += blocks[d, handle.slot[d]]
    return output.copy_(total.to(output.dtype))


__all__ = ["CapacityHandle", "Layer", "pack", "raise_for", "refused_blocks", "unpack"]
