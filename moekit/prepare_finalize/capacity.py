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
from moekit.prepare_finalize.agreement import WIRE_IDS, Layer, Placement, raise_for_peers, refusal_code
from moekit.types import QuantScheme

# Columns of the flag rows: REFUSED holds a refusal code, CHANGED says the sender's map is not the
# agreed one, BAD_MAP counts its entries that are neither -1 nor a local id.
OVERFLOW, BAD_IDS, REFUSED, CHANGED, BAD_MAP = 0, 1, 2, 3, 4
FLAGS = 5


@dataclass
class Blocks:
    """One rank's buffers of a capacity dispatch: W blocks of C rows (sent or received, the same shapes).

    - ``rows``: ``[W * C, K]`` activations (fp8 travels as bytes), zeros where no token sits;
    - ``ids``: int32 ``[W * C, topk]`` the global ids of the slots on the block's rank, else -1;
    - ``weights``: fp32 ``[W * C, topk]`` the router weights of those slots, else 0;
    - ``flags``: int64 ``[W, FLAGS]`` the sender's flag row (the columns above), once per block;
    - ``scales``: fp32 ``[W * C, groups]`` the rows' fp8 group scales, or None. Last, so that
      every rank starts the exchanges of the fields in the same order, with or without it.
    """

    rows: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    flags: torch.Tensor
    scales: torch.Tensor | None


@dataclass
class Packed:
    """What :func:`pack` builds: the blocks to send, and where each token sits in them."""

    blocks: Blocks
    slot: torch.Tensor  # int64 [W, M]: row of token m in block d, or C (not sent there)


@dataclass
class CapacityHandle:
    """What finalize needs: where each token sits in each destination's block, and what arrived."""

    slot: torch.Tensor  # int64 [W, M]: row of token m in block d, or C (not sent there)
    M: int
    C: int
    received: Blocks  # the flags (each source's row), ids [W * C, topk] (-1: not here) and fp32 weights
    placement: object  # the ExpertPlacement of this rank

    @property
    def recv_splits(self) -> list[int]:
        """Rows received from each source rank that hold at least one slot here (syncs)."""
        live = (self.received.ids >= 0).any(1).view(self.slot.shape[0], self.C)
        return live.sum(1).tolist()

    @property
    def recv_counts(self) -> torch.Tensor:
        """int64 [W, E_local] pairs received per (source rank, local expert) (syncs; for inspection)."""
        from moekit.reference import count_reference

        W, p = self.slot.shape[0], self.placement
        per = self.received.ids.view(W, self.C, -1).cpu()
        emap = None if p.expert_map is None else p.expert_map.cpu()
        return torch.stack([count_reference(per[s], p.num_local_experts, emap).long() for s in range(W)])


def pack(hidden_wire, scale, topk_ids, topk_weights, *, layer: Layer, agreed: Placement, map_flags=(0, 0)) -> Packed:
    """The blocks this rank sends, for the ``layer`` and placement the ranks ``agreed`` on; ``map_flags``:
    (map changed, bad map entries), ints or device scalars, copied into the flags."""
    M, topk = topk_ids.shape
    E, C, world = layer.E, layer.dispatch.capacity, len(agreed.sizes)
    device = topk_ids.device
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    owner = torch.where(valid, agreed.owner[ids.clamp(0, E - 1)], -1)  # [M, topk]
    ranks = torch.arange(world, device=device)
    mine = owner.unsqueeze(0) == ranks.view(world, 1, 1)  # [W, M, topk]: slot j of token m is on rank d
    sent = mine.any(2) & (torch.arange(M, device=device) < C).view(1, M)  # [W, M]
    row = torch.where(sent, sent.long().cumsum(1) - 1, C)  # C: the spare row, dropped
    flat = (ranks.view(world, 1) * (C + 1) + row).view(-1)  # [W * M]
    token = torch.arange(M, device=device).repeat(world)

    def block(values, fill):  # values [W * M, ...] -> [W * C, ...] in the blocks' rows
        width = values.shape[1:]
        out = torch.full((world * (C + 1), *width), fill, dtype=values.dtype, device=device)
        out[flat] = values
        return out.view(world, C + 1, *width)[:, :C].reshape(world * C, *width)

    slot_ids = torch.where(mine, ids.unsqueeze(0), -1).view(world * M, topk).to(WIRE_IDS)  # valid ids fit
    weights = torch.where(mine, topk_weights.float().unsqueeze(0), 0.0).view(world * M, topk)
    flags = torch.zeros(world, FLAGS, dtype=torch.int64, device=device)
    flags[:, OVERFLOW] = int(M > C)
    flags[:, BAD_IDS] = ((ids < -1) | (ids >= E)).any().long()
    flags[:, CHANGED], flags[:, BAD_MAP] = map_flags
    scales = None if scale is None else block(scale[token], 0)
    return Packed(Blocks(block(hidden_wire[token], 0), block(slot_ids, -1), block(weights, 0.0), flags, scales), row)


def refused_blocks(layer: Layer, world: int, error: BaseException, device) -> Blocks:
    """The blocks of a rank that refused its inputs with ``error``, of the sizes :func:`pack` gives: no
    rows, ids all -1, REFUSED = the error's :func:`~moekit.prepare_finalize.agreement.refusal_code`."""
    from moekit.kernels.host_math import cdiv
    from moekit.quant import FP8_GROUP

    R, fp8 = world * layer.dispatch.capacity, layer.quant is QuantScheme.FP8_BLOCK
    rows = torch.zeros((R, layer.K), dtype=torch.uint8 if fp8 else layer.dtype, device=device)
    ids = torch.full((R, layer.topk), -1, dtype=WIRE_IDS, device=device)
    weights = torch.zeros((R, layer.topk), dtype=torch.float32, device=device)
    flags = torch.zeros((world, FLAGS), dtype=torch.int64, device=device)
    flags[:, REFUSED] = refusal_code(error)
    scales = torch.zeros((R, cdiv(layer.K, FP8_GROUP)), dtype=torch.float32, device=device) if fp8 else None
    return Blocks(rows, ids, weights, flags, scales)


def raise_for(flags: torch.Tensor, C: int, E: int, *, rank: int) -> list[int]:
    """Raise on every rank (this is ``rank``) for what the flag rows say (read on the host: a sync);
    else return the ranks whose map was not the agreed one when they sent (the caller decides)."""
    rows = flags.tolist()
    raise_for_peers(rows, refused=REFUSED, bad_map=BAD_MAP, rank=rank)
    over = [r for r, row in enumerate(rows) if row[OVERFLOW]]
    if over:
        raise CapacityError(
            f"rank(s) {over} passed more tokens than max_tokens_per_rank={C}; raise max_tokens_per_rank "
            "to the largest M any rank passes (mode='capacity' sends fixed blocks of that many rows)"
        )
    bad = [r for r, row in enumerate(rows) if row[BAD_IDS]]
    if bad:
        raise InvalidIdsError(f"topk_ids must be in [0, E_global={E}) or -1; rank(s) {bad} passed others")
    return [r for r, row in enumerate(rows) if row[CHANGED]]


def unpack(back: torch.Tensor, handle: CapacityHandle, output: torch.Tensor) -> torch.Tensor:
    """output[m] = sum over ranks d (in order) of the partial sums rank d sent back for token m."""
    W, C, K = handle.slot.shape[0], handle.C, back.shape[1]
    blocks = torch.cat([back.view(W, C, K), back.new_zeros(W, 1, K)], dim=1)  # row C: not sent, zero
    total = torch.zeros_like(output, dtype=torch.float32)  # [M, K]
    for d in range(W):  # a fixed order: the same bits every run
        total += blocks[d, handle.slot[d]]
    return output.copy_(total.to(output.dtype))


__all__ = ["Blocks", "CapacityHandle", "Packed", "pack", "raise_for", "refused_blocks", "unpack"]
