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

from moekit.distributed.collectives import group_device, wait
from moekit.distributed.process_group import check_timeout
from moekit.errors import CapacityError, DistributedError, InvalidIdsError, InvalidInputError
from moekit.prepare_finalize import capacity
from moekit.prepare_finalize.agreement import CHECKS, MODES, WIRE_IDS, Agreement, Dispatch, bad_map_entries
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
        self._device: torch.device | None = None  # the latest call's, for refuse

    def __repr__(self) -> str:
        cap = f", max_tokens_per_rank={self.max_tokens_per_rank}" if self.mode == "capacity" else ""
        return f"All2AllPrepareFinalize(mode={self.mode!r}{cap}, timeout_s={self.timeout_s})"

    # ----------------------------------------------------------------------------------------
    def _all_to_all(self, exchanges: list[tuple], out_splits=None, in_splits=None) -> None:
        """``(out, inp, what)`` exchanges with the same splits (None: equal), all started before the first
        wait; each waits at most ``timeout_s``."""
        pending = [
            (dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True), what)
            for out, inp, what in exchanges
        ]
        for work, what in pending:
            wait(work, timeout_s=self.timeout_s, what=f"all-to-all of {what}", group=self.group)

    def _all_to_all_rows(self, sent: dict, recv_rows: int | None = None, recv_splits=None, send_splits=None) -> dict:
        """Every tensor of ``sent`` (what it is -> rows, or None) to the other ranks: ``send_splits``
        rows to each, ``recv_rows`` rows back in ``recv_splits`` (None: equal splits, as many rows back
        as sent). Returns the received tensors under the same names (None where None was sent)."""
        received = dict.fromkeys(sent)
        for what, t in sent.items():
            if t is not None:
                received[what] = t.new_empty((t.shape[0] if recv_rows is None else recv_rows, *t.shape[1:]))
        self._all_to_all([(received[w], t, w) for w, t in sent.items() if t is not None], recv_splits, send_splits)
        return received

    def _configured(self) -> Agreement:
        """The agreement, told this stage's current options (they are plain attributes)."""
        check = self.check if self.mode == "capacity" else "sync"  # exact mode has no check to agree on
        self._agreement.timeout_s = self.timeout_s
        self._agreement.dispatch = Dispatch(self.mode, self.max_tokens_per_rank, check)
        return self._agreement

    def refuse(self, error: Exception) -> None:
        """This rank's inputs were rejected at the door: join the exchange the peers are in (the
        agreement header, or capacity mode's blocks once agreed) flagged as refused, so that they
        raise the same named error class within ``timeout_s`` instead of waiting. Never raises:
        a failure to tell them is noted on ``error``."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        self.last_handle = None
        device = self._device or group_device(self.group)
        try:
            if self.mode == "capacity" and self._agreement.layer is not None:
                self._refuse_capacity(error, device)
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
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "All2AllPrepareFinalize needs an initialized torch.distributed process group; run "
                "under moekit.distributed.launch(...) or torchrun + moekit.distributed.init_from_env()"
            )
        self.last_handle, self._device = None, hidden.device
        if self.mode == "capacity":
            return self._prepare_capacity(hidden, topk_weights, topk_ids, quant, placement)
        device = hidden.device
        M, topk = topk_ids.shape
        agreed = self._configured().check(hidden, topk, quant, placement)  # named error on every rank
        world = len(agreed.sizes)  # one block of experts per rank
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
        invalid = hist[E + 1 :]
        send = torch.cat([part for per_owner in hist[:E].split(agreed.sizes) for part in (per_owner, invalid)])
        recv = torch.empty((world, E_local + 1), dtype=torch.int64, device=device)
        send_sizes = [s + 1 for s in agreed.sizes]
        self._all_to_all([(recv.view(-1), send, "the split sizes")], [E_local + 1] * world, send_sizes)
        sent_cpu, recv_cpu = hist.cpu(), recv.cpu()  # the host sync of the exact-size exchange
        bad = recv_cpu[:, E_local].nonzero().flatten().tolist()
        if bad:
            raise InvalidIdsError(f"topk_ids must be in [0, E_global={E}) or -1; rank(s) {bad} passed others")
        send_splits = [int(per_owner.sum()) for per_owner in sent_cpu[:E].split(agreed.sizes)]
        recv_counts = recv_cpu[:, :E_local]  # [W, E_local]: received from each rank, per expert
        recv_splits = recv_counts.sum(1).tolist()
        R = sum(recv_splits)
        pairs = order[: sum(send_splits)]  # [S] flat (token, slot) indices, in sending order
        gid, token = flat[pairs], pairs // topk

        a1q, a1q_scale = quantize_activations(hidden, quant)
        scales = None if a1q_scale is None else a1q_scale[token].contiguous()
        # Ids travel in one wire dtype, whatever each rank passed.
        sent = {"activation rows": _wire(a1q)[token], "expert ids": gid.to(WIRE_IDS), "scales": scales}
        got = self._all_to_all_rows(sent, R, recv_splits, send_splits)

        per_expert = recv_counts.sum(0).to(torch.int32)  # [E_local], CPU
        self.last_handle = DispatchHandle(send_splits, recv_splits, pairs, topk_weights, M, topk, recv_counts)
        return Prepared(
            a1q=got["activation rows"].view(a1q.dtype),
            a1q_scale=got["scales"],
            tokens_meta=ExpertTokensMetadata(per_expert.to(device), per_expert),
            topk_ids=got["expert ids"].view(R, 1),
            topk_weights=torch.ones((R, 1), dtype=torch.float32, device=device),
            handle=self.last_handle,
        )

    # ----------------------------------------------------------------------------------------
    def _refuse_capacity(self, error: Exception, device) -> None:
        """The blocks the peers wait for (empty, flagged refused); in deferred mode, the combine too."""
        layer = self._agreement.layer
        sent = capacity.refused_blocks(layer, dist.get_world_size(self.group), error, device)
        self._all_to_all_rows(vars(sent))
        if layer.dispatch.check == "deferred":  # the peers go on to the combine: join it, sending nothing
            zeros = torch.zeros((sent.rows.shape[0], layer.K), dtype=torch.float32, device=device)
            self._all_to_all([(torch.empty_like(zeros), zeros, "partial sums (combine)")])

    def _prepare_capacity(self, hidden, topk_weights, topk_ids, quant, placement, *, again=True) -> Prepared:
        """The agreement once per layer (C and the check mode are in its header): later calls with the
        same layer exchange nothing more than the blocks, so they can run inside a CUDA graph."""
        C, (M, topk) = self.max_tokens_per_rank, topk_ids.shape
        agreed = self._configured().check(hidden, topk, quant, placement, reuse=True)
        a1q, a1q_scale = quantize_activations(hidden, quant)
        flags = (self._agreement.changed(placement), bad_map_entries(placement))
        layer = self._agreement.layer
        packed = capacity.pack(
            _wire(a1q), a1q_scale, topk_ids, topk_weights, layer=layer, agreed=agreed, map_flags=flags
        )
        recv = capacity.Blocks(**self._all_to_all_rows(vars(packed.blocks)))
        if self.check == "sync":  # the one read of this mode
            changed = capacity.raise_for(recv.flags, C, placement.global_num_experts, rank=dist.get_rank(self.group))
            if changed and again:  # every rank read the same flags: all agree again, then send again
                self._agreement.layer = None
                return self._prepare_capacity(hidden, topk_weights, topk_ids, quant, placement, again=False)
            if changed:
                raise InvalidInputError(
                    f"rank(s) {changed} changed their expert_map during this call, after the ranks agreed again"
                )
        from moekit.kernels.count import count_expert_num_tokens

        counts = count_expert_num_tokens(recv.ids, placement.num_local_experts, placement.expert_map)
        self.last_handle = capacity.CapacityHandle(packed.slot, M, C, recv, placement)
        return Prepared(
            a1q=recv.rows.view(a1q.dtype),
            a1q_scale=recv.scales,
            tokens_meta=ExpertTokensMetadata(counts),
            topk_ids=recv.ids,
            topk_weights=recv.weights,
            handle=self.last_handle,
        )

    def raise_if_failed(self) -> None:
        """After a ``check="deferred"`` step: raise what the last dispatch's flags say (a host sync)."""
        h = self.last_handle
        if isinstance(h, capacity.CapacityHandle):
            rank = dist.get_rank(self.group)
            changed = capacity.raise_for(h.received.flags, h.C, h.placement.global_num_experts, rank=rank)
            if changed:  # every rank reads the same flags: each agrees again at its next call
                self._agreement.layer = None
                raise InvalidInputError(
                    f"rank(s) {changed} sent with an expert_map other than the one the ranks agreed on (changed "
                    f"since, seen from rank {rank}): that step's tokens followed the old placement. The next "
                    "call agrees on the new one."
                )

    def finalize(self, fused_out: torch.Tensor, prepared: Prepared, *, output: torch.Tensor) -> torch.Tensor:
        h = prepared.handle
        if not isinstance(h, DispatchHandle | capacity.CapacityHandle):
            raise InvalidInputError("finalize needs the Prepared that this stage's prepare returned")
        R, topk = prepared.topk_ids.shape  # exact mode: one row (topk 1) per received (token, slot) pair
        K = output.shape[1]
        if fused_out.numel() != R * topk * K or tuple(output.shape) != (h.M, K):
            raise InvalidInputError(
                f"fused_out must be [R={R}, topk={topk}, K] and output [M={h.M}, K={K}], got "
                f"{tuple(fused_out.shape)} and {tuple(output.shape)}"
            )
        if isinstance(h, capacity.CapacityHandle):
            partial = torch.empty((R, K), dtype=torch.float32, device=output.device)  # fp32 on the wire
            weight_and_reduce(fused_out.reshape(R, topk, K), h.received.weights, partial)
            back = torch.empty_like(partial)
            self._all_to_all([(back, partial, "partial sums (combine)")])
            if h.M > h.C:  # every collective joined; now the error, before the output is written
                raise CapacityError(f"this rank passed {h.M} tokens, more than max_tokens_per_rank={h.C}")
            return capacity.unpack(back, h, output)
        back = fused_out.new_empty((h.pairs.numel(), K))
        combine = (back, fused_out.reshape(R, K).contiguous(), "expert outputs (combine)")
        self._all_to_all([combine], h.send_splits, h.recv_splits)
        if h.M == 0:  # this rank only served others (weight_and_reduce cannot view [0, -1, K])
            return output
        per_slot = torch.zeros((h.M * h.topk, K), dtype=torch.float32, device=output.device)
        per_slot[h.pairs] = back.float()  # -1 slots stay 0
        return weight_and_reduce(per_slot.view(h.M, h.topk, K), h.topk_weights, output)


def _wire(a1q: torch.Tensor) -> torch.Tensor:
    """The activations as they travel: fp8 as bytes (not every backend moves fp8), others as they are."""
    return a1q.view(torch.uint8) if a1q.dtype == torch.float8_e4m3fn else a1q
