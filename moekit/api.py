"""``moekit.fused_moe``: the one-call entry point (NoEP prepare/finalize + experts by name)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from moekit.experts import experts_class
from moekit.modular_kernel import ModularKernel
from moekit.plan import validate_chunk_size
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize
from moekit.quant import FP8
from moekit.types import QuantScheme
from moekit.workspace import pool_device, shared_pool


class KernelCache:
    """The modular kernels behind :func:`fused_moe`, one per (experts, chunk size, scheme, device): the
    ``size`` most recently used are kept (a kernel holds no memory of its own: the workspace pool of
    its device is shared). Thread-safe: two threads asking for one key get one kernel.
    """

    def __init__(self, size: int = 16):
        self.size = size
        self._kernels: OrderedDict[tuple, ModularKernel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, experts: str, chunk_size: int | None, quant: QuantScheme, device: torch.device) -> ModularKernel:
        """The kernel for these settings, made on first ask (on the shared pool of ``device``)."""
        key = (experts, chunk_size, quant, str(pool_device(device)))
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is None:
                kernel = ModularKernel(NoEPPrepareFinalize(), experts_class(experts)(quant=quant),
                                       chunk_size=chunk_size, trace_counts=False,
                                       pool=shared_pool(device))  # fmt: skip
                self._kernels[key] = kernel
                while len(self._kernels) > self.size:
                    self._kernels.popitem(last=False)
            self._kernels.move_to_end(key)
            return kernel

    def kernels(self) -> list[ModularKernel]:
        """The kernels kept now, least recently used first."""
        with self._lock:
            return list(self._kernels.values())

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()


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
) -> torch.Tensor:
    """Run one MoE layer: ``[M, K] -> [M, K]``.

    The quantization scheme follows the weights: fp8 ``w1``/``w2`` (with 128x128 block scales)
    select ``QuantScheme.FP8_BLOCK``, anything else runs unquantized. The modular kernels behind
    this call are cached per (experts, chunk size, scheme, device), at most 16 of them, and share
    one workspace pool per device; calls from several threads take turns on it.

    Args:
        hidden: ``[M, K]`` activations. w1: ``[E, N, K]``. w2: ``[E, K, N/2]``.
        topk_weights, topk_ids: ``[M, topk]`` from :func:`moekit.routing.route`.
        experts: a name of :data:`moekit.experts.BY_NAME` ("triton", "deep_gemm", "triton_or_deep_gemm",
            "grouped_mm").
        chunk_size: tokens per chunk (None: one chunk).
        expert_map, global_num_experts: expert parallelism within one process (see
            :class:`moekit.ModularKernel`).
        w1_scale, w2_scale: fp8 block scales.

    Raises:
        ChunkSizeError, InvalidInputError, InvalidIdsError, QuantizationError: bad arguments
            (the same errors as :class:`moekit.ModularKernel`).

    Example::

        weights, ids = moekit.routing.route(logits, topk=2)
        out = moekit.fused_moe(x, w1, w2, weights, ids, chunk_size=64)
    """
    chunk_size = validate_chunk_size(chunk_size)  # before the cache: True == 1 and 4.0 == 4 as keys
    experts_class(experts)
    quant = QuantScheme.FP8_BLOCK if isinstance(w1, torch.Tensor) and w1.dtype == FP8 else QuantScheme.NONE
    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    kernel = KERNELS.get(experts, chunk_size, quant, device)
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
