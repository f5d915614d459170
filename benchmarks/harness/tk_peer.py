"""OpenAI's triton_kernels as a harness peer: ``triton_kernels``, the layer through two ``matmul_ogs`` calls.

Optional and detected: ``import triton_kernels`` when it is installed, else the first folder of
``$MOEKIT_TRITON_KERNELS``, ``<checkout>/../shared/vendor/triton_kernels-*`` that holds the package
(its release/3.6.x branch matches Triton 3.6). When none imports, the peer is skipped with the reason.

The pipeline, with the problem's own ids and routing weights (no router of triton_kernels' own)::

    combine  = stable argsort(topk_ids.flatten())     # expert-sorted row -> pair m * topk + j
    dispatch = inverse of combine                       # pair -> expert-sorted row
    h = matmul_ogs(x, w13, gather=(combine, dispatch), silu(gate) * up fused in the epilogue)
    y = matmul_ogs(h, w2t, scatter=(dispatch, combine), gammas = topk_weights in sorted order)

GEMM2 scales each row by its routing weight and sums a token's ``topk`` rows itself, so ``y`` is the
layer's ``[M, K]`` output. The routing is torch on the device with fixed shapes (no host sync), so a
CUDA graph captures it. triton_kernels' fused activation reduces adjacent column pairs, so the
weights are given to it as ``w13 [E, K, N]`` with gate and up columns interleaved (gate even) and
``w2t [E, N/2, K]``: copies made once per weight tensor (again after it is written to), kept until
``release()``. bf16 only: its fp8 path takes per-tensor or microscaling factors, not 128x128 blocks.
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.harness.peer_base import Peer, permute_by_expert, skipped_peer
from moekit.errors import InvalidInputError
from moekit.testing import MoEProblem

ENV_VAR = "MOEKIT_TRITON_KERNELS"


def search_folders() -> list[str]:
    """Where a triton_kernels checkout is looked for when the package is not installed."""
    folders = [os.environ[ENV_VAR]] if os.environ.get(ENV_VAR) else []
    shared_vendor = Path(__file__).resolve().parents[2].parent / "shared" / "vendor"
    return folders + sorted(glob.glob(str(shared_vendor / "triton_kernels-*")))


@dataclass(frozen=True)
class Found:
    """The outcome of :func:`locate`: ``module`` is triton_kernels' matmul_ogs, or ``reason`` says why not."""

    module: object = None
    where: str = ""
    reason: str = ""


def locate() -> Found:
    """Import ``triton_kernels.matmul_ogs``: installed first, then each of :func:`search_folders`."""
    errors = []
    for folder in [None, *search_folders()]:
        if folder is not None:
            if not os.path.isdir(os.path.join(folder, "triton_kernels")):
                errors.append(f"{folder}: no triton_kernels package in it")
                continue
            if folder not in sys.path:
                sys.path.insert(0, folder)
        try:
            module = importlib.import_module("triton_kernels.matmul_ogs")
            return Found(module, where=str(Path(module.__file__).parents[1]))
        except Exception as exc:  # a missing package, or one made for another Triton
            errors.append(f"{folder or 'installed'}: {type(exc).__name__}: {str(exc)[:160]}")
            if folder is not None:
                sys.path.remove(folder)
    return Found(reason="triton_kernels not importable (" + "; ".join(errors) + ")")


# ----------------------------------------------------------------------------------------------
# The pieces, each testable on the CPU.


@triton.jit
def silu_mul_pairs(acc):
    """``silu(gate) * up`` of a ``[BM, BN]`` tile whose even columns are gates and odd ones ups -> ``[BM, BN/2]``."""
    pairs = tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2))
    gate, up = tl.split(pairs)
    gate = gate.to(tl.float32)
    return gate * tl.sigmoid(gate) * up.to(tl.float32)


@dataclass(frozen=True)
class TkWeights:
    """moekit's ``w1 [E, N, K]`` and ``w2 [E, K, N/2]`` in triton_kernels' layout (see the module doc)."""

    w13: torch.Tensor  # [E, K, N], columns g0, u0, g1, u1, ...
    w2t: torch.Tensor  # [E, N/2, K]
    source: tuple  # weak references to the w1, w2 they came from, and those tensors' versions

    def made_from(self, w1: torch.Tensor, w2: torch.Tensor) -> bool:
        """Whether these copies are of exactly ``w1`` and ``w2`` as they are now. Not by data pointer:
        a freed weight's memory is handed to the next problem's weights at the same address."""
        (r1, v1), (r2, v2) = self.source
        return r1() is w1 and r2() is w2 and (w1._version, w2._version) == (v1, v2)


def to_tk_weights(w1: torch.Tensor, w2: torch.Tensor) -> TkWeights:
    """Interleave gate and up by column and put K first (contiguous copies)."""
    E, N, K = w1.shape
    half = N // 2
    rows = torch.stack((w1[:, :half], w1[:, half:]), dim=2).reshape(E, N, K)  # g0, u0, g1, u1, ...
    source = ((weakref.ref(w1), w1._version), (weakref.ref(w2), w2._version))
    return TkWeights(rows.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous(), source)


class WeightCache:
    """The last weights' :class:`TkWeights`, remade when other (or rewritten) weights come."""

    def __init__(self) -> None:
        self.last: TkWeights | None = None

    def get(self, w1: torch.Tensor, w2: torch.Tensor) -> TkWeights:
        if self.last is None or not self.last.made_from(w1, w2):
            self.last = None  # free the old copies before making new ones
            self.last = to_tk_weights(w1, w2)
        return self.last

    def clear(self) -> None:
        self.last = None


@dataclass(frozen=True)
class TkRouting:
    """The routing triton_kernels' GEMMs read, built from ids with torch (fixed shapes, no sync)."""

    combine: torch.Tensor  # int32 [M*topk]: expert-sorted row -> pair m * topk + j
    dispatch: torch.Tensor  # int32 [M*topk]: pair -> expert-sorted row
    gammas: torch.Tensor  # fp32 [M*topk]: the routing weight of each sorted row
    counts: torch.Tensor  # int32 [E]: rows per expert


def route_from_ids(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> TkRouting:
    """Ids in ``[0, E)`` (no empty slots: triton_kernels' routing has none) -> :class:`TkRouting`."""
    perm = permute_by_expert(topk_ids, num_experts)
    pairs = perm.order.numel()
    dispatch = torch.empty(pairs, dtype=torch.int32, device=topk_ids.device)
    dispatch[perm.order] = torch.arange(pairs, dtype=torch.int32, device=topk_ids.device)
    ends = perm.offsets
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    gammas = topk_weights.reshape(-1).float()[perm.order]
    return TkRouting(perm.order.to(torch.int32), dispatch, gammas, counts)


# ----------------------------------------------------------------------------------------------
# The peer.


class TritonKernelsLayer:
    """Callable ``layer(problem) -> [M, K]`` on triton_kernels' ``matmul_ogs`` (module ``mm``)."""

    def __init__(self, mm) -> None:
        from triton_kernels.specialize import FnSpecs
        from triton_kernels.tensor import make_ragged_tensor_metadata

        self.mm = mm
        self.ragged = make_ragged_tensor_metadata
        self.activation = mm.FusedActivation(FnSpecs("silu_mul_pairs", silu_mul_pairs, tuple(), reduction_n=2), tuple())
        self.weights = WeightCache()

    def __call__(self, x: MoEProblem) -> torch.Tensor:
        if x.w1.dtype != torch.bfloat16 or x.expert_map is not None:
            raise InvalidInputError("the triton_kernels peer runs bf16 weights without an expert_map, got "
                                    f"{x.w1.dtype}, expert_map={'set' if x.expert_map is not None else None}")
        E, topk = x.w1.shape[0], x.topk_ids.shape[1]
        w = self.weights.get(x.w1, x.w2)
        r = route_from_ids(x.topk_ids, x.topk_weights, E)
        meta = self.ragged(r.counts, r.combine.numel())
        routing = self.mm.RoutingData(r.gammas, meta.slice_sizes, E, topk, meta)
        h = self.mm.matmul_ogs(x.hidden, w.w13, None, routing, gather_indx=self.mm.GatherIndx(r.combine, r.dispatch),
                               fused_activation=self.activation)
        return self.mm.matmul_ogs(h, w.w2t, None, routing, scatter_indx=self.mm.ScatterIndx(r.dispatch, r.combine),
                                  gammas=r.gammas)

    def release(self) -> None:
        self.weights.clear()


def make_tk_peer(name: str, dtype: str) -> Peer:
    """The ``triton_kernels`` peer, or a skipped one that says why it cannot run here."""
    if dtype != "bf16":
        return skipped_peer(name, "triton_kernels takes per-tensor or microscaling fp8 factors, not 128x128 blocks")
    found = locate()
    if found.module is None:
        return skipped_peer(name, found.reason)
    layer = TritonKernelsLayer(found.module)
    return Peer(name, layer, layer.release)
