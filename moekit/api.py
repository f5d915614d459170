"""``moekit.fused_moe``: the one-call entry point (NoEP prepare/finalize + experts by name)."""

from __future__ import annotations

import importlib
import threading
from collections import OrderedDict
from collections.abc import Collection

import torch

from moekit.device import is_hopper
from moekit.errors import InvalidInputError
from moekit.experts import Experts
from moekit.modular_kernel import ModularKernel
from moekit.plan import validate_chunk_size
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import FP8
from moekit.types import QuantScheme
from moekit.validate import check_flag
from moekit.workspace import pool_device, shared_pool

# The one registry of short names (Standard-format experts only), wherever a name is accepted:
# moekit.fused_moe(experts=...), moekit.integrations.transformers.register(experts=..., fp8_experts=...),
# moekit.ep, the benchmark harness. Each name maps to the class it builds.
BY_NAME = {
    "triton": "TritonExperts",  # HopperTritonExperts on a Hopper GPU (experts_class)
    "hopper": "HopperTritonExperts",
    "deep_gemm": "DeepGemmExperts",
    "triton_or_deep_gemm": "TritonOrDeepGemmExperts",
    "grouped_mm": "GroupedMMExperts",
}
# fused_moe replays a CUDA graph per signature up to this many tokens, and keeps at most REPLAY_GRAPHS
# graphs per kernel (moekit.hopper.graphed.GraphedKernel): below it the host is the limit.
REPLAY_MAX_TOKENS, REPLAY_GRAPHS = 128, 128


def experts_class(name: str, *, among: Collection[str] = BY_NAME, what: str = "experts") -> type[Experts]:
    """The Standard-format experts class for a short name of :data:`BY_NAME` ("triton", "deep_gemm", ...).

    "triton" is the wing's ``HopperTritonExperts`` (:mod:`moekit.hopper`) on a Hopper GPU and the
    book's ``TritonExperts`` anywhere else, the interpreter included; "hopper" is always the wing's.

    Args:
        name: the short name.
        among: the names this caller accepts (a subset of :data:`BY_NAME`; default: all of them).
        what: how the caller calls the argument, for the error (``"fp8_experts"``).

    Raises:
        InvalidInputError: ``name`` is not one of ``among``, e.g. ``experts must be one of
            ['deep_gemm', 'grouped_mm', 'hopper', 'triton', 'triton_or_deep_gemm'], got 'cutlass'``.
    """
    unknown = sorted(set(among) - set(BY_NAME))
    if unknown:
        raise InvalidInputError(f"among must hold names of moekit.api.BY_NAME {sorted(BY_NAME)}, got {unknown}")
    if not isinstance(name, str) or name not in among:
        raise InvalidInputError(f"{what} must be one of {sorted(among)}, got {name!r}")
    if name == "hopper" or (name == "triton" and is_hopper()):
        return importlib.import_module("moekit.hopper.experts").HopperTritonExperts
    return getattr(importlib.import_module("moekit.experts"), BY_NAME[name])


class KernelCache:
    """The modular kernels behind :func:`fused_moe`, one per (experts, chunk size, scheme, device,
    replay): the ``size`` most recently used are kept (a kernel holds no memory of its own: the
    workspace pool of its device is shared; a replaying one holds its graphs' buffers). Thread-safe:
    two threads asking for one key get one kernel.
    """

    def __init__(self, size: int = 16):
        self.size = size
        self._kernels: OrderedDict[tuple, ModularKernel] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self, experts: str, chunk_size: int | None, quant: QuantScheme, device: torch.device, *, replay: bool = False
    ):
        """The kernel for these settings, made on first ask (on the shared pool of ``device``); with
        ``replay``, inside a :class:`~moekit.hopper.graphed.GraphedKernel`."""
        key = (experts, chunk_size, quant, pool_device(device), replay)
        with self._lock:
            if key not in self._kernels:
                kernel = ModularKernel(
                    NoEPPrepareFinalize(),
                    experts_class(experts)(quant=quant),
                    chunk_size=chunk_size,
                    trace_counts=False,
                    pool=shared_pool(device),
                )
                if replay:
                    graphed = importlib.import_module("moekit.hopper.graphed").GraphedKernel
                    kernel = graphed(kernel, max_graphs=REPLAY_GRAPHS, max_tokens=REPLAY_MAX_TOKENS)
                self._kernels[key] = kernel
            self._kernels.move_to_end(key)
            while len(self._kernels) > self.size:
                self._kernels.popitem(last=False)
            return self._kernels[key]

    def kernels(self) -> list:
        """The kernels kept now (a ModularKernel, or a GraphedKernel around one), least recently used first."""
        with self._lock:
            return list(self._kernels.values())


KERNELS = KernelCache()  # the process's fused_moe kernels


def fused_moe(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    experts: str = "triton",
    chunk_size: int | None = None,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    replay: bool = True,
) -> torch.Tensor:
    """Run one MoE layer: ``[M, K] -> [M, K]``.

    The quantization scheme follows the weights: fp8 ``w1``/``w2`` (with 128x128 block scales)
    select ``QuantScheme.FP8_BLOCK``, anything else runs unquantized. The modular kernels behind
    this call are cached per (experts, chunk size, scheme, device), at most 16 of them, and share
    one workspace pool per device; calls from several threads take turns on it.

    Args:
        hidden: ``[M, K]`` activations. w1: ``[E, N, K]``. w2: ``[E, K, N/2]``.
        topk_weights, topk_ids: ``[M, topk]`` from :func:`moekit.routing.route`.
        experts: a name of :data:`BY_NAME` ("triton", "deep_gemm", "triton_or_deep_gemm",
            "grouped_mm").
        chunk_size: tokens per chunk (None: one chunk).
        expert_map, global_num_experts: expert parallelism within one process (see
            :class:`moekit.ModularKernel`).
        w1_scale, w2_scale: fp8 block scales.
        replay: on a CUDA GPU, up to :data:`REPLAY_MAX_TOKENS` tokens, replay a CUDA graph per
            signature (:class:`moekit.hopper.graphed.GraphedKernel`, which says what it keeps:
            the first call with a shape runs the plain forward and captures, M rounds up to a power
            of two, the weights stay where they are); the same result within the dtype's tolerance,
            without the host's cost of five launches. False: always the plain forward.

    Raises:
        ChunkSizeError, InvalidInputError, InvalidIdsError, QuantizationError: bad arguments
            (the same errors as :class:`moekit.ModularKernel`).

    Example::

        weights, ids = moekit.routing.route(logits, topk=2)
        out = moekit.fused_moe(x, w1, w2, weights, ids, chunk_size=64)
    """
    chunk_size = validate_chunk_size(chunk_size)  # before the cache: True == 1 and 4.0 == 4 as keys
    if not isinstance(experts, str) or experts not in BY_NAME:  # (a known name is checked where its kernel is made)
        experts_class(experts)  # raises, naming the choices
    replay = check_flag(replay, "replay")
    quant = QuantScheme.FP8_BLOCK if isinstance(w1, torch.Tensor) and w1.dtype == FP8 else QuantScheme.NONE
    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    kernel = KERNELS.get(experts, chunk_size, quant, device, replay=replay and device.type == "cuda")
    return kernel(
        hidden,
        w1,
        w2,
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        global_num_experts=global_num_experts,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
    )
