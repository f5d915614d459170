"""One-pass histogram counts of tokens per local expert: variants, their launch shape, a launcher.

The same contract as ``moekit.count_expert_num_tokens`` (int32 ``[E_local]``, exact, ids -1 and
remote experts ignored), computed in one of several ways so that a GPU can compare them.

Each program reads its tiles of ids once and counts them into a partial histogram of
``NUM_BINS >= E_local`` bins (the *binner*); the partials are then combined (the *finish*).

Binners:

- ``histogram``: ``tl.histogram`` per tile (warp ballots; its cost grows with the bin count).
- ``onehot``: a ``[BLOCK, NUM_BINS]`` compare, summed into a register tile; for few bins.
- ``atomics``: one global atomic per id into the program's own row of a cached scratch (in L2).

Finishes:

- ``memset``: ``out = torch.zeros``, then one relaxed atomic per non-empty bin per program. Two
  launches (the zero-fill, then the kernel).
- ``ticket``: one launch. The same atomics go into a cached accumulator that is zero between calls.
  Then each program takes a ticket (an acq_rel atomic on a cached counter); the program that draws
  the last one swaps the accumulator with zeros into ``out`` (``torch.empty``) and resets the
  counter to 0. Nothing is ever zero-filled again after the scratch is created.
- ``partials``: one launch. Each program stores its partial row; the last program sums the rows.

The scratch is cached per (device, stream, variant, bins, rows) and never freed (a captured CUDA
graph may point at it); CUDA graphs share one scratch per device instead of the capture stream's.
So these kernels are **stream-ordered**: counts on one stream are fine, counts on different
streams each have their own scratch, but replays of captured graphs must not overlap each other
(replay them on one stream). The first eager count creates the scratch zeroed, graphs' included;
a capture before any eager count (same variant, bins and rows) falls back to the ``memset``
variant, whose zero-fill is then a node of the graph.

``VARIANTS`` names the combinations; :func:`count_variant` runs one, with a
:class:`HistogramTuning`. Every variant gives the same exact, deterministic int32 counts. The
kernels live in :mod:`benchmarks.variants.count_variants`. moekit's own histogram is the
stateless relative of ``memset`` (one launch storing directly when one program suffices).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from benchmarks.variants.count_variants import _count_histogram_kernel, _count_histogram_single_launch_kernel
from moekit.device import interpreting
from moekit.errors import InvalidInputError
from moekit.validate import check_expert_map, check_ids, check_positive_int

# Offsets are int32 inside the kernels, and the last tile may run up to BLOCK (<= 2**16) past numel.
MAX_NUMEL = 2**31 - 2**16
_ONEHOT_CELLS = 8192  # onehot: BLOCK * NUM_BINS counters held in registers
# tl.histogram takes a `mask` in Triton 3.6 and 3.9. On a release without it, invalid ids go to a
# sentinel bin instead (one more bin, same result).
_HISTOGRAM_HAS_MASK = "mask" in inspect.signature(tl.histogram).parameters
_INTERPRETER_SMS = 2  # pretend SM count: keeps the interpreter's grid small but > 1 program
_MAX_BLOCK = 2**16


@dataclass(frozen=True)
class HistogramTuning:
    """Launch shape of a variant (the benchmarks sweep these on a GPU).

    - ``block``: ids per tile, a power of two in [32, 65536] (small inputs use a smaller tile).
    - ``programs_per_sm``: the grid is ``min(tiles, SMs * programs_per_sm)``; each program
      loops over every ``grid``-th tile, so a large input costs few programs and few atomics.
    - ``num_warps``: warps per program, a power of two.
    """

    block: int = 4096
    programs_per_sm: int = 2
    num_warps: int = 16

    def __post_init__(self):
        for name in ("block", "programs_per_sm", "num_warps"):
            check_positive_int(getattr(self, name), f"HistogramTuning.{name}")
        for name in ("block", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise InvalidInputError(f"HistogramTuning.{name} must be a power of two, got {value}")
        if not 32 <= self.block <= _MAX_BLOCK:
            raise InvalidInputError(f"HistogramTuning.block must be in [32, {_MAX_BLOCK}], got {self.block}")


@dataclass(frozen=True)
class Variant:
    """One way to count: a binner, a finish, and whether the next tile is loaded ahead."""

    binner: str  # "histogram" | "onehot" | "atomics"
    finish: str  # "memset" | "ticket" | "partials"
    prefetch: bool


VARIANTS = {
    "memset": Variant("histogram", "memset", prefetch=False),
    "ticket": Variant("histogram", "ticket", prefetch=False),
    "ticket_prefetch": Variant("histogram", "ticket", prefetch=True),
    "partials": Variant("histogram", "partials", prefetch=True),
    "ticket_onehot": Variant("onehot", "ticket", prefetch=True),
    "ticket_atomics": Variant("atomics", "ticket", prefetch=True),
}
DEFAULT_VARIANT = "ticket_prefetch"


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or interpreting():
        return _INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_GRAPHS = "graphs"  # the stream slot of the scratch that CUDA graph captures share


def _scratch(device: torch.device, spec: Variant, bins: int, rows: int) -> torch.Tensor | None:
    """Zeroed int32 ``[rows * bins | bins accumulator | counter, padded to 32]``, or None.

    Eager calls use their stream's scratch; graph captures use one per device, created zeroed by
    the first eager call (a zero-fill captured into a graph would only run when it replays, so a
    capture before any eager call gets None). Keyed by the variant too: "partials" leaves its
    rows dirty, "atomics" needs them zero.
    """
    capturing = _capturing(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, _GRAPHS if capturing else stream, spec, bins, rows)
    scratch = _SCRATCH.get(key)
    if scratch is None and not capturing:
        size = rows * bins + bins + 32
        scratch = _SCRATCH[key] = torch.zeros(size, dtype=torch.int32, device=device)
        _SCRATCH.setdefault((device, _GRAPHS, spec, bins, rows), torch.zeros_like(scratch))
    return scratch


@dataclass(frozen=True)
class Launch:
    """How one call runs: ids per tile, programs, warps, bins, tl.histogram's mask, scratch rows."""

    block: int
    grid: int
    num_warps: int
    bins: int
    masked: bool
    rows: int


def launch_shape(numel: int, num_local_experts: int, device: torch.device, tuning: HistogramTuning,
                 spec: Variant) -> Launch:
    """The launch of ``spec`` for ``numel > 0`` ids (small inputs get a smaller tile and grid)."""
    masked = spec.binner != "histogram" or _HISTOGRAM_HAS_MASK
    bins = max(32, triton.next_power_of_2(num_local_experts + (0 if masked else 1)))
    onehot = spec.binner == "onehot"
    tile = min(tuning.block, max(16, _ONEHOT_CELLS // bins)) if onehot else tuning.block
    block = min(tile, max(16 if onehot else 128, triton.next_power_of_2(numel)))
    grid = min(triton.cdiv(numel, block), _num_sms(device) * tuning.programs_per_sm)
    warps = max(1, min(tuning.num_warps, block * (bins if onehot else 1) // 128))
    rows = triton.next_power_of_2(grid) if spec.binner == "atomics" or spec.finish == "partials" else 0
    return Launch(block=block, grid=grid, num_warps=warps, bins=bins, masked=masked, rows=rows)


def count_histogram(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None,
    *,
    tuning: HistogramTuning,
    variant: str,
) -> torch.Tensor:
    """Tokens per local expert in one pass over the (validated, non-empty) ids; int32 ``[E_local]``.

    In plain Python, for one program of ``grid`` (``partial`` is the binner's work)::

        hist = [0] * num_bins
        for t in range(pid, num_tiles, grid):             # grid-stride over tiles of ids
            for e in local_ids(tile(t)):                  # mapped; invalid ids dropped
                hist[e] += 1
        finish(hist)   # memset: out += hist (atomics); ticket/partials: the last program writes out

    :func:`count_variant` validates the arguments and handles empty input; ``variant`` is a
    key of ``VARIANTS``.
    """
    spec = VARIANTS[variant]
    device = topk_ids.device
    shape = launch_shape(topk_ids.numel(), num_local_experts, device, tuning, spec)
    scratch = None if spec.finish == "memset" else _scratch(device, spec, shape.bins, shape.rows)
    if scratch is None and spec.finish != "memset":  # a graph capture before any eager count
        return count_histogram(topk_ids, num_local_experts, expert_map, tuning=tuning, variant="memset")
    args = dict(numel=topk_ids.numel(), num_local=num_local_experts, HAS_MAP=expert_map is not None,
                id_limit=expert_map.numel() if expert_map is not None else num_local_experts,
                BLOCK=shape.block, NUM_BINS=shape.bins, MASKED=shape.masked, num_warps=shape.num_warps)
    if scratch is None:
        out = torch.zeros(num_local_experts, dtype=torch.int32, device=device)
        _count_histogram_kernel[(shape.grid,)](topk_ids, expert_map, out, **args)
        return out
    out = torch.empty(num_local_experts, dtype=torch.int32, device=device)
    acc = shape.rows * shape.bins  # offsets of the accumulator and the counter in the scratch
    _count_histogram_single_launch_kernel[(shape.grid,)](
        topk_ids, expert_map, out, scratch, scratch[acc:], scratch[acc + shape.bins :], **args,
        BINNER=spec.binner, FINISH=spec.finish, PREFETCH=spec.prefetch, SOLO=shape.grid == 1,
        SUM_ROWS=max(1, _ONEHOT_CELLS // shape.bins),
    )
    return out


def count_variant(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    variant: str = DEFAULT_VARIANT,
    tuning: HistogramTuning | None = None,
) -> torch.Tensor:
    """``moekit.count_expert_num_tokens(topk_ids, num_local_experts, expert_map)`` computed by
    ``variant`` (a key of :data:`VARIANTS`) with ``tuning`` (default :class:`HistogramTuning`)."""
    if variant not in VARIANTS:
        raise InvalidInputError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    if tuning is not None and not isinstance(tuning, HistogramTuning):
        raise InvalidInputError(f"tuning must be a HistogramTuning or None, got {tuning!r}")
    check_positive_int(num_local_experts, "num_local_experts")
    check_ids(topk_ids, rank=None)
    check_expert_map(expert_map, device=topk_ids.device)
    if topk_ids.numel() > MAX_NUMEL:
        raise InvalidInputError(f"at most {MAX_NUMEL} ids per call (int32 offsets), got {topk_ids.numel()}")
    if topk_ids.numel() == 0:
        return torch.zeros(num_local_experts, dtype=torch.int32, device=topk_ids.device)
    return count_histogram(topk_ids, num_local_experts, expert_map, tuning=tuning or HistogramTuning(),
                           variant=variant)
