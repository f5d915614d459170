"""``All2AllPrepareFinalize``: expert parallelism over torch.distributed, Standard format.

Each of the W ranks owns some experts, as the ranks' expert maps say: any placement in which
every expert has exactly one owner (contiguous blocks of equal or different sizes, from
:func:`moekit.routing.contiguous_expert_map`, or any other). One forward on every rank::

    prepare (rank r, its own M tokens, topk_ids [M, topk] global)
      agree(dtype, K, E, topk, quant, placement)         # one small exchange; named error on
                                                         # every rank if any rank differs
      a1q, scale = quantize(hidden)                      # as the experts ask (fp8 block or not)
      pairs = [(m, j) for m, j if topk_ids[m, j] >= 0]   # -1 slots are not sent
      pairs.sort(key=(owner, local id))                  # groups pairs by owner, then by expert
      counts[d][e] = pairs for rank d's local expert e
      recv_counts = all_to_all(counts)                   # [W, E_local]: what each source sends me
      rows, scales, ids = all_to_all(a1q[m], scale[m], g for (m, j) in pairs)
      -> Prepared(a1q=rows [R, K], topk_ids=ids [R, 1] (global), topk_weights=ones [R, 1],
                  tokens_meta=recv_counts.sum(0) on the device and on the CPU)
    experts (rank r): unweighted output [R, 1, K] for its experts only
    finalize (rank r)
      back = all_to_all(fused_out)                       # the exact reverse exchange
      output[m] = sum_j topk_weights[m, j] * back[pair (m, j)]   (fp32, -1 slots add 0)

Router weights never travel: they stay on the source rank and are applied in finalize, in the
same fp32 order as the one-process path. That is why the received ``topk_weights`` are ones.

Every rank must call ``prepare`` and ``finalize`` (they are collectives), including a rank with
no tokens: ``collective = True`` tells the modular kernel not to skip them when M == 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.distributed.process_group import check_timeout
from moekit.errors import CapacityError, DistributedError, InvalidIdsError, InvalidInputError
from moekit.prepare_finalize import capacity
from moekit.prepare_finalize.agreement import WIRE_IDS, Agreement, Dispatch, bad_map_entries, refusal_code, wait
from moekit.prepare_finalize.base import PrepareFinalize, quantize_activations, weight_and_reduce
from moekit.types import ActivationFormat, ExpertPlacement, ExpertTokensMetadata, Prepared, QuantScheme


@dataclass
class DispatchHandle:
    """What ``finalize`` needs to send results home and reduce them (kept by ``prepare``).

    - ``send_splits[d]``: pairs this rank sent to rank d; ``recv_splits[s]``: rows received from s.
    - ``pairs``: int64 ``[S]`` flat ``m * topk + j`` index of every sent pair, in sending order.
    - ``topk_weights``: the caller's ``[M, topk]`` weights (applied here, at the source).
    - ``recv_counts``: int64 ``[W, E_local]`` rows received per (source rank, local expert).
    """

    send_splits: list[int]
    recv_splits: list[int]
    pairs: torch.Tensor
    topk_weights: torch.Tensor
    M: int
    topk: int
    recv_counts: torch.Tensor


MODES = ("exact", "capacity")
CHECKS = ("sync", "deferred")


class All2AllPrepareFinalize(PrepareFinalize):
    """Dispatch (token, slot) pairs to the rank that owns their expert; combine them back.

    Args:
        group: the torch.distributed process group (default: the world). Gloo needs CPU
            tensors, NCCL CUDA tensors.
        timeout_s: wait at most this long for each exchange (the agreement's gathers and every
            all-to-all), then raise DistributedError. None relies on the group's own timeout
            (``init_process_group(timeout=...)``). With NCCL a timeout makes every wait a host
            sync; leave it None when timing. After a timeout the group is out of step: destroy it
            and start a new one (with NCCL the communicator is unusable).
        mode: ``"exact"`` (split sizes first, read on the host, then exactly the rows: one host
            sync per dispatch) or ``"capacity"`` (fixed blocks of ``max_tokens_per_rank`` rows per
            rank pair, no host sync after the first call: see :mod:`moekit.prepare_finalize.capacity`).
        max_tokens_per_rank: capacity mode only: the largest M any rank passes (the same on all).
        check: capacity mode only: ``"sync"`` reads the error flags once per dispatch (before the
            experts run); ``"deferred"`` never does, and :meth:`raise_if_failed` raises later.

    The caller passes ``expert_map = contiguous_expert_map(E_global, W, rank)`` (and the local
    ``[E_local, ...]`` weights) to ``ModularKernel.forward``; the received ``topk_ids`` are
    global int32 ids (ids travel as int32, so ranks may pass int16, int32 or int64), which the
    experts map to local ids with it.

    Bad inputs on one rank: every rank raises a named error. The modular kernel calls
    :meth:`refuse` when its door rejects this rank's inputs, and the peers raise the same error
    class naming that rank; what the exchanges find (ids beyond E, M beyond the capacity, ranks
    that disagree about the layer or the dispatch) raises on every rank. Tested on gloo, at 2
    and 3 ranks: every rank raises within ``timeout_s`` (in well under a second when one rank's
    inputs are bad). A rank that stops answering makes the others raise DistributedError after
    ``timeout_s``; with NCCL that is not tested here, and the communicator is then unusable.
    """

    activation_format = ActivationFormat.STANDARD
    collective = True
    dispatches = True

    def __init__(
        self,
        *,
        group=None,
        timeout_s: float | None = None,
        mode: str = "exact",
        max_tokens_per_rank: int | None = None,
        check: str = "sync",
    ):
        check_timeout(timeout_s, none_means="the process group's own timeout")
        if mode not in MODES or check not in CHECKS:
            raise InvalidInputError(f"mode must be one of {MODES} and check one of {CHECKS}, got {mode!r}, {check!r}")
        C = max_tokens_per_rank
        if mode == "capacity" and (isinstance(C, bool) or not isinstance(C, int) or C <= 0):
            raise InvalidInputError(f"mode='capacity' needs max_tokens_per_rank, an int > 0, got {C!r}")
        if mode == "exact" and C is not None:
            raise InvalidInputError("max_tokens_per_rank sizes mode='capacity' blocks; mode='exact' takes none")
        self.group = group
        self.timeout_s = timeout_s
        self.mode, self.max_tokens_per_rank, self.check = mode, C, check
        self.last_handle: DispatchHandle | capacity.CapacityHandle | None = None  # the latest prepare's, for inspection
        self._agreement = Agreement(group, timeout_s=timeout_s)
        self._agreed: tuple[capacity.Layer, object] | None = None  # capacity mode's last agreement
        self._device: torch.device | None = None  # the latest call's, for refuse

    def __repr__(self) -> str:
        cap = f", max_tokens_per_rank={self.max_tokens_per_rank}" if self.mode == "capacity" else ""
        return f"All2AllPrepareFinalize(mode={self.mode!r}{cap}, timeout_s={self.timeout_s})"

    # ----------------------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "All2AllPrepareFinalize needs an initialized torch.distributed process group; run "
                "under moekit.distributed.launch(...) or torchrun + moekit.distributed.init_from_env()"
            )
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, what: str):
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        return work, what

    def _wait(self, *pending) -> None:
        for work, what in pending:
            wait(work, timeout_s=self.timeout_s, what=f"all-to-all of {what}", group=self.group)

    def _configured(self) -> Agreement:
        """The agreement, told this stage's current options (they are plain attributes)."""
        check = self.check if self.mode == "capacity" else "sync"  # exact mode has no check to agree on
        self._agreement.timeout_s = self.timeout_s
        self._agreement.dispatch = Dispatch(self.mode, self.max_tokens_per_rank, check)
        return self._agreement

    def _agree(self, hidden, topk, quant, placement):
        return self._configured().check(hidden, topk, quant, placement)  # named error on every rank

    def refuse(self, error: Exception) -> None:
        """This rank's inputs were rejected at the door: join the exchange the peers are in (the
        agreement header, or capacity mode's blocks once agreed) flagged as refused, so that they
        raise the same named error class within ``timeout_s`` instead of waiting. Never raises:
        a failure to tell them is noted on ``error``."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        self.last_handle = None
        device = self._device or _group_device(self.group)
        try:
            if self.mode == "capacity" and self._agreed is not None:
                self._refuse_capacity(refusal_code(error), self._agreed[0], device)
            else:
                self._configured().refuse(error, device)
        except Exception as e:  # the door's error must reach the caller, not this one
            error.add_note(f"moekit could not tell the other ranks (they raise after their timeout_s): {e}")

    # ----------------------------------------------------------------------------------------
    def prepare(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        quant: QuantScheme,
        placement: ExpertPlacement,
    ) -> Prepared:
        rank, world = self._world()
        self.last_handle, self._device = None, hidden.device
        if self.mode == "capacity":
            return self._prepare_capacity(hidden, topk_weights, topk_ids, quant, placement, world)
        device = hidden.device
        M, topk = topk_ids.shape
        K = hidden.shape[1]
        agreed = self._agree(hidden, topk, quant, placement)
        E, E_local = placement.global_num_experts, placement.num_local_experts

        # Sort keys: the expert's place in (owner, local id) order, E for an empty slot (-1), E + 1
        # for an invalid id (< -1 or >= E); sorting groups the pairs by owner rank, then by its local expert.
        flat = topk_ids.reshape(-1).long()  # [M * topk]
        valid = (flat >= 0) & (flat < E)
        key = torch.where(valid, agreed.position[flat.clamp(0, E - 1)], torch.where(flat == -1, E, E + 1))
        order = torch.argsort(key, stable=True)
        hist = torch.zeros(E + 2, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
        # Per destination d: pairs for each of d's experts in its local order, plus this rank's
        # invalid-id count, so that a bad id on one rank makes every rank raise instead of waiting.
        chunks, start = [], 0
        for size in agreed.sizes:
            chunks += [hist[start : start + size], hist[E + 1 :]]
            start += size
        send = torch.cat(chunks)
        recv = torch.empty((world, E_local + 1), dtype=torch.int64, device=device)
        self._wait(
            self._exchange(recv.view(-1), send, [E_local + 1] * world, [s + 1 for s in agreed.sizes], "the split sizes")
        )
        sent_cpu, recv_cpu = hist.cpu(), recv.cpu()  # the host sync of the exact-size exchange
        bad = recv_cpu[:, E_local].nonzero().flatten().tolist()
        if bad:
            raise InvalidIdsError(f"topk_ids must be in [0, E_global={E}) or -1; rank(s) {bad} passed others")
        send_splits = [int(sent_cpu[a:b].sum()) for a, b in _bounds(agreed.sizes)]
        recv_counts = recv_cpu[:, :E_local]  # [W, E_local]: received from each rank, per expert
        recv_splits = recv_counts.sum(1).tolist()
        R = sum(recv_splits)
        pairs = order[: sum(send_splits)]  # [S] flat (token, slot) indices, in sending order
        gid, token = flat[pairs], pairs // topk

        a1q, a1q_scale = quantize_activations(hidden, quant)
        wire = a1q.view(torch.uint8) if a1q.dtype == torch.float8_e4m3fn else a1q  # fp8 travels as bytes
        rows = wire.new_empty((R, K))
        ids = torch.empty((R,), dtype=WIRE_IDS, device=device)  # one wire dtype, whatever each rank passed
        pending = [
            self._exchange(rows, wire[token], recv_splits, send_splits, "activation rows"),
            self._exchange(ids, gid.to(WIRE_IDS), recv_splits, send_splits, "expert ids"),
        ]
        scales = None
        if a1q_scale is not None:
            scales = a1q_scale.new_empty((R, a1q_scale.shape[1]))
            sent = a1q_scale[token].contiguous()
            pending.append(self._exchange(scales, sent, recv_splits, send_splits, "scales"))
        self._wait(*pending)

        per_expert = recv_counts.sum(0).to(torch.int32)  # [E_local], CPU
        meta = ExpertTokensMetadata(per_expert.to(device), per_expert)
        handle = DispatchHandle(send_splits, recv_splits, pairs, topk_weights, M, topk, recv_counts)
        self.last_handle = handle
        return Prepared(
            a1q=rows.view(a1q.dtype),
            a1q_scale=scales,
            tokens_meta=meta,
            topk_ids=ids.view(R, 1),
            topk_weights=torch.ones((R, 1), dtype=torch.float32, device=device),
            handle=handle,
        )

    # ----------------------------------------------------------------------------------------
    def _agree_capacity(self, hidden, topk, quant, placement):
        """The agreement (C and the check mode are in its header), once per layer: later calls
        with the same layer exchange nothing more than the blocks, so they can run inside a CUDA graph."""
        layer = capacity.Layer(
            hidden.dtype,
            hidden.shape[1],
            placement.global_num_experts,
            placement.num_local_experts,
            topk,
            quant,
            self.max_tokens_per_rank,
            self.check,
        )
        if self._agreed is not None and self._agreed[0] == layer:
            return self._agreed[1]
        self._agreed = None
        agreed = self._agree(hidden, topk, quant, placement)
        self._agreed = (layer, agreed)
        return agreed

    def _refuse_capacity(self, code: int, layer: capacity.Layer, device) -> None:
        """The blocks the peers wait for (empty, flagged refused); in deferred mode, the combine too."""
        send = capacity.refused_blocks(layer, dist.get_world_size(self.group), code, device)
        names = ("activation rows", "expert ids", "router weights", "capacity flags", "scales")
        sent = [(t, n) for t, n in zip(send, names, strict=True) if t is not None]
        self._wait(*[self._exchange(torch.empty_like(t), t, None, None, n) for t, n in sent])
        if layer.check == "deferred":  # the peers go on to the combine: join it, sending nothing
            zeros = torch.zeros((send[0].shape[0], layer.K), dtype=torch.float32, device=device)
            self._wait(self._exchange(torch.empty_like(zeros), zeros, None, None, "partial sums (combine)"))

    def _prepare_capacity(self, hidden, topk_weights, topk_ids, quant, placement, world, *, again=True) -> Prepared:
        C, (M, topk) = self.max_tokens_per_rank, topk_ids.shape
        agreed = self._agree_capacity(hidden, topk, quant, placement)
        a1q, a1q_scale = quantize_activations(hidden, quant)
        wire = a1q.view(torch.uint8) if a1q.dtype == torch.float8_e4m3fn else a1q  # fp8 travels as bytes
        map_flags = (self._agreement.changed(placement), bad_map_entries(placement))
        rows, scales, ids, weights, flags, slot = capacity.pack(
            wire, a1q_scale, topk_ids, topk_weights, placement, agreed, C, world, map_flags=map_flags
        )
        recv = [torch.empty_like(t) for t in (rows, ids, weights, flags)]
        pending = [
            self._exchange(recv[0], rows, None, None, "activation rows"),
            self._exchange(recv[1], ids, None, None, "expert ids"),
            self._exchange(recv[2], weights, None, None, "router weights"),
            self._exchange(recv[3], flags, None, None, "capacity flags"),
        ]
        recv_scales = None
        if scales is not None:  # last: refuse sends in this order too
            recv_scales = torch.empty_like(scales)
            pending.append(self._exchange(recv_scales, scales, None, None, "scales"))
        self._wait(*pending)
        if self.check == "sync":  # the one read of this mode
            flags = recv[3].cpu()
            capacity.raise_for(flags, C, placement.global_num_experts, rank=dist.get_rank(self.group))
            changed = capacity.map_changed(flags)
            if changed and again:  # every rank read the same flags: all agree again, then send again
                self._agreed = None
                return self._prepare_capacity(hidden, topk_weights, topk_ids, quant, placement, world, again=False)
            if changed:
                raise InvalidInputError(
                    f"rank(s) {changed} changed their expert_map during this call, after the ranks agreed again"
                )
        from moekit.kernels.count import count_expert_num_tokens

        counts = count_expert_num_tokens(recv[1], placement.num_local_experts, placement.expert_map)
        handle = capacity.CapacityHandle(slot.view(world, M), M, C, recv[3], recv[1], recv[2], placement, M > C)
        self.last_handle = handle
        return Prepared(
            a1q=recv[0].view(a1q.dtype),
            a1q_scale=recv_scales,
            tokens_meta=ExpertTokensMetadata(counts),
            topk_ids=recv[1],
            topk_weights=recv[2],
            handle=handle,
        )

    def _finalize_capacity(self, fused_out, prepared, output) -> torch.Tensor:
        h: capacity.CapacityHandle = prepared.handle
        R, topk, K = h.recv_ids.shape[0], h.recv_ids.shape[1], output.shape[1]
        if fused_out.numel() != R * topk * K or tuple(output.shape) != (h.M, K):
            raise InvalidInputError(
                f"fused_out must be [R={R}, topk={topk}, K] and output [M={h.M}, K={K}], got "
                f"{tuple(fused_out.shape)} and {tuple(output.shape)}"
            )
        partial = torch.empty((R, K), dtype=torch.float32, device=output.device)  # fp32 on the wire
        weight_and_reduce(fused_out.reshape(R, topk, K), h.recv_weights, partial)
        back = torch.empty_like(partial)
        self._wait(self._exchange(back, partial, None, None, "partial sums (combine)"))
        if h.local_overflow:  # every collective joined; now the error, before the output is written
            raise CapacityError(f"this rank passed {h.M} tokens, more than max_tokens_per_rank={h.C}")
        return capacity.unpack(back, h, output)

    def raise_if_failed(self) -> None:
        """After a ``check="deferred"`` step: raise what the last dispatch's flags say (a host sync)."""
        h = self.last_handle
        if isinstance(h, capacity.CapacityHandle):
            flags, rank = h.flags.cpu(), dist.get_rank(self.group)
            capacity.raise_for(flags, h.C, h.placement.global_num_experts, rank=rank)
            changed = capacity.map_changed(flags)
            if changed:  # every rank reads the same flags: each agrees again at its next call
                self._agreed = None
                raise InvalidInputError(
                    f"rank(s) {changed} sent with an expert_map other than the one the ranks agreed on (changed "
                    f"since, seen from rank {rank}): that step's tokens followed the old placement. The next "
                    "call agrees on the new one."
                )

    def finalize(self, fused_out: torch.Tensor, prepared: Prepared, *, output: torch.Tensor) -> torch.Tensor:
        if isinstance(prepared.handle, capacity.CapacityHandle):
            return self._finalize_capacity(fused_out, prepared, output)
        h: DispatchHandle = prepared.handle
        if not isinstance(h, DispatchHandle):
            raise InvalidInputError("finalize needs the Prepared that this stage's prepare returned")
        R, K = prepared.a1q.shape[0], output.shape[1]
        if fused_out.numel() != R * K:
            raise InvalidInputError(
                f"fused_out must hold one [K={K}] row per received row (R={R}), got {tuple(fused_out.shape)}"
            )
        if tuple(output.shape) != (h.M, K):
            raise InvalidInputError(f"output must be [M={h.M}, K={K}], got {tuple(output.shape)}")
        back = fused_out.new_empty((h.pairs.numel(), K))
        self._wait(
            self._exchange(
                back, fused_out.reshape(R, K).contiguous(), h.send_splits, h.recv_splits, "expert outputs (combine)"
            )
        )
        if h.M == 0:  # this rank only served others (weight_and_reduce cannot view [0, -1, K])
            return output
        per_slot = torch.zeros((h.M * h.topk, K), dtype=torch.float32, device=output.device)
        per_slot[h.pairs] = back.float()  # -1 slots stay 0
        return weight_and_reduce(per_slot.view(h.M, h.topk, K), h.topk_weights, output)


def _group_device(group) -> torch.device:
    """Where this group's tensors live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bounds(sizes) -> list[tuple[int, int]]:
    """[start, end) of each rank's block of experts in (owner, local id) order."""
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out
