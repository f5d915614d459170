"""Tokens per local expert: ``count_expert_num_tokens`` (the bug-2 fix of PR #20392).

Shapes (M tokens, topk slots per token, E_local experts on this rank, E_global in the map)::

    topk_ids     [M, topk] or [numel]   global expert ids; -1 = empty slot
    expert_map   [E_global]             global id -> local id, or -1 (another rank's expert)
    out          int32 [E_local]        (token, slot) pairs routed to each local expert

Two algorithms, both exact and deterministic:

- ``"scan"``: the seed's kernel. One program per local expert reads *every* id, so the work is
  ``E_local x numel`` loads. Kept because it is the easiest to read, and to show what it costs.
- ``"histogram"`` (the default): one pass. A small grid of programs strides over tiles of ids;
  each reads its tiles once and bins them with ``tl.histogram`` into a partial histogram held in
  registers, then adds it to ``out`` with one atomic per non-empty bin. With a single program
  (every per-chunk count, up to 4096 ids) the histogram is stored directly: one launch. With
  several, ``out`` is zero-filled first: two launches. Integer adds commute, so the order in
  which programs finish changes nothing.

Nothing persists between calls: no cached scratch, no counter. A call that is interrupted (a
Ctrl-C under the interpreter stops a launch half way) cannot leave state behind that a later
call would read, and concurrent calls on different streams or threads share nothing.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import InvalidIdsError, InvalidInputError
from moekit.types import KernelLaunch
from moekit.validate import check_expert_map, check_ids, check_kernel_device, check_num_experts, check_numel

METHODS = ("histogram", "scan")
_BLOCK = 4096  # ids per tile of the histogram (smaller inputs take a smaller tile)
_PROGRAMS_PER_SM = 2  # the histogram's grid is at most this many programs per SM
_INTERPRETER_SMS = 2  # a pretend SM count: few programs under the interpreter, but more than one
# tl.histogram takes a `mask` in Triton 3.6 and 3.9. On a release without it, invalid ids go to a
# spare bin instead (one more bin, same result); `launch_count(masked=False)` takes that path anywhere.
_HISTOGRAM_HAS_MASK = "mask" in inspect.signature(tl.histogram).parameters


@triton.jit
def _local_ids(ids, map_ptr, id_limit, num_local, HAS_MAP: tl.constexpr):
    """(local expert, valid) for each id: -1 slots, ids past the map and remote experts are invalid."""
    # Compare in the ids' own dtype: casting an int64 id to int32 first could wrap it into range.
    ok = (ids >= 0) & (ids < id_limit)
    local = tl.where(ok, ids, 0)
    if HAS_MAP:  # a compile-time branch; the gather is masked, so a bad id reads nothing
        local = tl.load(map_ptr + local, mask=ok, other=-1)
        ok = ok & (local >= 0) & (local < num_local)
    return tl.where(ok, local, 0).to(tl.int32), ok


@triton.jit
def _count_scan_kernel(
    # Pointers
    ids_ptr,
    map_ptr,
    out_ptr,
    # Sizes
    numel,
    id_limit,
    num_local,
    # Meta-parameters
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0)  # the local expert this program counts
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for t in range(tl.cdiv(numel, BLOCK)):
        idx = t * BLOCK + offs
        ids = tl.load(ids_ptr + idx, mask=idx < numel, other=-1)
        local, ok = _local_ids(ids, map_ptr, id_limit, num_local, HAS_MAP)
        acc += (ok & (local == p)).to(tl.int32)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


@triton.jit
def _load_tile(ids_ptr, t, num_tiles, numel, BLOCK: tl.constexpr):
    # A tile past the last one (a prefetch) reads nothing; clamping t keeps its int32 offsets in range.
    idx = tl.minimum(t, num_tiles - 1) * BLOCK + tl.arange(0, BLOCK)
    end = tl.where(t < num_tiles, numel, 0)
    return tl.load(ids_ptr + idx, mask=idx < end, other=-1)  # -1: an empty slot, never counted


@triton.jit(do_not_specialize=["numel"])  # numel changes with every chunk: no recompiles
def _count_histogram_kernel(
    # Pointers
    ids_ptr,
    map_ptr,
    out_ptr,
    # Sizes
    numel,
    id_limit,
    num_local,
    # Meta-parameters
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    MASKED: tl.constexpr,
    SOLO: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    num_tiles = tl.cdiv(numel, BLOCK)
    hist = tl.zeros([NUM_BINS], dtype=tl.int32)
    ahead = _load_tile(ids_ptr, pid, num_tiles, numel, BLOCK)
    for t in range(pid, num_tiles, step):
        ids = ahead  # the next tile's load is in flight while this one is binned
        ahead = _load_tile(ids_ptr, t + step, num_tiles, numel, BLOCK)
        local, ok = _local_ids(ids, map_ptr, id_limit, num_local, HAS_MAP)
        # On a GPU tl.histogram keeps only the low log2(NUM_BINS) bits of each value, so every
        # value it sees must be a valid bin: invalid lanes are masked, or sent to a spare bin.
        if MASKED:
            hist += tl.histogram(local, NUM_BINS, mask=ok)
        else:
            hist += tl.histogram(tl.where(ok, local, NUM_BINS - 1), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    keep = bins < num_local
    if SOLO:  # the only program: its histogram is the answer (out is uninitialized)
        tl.store(out_ptr + bins, hist, mask=keep)
    else:  # out was zero-filled; one relaxed atomic per non-empty bin
        tl.atomic_add(out_ptr + bins, hist, mask=keep & (hist > 0), sem="relaxed")


@functools.cache
def _sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (asked once per device)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=1024)  # a pure function of its arguments, asked once per count
def _histogram_launch(numel: int, bins_needed: int, device: torch.device) -> tuple[int, int, int, int]:
    """(block, grid, num_warps, bins) for ``numel > 0`` ids: a tile as large as the input up to
    4096 ids, and at most ``2 x SMs`` programs, each striding over every grid-th tile."""
    if device.type == "cuda" and not interpreting():
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = _INTERPRETER_SMS
    bins = max(32, triton.next_power_of_2(bins_needed))
    block = min(_BLOCK, max(128, triton.next_power_of_2(numel)))
    grid = min(triton.cdiv(numel, block), sms * _PROGRAMS_PER_SM)
    return block, grid, max(1, min(16, block // 128)), bins


def _check(topk_ids, num_local_experts, expert_map, method) -> None:
    if method not in METHODS:
        raise InvalidInputError(f"method must be one of {METHODS}, got {method!r}")
    check_num_experts(num_local_experts, "num_local_experts")
    check_ids(topk_ids, rank=None)
    if topk_ids.dim() not in (1, 2):
        raise InvalidIdsError(f"topk_ids must be 1-D [numel] or 2-D [M, topk], got shape {tuple(topk_ids.shape)}")
    check_numel(topk_ids)
    check_kernel_device(topk_ids, "topk_ids")
    check_expert_map(expert_map, device=topk_ids.device)


def count_expert_num_tokens(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None = None, *, method: str = "histogram"
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
    nothing syncs with the host. Empty input returns zeros without launching a kernel (upstream's
    block size would have been ``next_power_of_2(0) == 0``).

    Args:
        topk_ids: contiguous int32/int64 ids, ``[M, topk]`` or ``[numel]``, on the kernels' device.
        num_local_experts: E_local > 0 (need not be a power of two).
        expert_map: optional contiguous int32/int64 ``[E_global]`` on the same device.
        method: ``"histogram"`` (one pass, the default) or ``"scan"`` (one program per expert).

    Returns:
        int32 ``[num_local_experts]`` on ``topk_ids.device``.

    Raises:
        InvalidIdsError: ids or map unsigned, non-integer, non-contiguous, not 1-D/2-D (ids) or
            1-D (map), or the map on another device.
        InvalidInputError: an unknown ``method``, ``num_local_experts`` not a positive int, ids on
            a device Triton cannot run on (the meta device, or the CPU while Triton compiles for
            CUDA), or more than ``moekit.validate.MAX_IDS`` ids.
    """
    _check(topk_ids, num_local_experts, expert_map, method)
    return launch_count(topk_ids, num_local_experts, expert_map, method=method)


def count_launch(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    method: str = "histogram",
    out: torch.Tensor | None = None,
    masked: bool = _HISTOGRAM_HAS_MASK,
) -> tuple[torch.Tensor, KernelLaunch | None]:
    """``(out, launch)`` of :func:`count_expert_num_tokens` unchecked: ``out`` allocated (or the one
    given) and zeroed where the launch adds into it; ``masked=False``: bad ids to a spare bin."""
    numel = topk_ids.numel()
    device = topk_ids.device
    if numel == 0:
        return (torch.zeros(num_local_experts, dtype=torch.int32, device=device) if out is None else out.zero_()), None
    limit = expert_map.numel() if expert_map is not None else num_local_experts
    has_map = expert_map is not None
    if method == "scan":
        out = torch.empty(num_local_experts, dtype=torch.int32, device=device) if out is None else out
        block = triton.next_power_of_2(min(numel, 1024))
        args = (topk_ids, expert_map, out, numel, limit, num_local_experts)
        return out, KernelLaunch(_count_scan_kernel, (num_local_experts,), args, dict(HAS_MAP=has_map, BLOCK=block))
    block, grid, warps, bins = _histogram_launch(numel, num_local_experts + (0 if masked else 1), device)
    solo = grid == 1
    if out is None:
        out = (torch.empty if solo else torch.zeros)(num_local_experts, dtype=torch.int32, device=device)
    elif not solo:
        out.zero_()
    consts = dict(HAS_MAP=has_map, BLOCK=block, NUM_BINS=bins, MASKED=masked, SOLO=solo, num_warps=warps)
    args = (topk_ids, expert_map, out, numel, limit, num_local_experts)
    return out, KernelLaunch(_count_histogram_kernel, (grid,), args, consts)


def launch_count(topk_ids: torch.Tensor, num_local_experts: int, expert_map=None, **options) -> torch.Tensor:
    """:func:`count_expert_num_tokens` unchecked (see :func:`count_launch`); returns the counts."""
    out, launch = count_launch(topk_ids, num_local_experts, expert_map, **options)
    if launch is not None:
        launch.run()
    return out
