"""Another library's routing in moekit's convention, in one pass: transformers' empty-slot marker.

transformers marks a slot whose expert lives on another rank with id ``E`` (the layer's expert
count); moekit marks it -1. Any other id outside ``[-1, E]`` is a router's bug, and on a GPU it
is not read back (that would be a host sync per layer): its weight becomes NaN instead, so the
token's output is NaN, never a plausible answer with a slot silently dropped::

    for i in range(numel):
        g = ids[i]
        out_ids[i] = -1 if g == E else g
        out_weights[i] = nan if (g < -1 or g > E) else weights[i]

One launch replaces the five elementwise torch ops this takes otherwise (each costs a few µs of
host time on a slow host, per layer, per forward). On a GPU it runs in the layer's prepare
(:class:`MarkerPrepareFinalize`), so a replayed CUDA graph holds it and a decode step spends no host
time on it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moekit.hopper.launch import run_lean
from moekit.kernels.host_math import cdiv, next_power_of_2
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.types import KernelLaunch
from moekit.validate import check_flag

_BLOCK = 1024


@triton.jit(do_not_specialize=["numel"])
def _marker_to_moekit_kernel(
    # Pointers
    ids_ptr,
    weights_ptr,
    out_ids_ptr,
    out_weights_ptr,
    # Sizes
    numel,
    E,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < numel
    g = tl.load(ids_ptr + offs, mask=live, other=-1)
    w = tl.load(weights_ptr + offs, mask=live, other=0.0)
    tl.store(out_ids_ptr + offs, tl.where(g == E, -1, g), mask=live)
    bad = (g < -1) | (g > E)
    tl.store(out_weights_ptr + offs, tl.where(bad, float("nan"), w), mask=live)


@functools.lru_cache(maxsize=1024)
def _shape(numel: int) -> tuple[tuple, int]:
    block = min(_BLOCK, max(16, next_power_of_2(numel)))
    return (cdiv(numel, block),), block


def launch_marker_to_moekit(
    ids: torch.Tensor, weights: torch.Tensor, E: int, *, stream: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, weights)`` with transformers' marker ``E`` turned into -1 and the weight of any id outside
    ``[-1, E]`` into NaN (see the module docstring). Both contiguous ``[M, topk]``, on the ids' device."""
    ids, weights = ids.contiguous(), weights.contiguous()
    out_ids, out_weights = torch.empty_like(ids), torch.empty_like(weights)
    numel = ids.numel()
    if numel == 0:
        return out_ids, out_weights
    grid, block = _shape(numel)
    args = (ids, weights, out_ids, out_weights, numel, E)
    run_lean(KernelLaunch(_marker_to_moekit_kernel, grid, args, dict(BLOCK=block)), stream=stream)
    return out_ids, out_weights


class MarkerPrepareFinalize(NoEPPrepareFinalize):
    """``NoEPPrepareFinalize`` whose prepare first converts transformers' ids (:func:`launch_marker_to_moekit`,
    with the placement's expert count as the marker: transformers' layers pass no expert_map, so it is the
    layer's) when ``convert`` is on: the integration's stage on a GPU, where the door reads no ids. On the
    CPU the door checks the ids' range, so they come converted.

    Raises:
        InvalidInputError: ``convert`` is not a bool.
    """

    def __init__(self, *, convert: bool):
        super().__init__()
        self.convert = check_flag(convert, "convert")

    def prepare(self, hidden, topk_weights, topk_ids, *, quant, placement):
        if self.convert:
            topk_ids, topk_weights = launch_marker_to_moekit(topk_ids, topk_weights, placement.global_num_experts)
        return super().prepare(hidden, topk_weights, topk_ids, quant=quant, placement=placement)
