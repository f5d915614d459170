"""Tokens per local expert: ``count_expert_num_tokens`` (the bug-2 fix of PR #20392).

Shapes (M tokens, topk slots per token, E_local experts on this rank, E_global in the map)::

    topk_ids     [M, topk] or [numel]   global expert ids; -1 = empty slot
    expert_map   [E_global]             global id -> local id, or -1 (another rank's expert)
    out          int32 [E_local]        (token, slot) pairs routed to each local expert

Two algorithms:

- ``"scan"``: the seed's kernel. One program per local expert reads *every* id: O(E_local x numel)
  loads. Kept because it is the easiest to read, and to show what it costs.
- ``"histogram"``: one pass (``moekit.kernels.count_histogram``). Each program reads its tiles of
  ids once and builds a partial histogram with ``tl.histogram``; in one launch, the partials are
  added into a cached accumulator and the last program to finish writes the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import InvalidIdsError, InvalidInputError
from moekit.kernels.count_histogram import (  # noqa: F401  (_count_histogram_kernel: read by notebook 04)
    DEFAULT_VARIANT,
    MAX_NUMEL,
    _count_histogram_kernel,
    count_histogram,
)
from moekit.validate import check_expert_map, check_ids

METHODS = ("histogram", "scan")
_MAX_BLOCK = 2**16
# Private knob for benchmarks and tests: which count_histogram.VARIANTS entry "histogram" runs.
_HISTOGRAM_VARIANT = DEFAULT_VARIANT


@dataclass(frozen=True)
class HistogramTuning:
    """Launch shape of ``method="histogram"`` (the bench sweeps these on a GPU).

    - ``block``: ids per tile, a power of two in [32, 65536] (small inputs use a smaller tile).
    - ``programs_per_sm``: the grid is ``min(tiles, SMs * programs_per_sm)``; each program
      loops over every ``grid``-th tile, so a large input costs few programs and few atomics.
    - ``num_warps``: warps per program.
    """

    block: int = 4096
    programs_per_sm: int = 2
    num_warps: int = 16

    def __post_init__(self):
        for name in ("block", "programs_per_sm", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"HistogramTuning.{name} must be a positive int, got {value!r}")
        for name in ("block", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise InvalidInputError(f"HistogramTuning.{name} must be a power of two, got {value}")
        if not 32 <= self.block <= _MAX_BLOCK:
            raise InvalidInputError(f"HistogramTuning.block must be in [32, {_MAX_BLOCK}], got {self.block}")


@triton.jit
def _count_scan_kernel(
    # Pointers
    ids_ptr, map_ptr, out_ptr,
    # Sizes
    numel, id_limit, num_local,
    # Meta-parameters
    HAS_MAP: tl.constexpr, BLOCK: tl.constexpr,
):
    p = tl.program_id(0)  # the local expert this program counts
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for t in range(tl.cdiv(numel, BLOCK)):
        idx = t * BLOCK + offs
        ids = tl.load(ids_ptr + idx, mask=idx < numel, other=-1)
        # Compare in the ids' own dtype: casting an int64 id to int32 first could wrap it into range.
        ok = (idx < numel) & (ids >= 0) & (ids < id_limit)
        local = tl.where(ok, ids, 0)
        if HAS_MAP:
            # A masked gather, never an `if` on a tensor; lanes with a bad id read nothing.
            local = tl.load(map_ptr + local, mask=ok, other=-1)
            ok = ok & (local >= 0) & (local < num_local)
        acc += (ok & (local == p)).to(tl.int32)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


def _check(topk_ids, num_local_experts, expert_map, method, tuning) -> None:
    if method not in METHODS:
        raise InvalidInputError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(num_local_experts, int) or isinstance(num_local_experts, bool) or num_local_experts <= 0:
        raise InvalidInputError(f"num_local_experts must be a positive int, got {num_local_experts!r}")
    check_ids(topk_ids, rank=None)
    if topk_ids.dim() not in (1, 2):
        raise InvalidIdsError(f"topk_ids must be 1-D [numel] or 2-D [M, topk], got shape {tuple(topk_ids.shape)}")
    if topk_ids.numel() > MAX_NUMEL:
        raise InvalidInputError(f"at most {MAX_NUMEL} ids per call (int32 offsets), got {topk_ids.numel()}")
    if topk_ids.device.type == "cpu" and not interpreting():
        raise InvalidInputError("topk_ids is on the CPU but Triton compiles for CUDA; move it to the GPU")
    check_expert_map(expert_map, num_local_experts=num_local_experts, device=topk_ids.device)
    if expert_map is not None and expert_map.device != topk_ids.device:
        raise InvalidIdsError(f"expert_map is on {expert_map.device}, topk_ids on {topk_ids.device}")
    if tuning is not None and (method != "histogram" or not isinstance(tuning, HistogramTuning)):
        raise InvalidInputError(f"tuning must be a HistogramTuning for method='histogram', got {tuning!r}")


def count_expert_num_tokens(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    method: str = "histogram",
    tuning: HistogramTuning | None = None,
) -> torch.Tensor:
    """How many (token, slot) pairs go to each local expert, as int32 ``[num_local_experts]``.

    The algorithm, in plain Python (``limit`` is ``len(expert_map)`` with a map, else
    ``num_local_experts``)::

        counts = [0] * num_local_experts
        for g in topk_ids.flatten():              # one global expert id per (token, slot)
            if not 0 <= g < limit:                # -1 = empty slot; beyond the map = not local
                continue
            e = expert_map[g] if expert_map is not None else g
            if 0 <= e < num_local_experts:        # -1 = the expert lives on another rank
                counts[e] += 1

    Example: rank 1 of 2 holds global experts 3, 4, 5 as local 0, 1, 2::

        topk_ids   = [[0, 3], [3, -1], [5, 1]]
        expert_map = [-1, -1, -1, 0, 1, 2]
        count_expert_num_tokens(topk_ids, 3, expert_map)   # -> [2, 0, 1]
        count_expert_num_tokens(topk_ids, 3)               # -> [1, 1, 0] (ids 3, 5 not local)

    Pairs are counted, not tokens: a row that names one expert twice counts 2. Ids beyond the
    map (or ``>= num_local_experts`` without a map), negative ids and map entries outside
    ``[0, num_local_experts)`` are ignored on the device: nothing is read out of bounds and
    nothing syncs with the host. Empty input returns zeros without launching a kernel. Both
    methods give identical, deterministic results.

    ``"histogram"`` is one launch that keeps a small zeroed scratch per (device, stream), which
    each call leaves zeroed again; CUDA graphs share one per device, so replays of captured
    graphs must not overlap each other. Capturing before any eager count (of the same size of
    histogram) falls back to a zero-fill plus the kernel; one eager warm-up count avoids that.

    Args:
        topk_ids: contiguous int32/int64 ids, ``[M, topk]`` or ``[numel]``, on the kernels' device.
        num_local_experts: E_local > 0 (need not be a power of two).
        expert_map: optional contiguous int32/int64 ``[E_global]`` on the same device.
        method: ``"histogram"`` (one pass, the default) or ``"scan"`` (one program per expert).
        tuning: launch shape for ``"histogram"`` (defaults to :class:`HistogramTuning`).

    Returns:
        int32 ``[num_local_experts]`` on ``topk_ids.device``.

    Raises:
        InvalidIdsError: ids or map unsigned, non-integer, non-contiguous, not 1-D/2-D (ids) or
            1-D (map), or the map on another device.
        InvalidInputError: an unknown ``method``, ``num_local_experts <= 0``, a bad ``tuning``,
            CPU ids while Triton compiles for CUDA, or more than 2**31 - 2**16 ids.
    """
    _check(topk_ids, num_local_experts, expert_map, method, tuning)
    numel = topk_ids.numel()
    if numel == 0:  # upstream's block size would be next_power_of_2(0) == 0
        return torch.zeros(num_local_experts, dtype=torch.int32, device=topk_ids.device)
    if method == "histogram":
        return count_histogram(topk_ids, num_local_experts, expert_map, tuning=tuning or HistogramTuning(),
                               variant=_HISTOGRAM_VARIANT)
    out = torch.empty(num_local_experts, dtype=torch.int32, device=topk_ids.device)
    _count_scan_kernel[(num_local_experts,)](
        topk_ids, expert_map, out, numel=numel, num_local=num_local_experts, HAS_MAP=expert_map is not None,
        id_limit=expert_map.numel() if expert_map is not None else num_local_experts,
        BLOCK=triton.next_power_of_2(min(numel, 1024)),
    )
    return out
