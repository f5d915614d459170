"""Checks of the Triton exercises (4: the count kernels, 5: the align kernel).

Each launches the learner's ``@triton.jit`` kernel with a fixed signature and grid on cases
drawn by a :class:`moekit.workbook.cases.Sampler`: every ids dtype and kind of expert map, -1
slots, ids past the map, >= E_local without one, >= num_experts and >= NUM_BINS, ids that a
narrower int turns into a local expert (2**32 + e in int64: in the interpreter only), BLOCK (and
BLOCK_M) among several sizes, empty input, whole tiles and one id past them, experts with 0, 1
and exactly a multiple of BLOCK_M pairs, int16 ids of one expert past int16's limit (past int8's
in a tile), and E_local = NUM_BINS - 1 past 127 (past 255 for the one-pass count). Every tensor
sits inside a larger buffer whose margins hold 0, a valid expert, so a kernel that strays past
its tensors reads numbers it can miscount instead of memory it does not own. Inputs are compared
before and after.

Under the interpreter the checks also watch *how* the kernel ran
(:func:`moekit.workbook.probes.watch_memory`): that a Triton kernel ran, read every id and
wrote every result itself (a host function behind ``__getitem__`` launches nothing); every
lane outside the given tensors, any write to an input, any non-atomic write that two programs
make to one element (the interpreter runs programs one after another, so a race never shows in
the answer), ``tl.histogram`` values outside its bins (a GPU keeps their low bits), which
program read which ids, the work done per id, and (the align) a program that reads an element it wrote (or
writes one it read) with no ``tl.debug_barrier()`` between (on a GPU its threads do not wait
for each other; the interpreter runs them in order). A scan in disguise, a one-program
"histogram" or a load-add-store counter gives the right answer here and still fails. On a GPU
the checks require a :class:`triton.runtime.jit.JITFunction` and see only the answers.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from moekit.device import get_device, interpreting
from moekit.reference import count_reference
from moekit.workbook.cases import BLOCKS, HOT_INT16, Batch, Sampler, num_bins
from moekit.workbook.checks import difference, fail
from moekit.workbook.probes import MemoryOps, is_triton_kernel, watch_inputs, watch_memory

BLOCK_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the align's block sizes
PROGRAMS = 120  # at most this many programs (or scan steps, per expert) per drawn case: the interpreter runs each
WORK_SLACK = 16  # element operations a one-pass count may spend per bin and program
# 256 ids: whole tiles of every BLOCK; 257: one id past them
COUNT_EDGES = ({"M": 0}, {"M": 1, "E": 1}, {"M": 128, "topk": 2}, HOT_INT16, {"M": 257, "topk": 1, "E": 4})
WRAP_BITS = 32 if interpreting() else 0  # ids of 2**b + e (b = 8, 16, 32): a GPU kernel gathering there unmasked faults
UNWRITTEN = -12345  # what the align's expert_ids hold before the kernel: -1 past the last block is a write too
INPUTS = ("ids", "map")  # what the kernels read and must never write (the align kernel takes no map)


def _require_kernel(what: str, kernel) -> None:
    if not is_triton_kernel(kernel):
        fail(f"{what} is a {type(kernel).__name__}, not a @triton.jit function: the exercise is a Triton kernel")


def _launch(kernel, grid, case: str, tensors: dict, *sizes, margin: int, **meta):
    """``kernel[grid](*tensors, *sizes, **meta)`` on copies of ``tensors``, each inside a buffer
    with ``margin`` zeros on each side (a None tensor passes the ids in its place), watched under
    the interpreter; fails when it changed one of the :data:`INPUTS` or wrote into a margin (on a
    GPU; the interpreter's watch does not run stray lanes). Returns the copies by name, and the
    MemoryOps (None on a GPU)."""
    pad = {
        n: torch.nn.functional.pad(t.reshape(-1).to(get_device()), (margin, margin))
        for n, t in tensors.items()
        if t is not None
    }
    bufs = {n: pad[n][margin:-margin] if n in pad else None for n in tensors}
    watched = watch_memory(**bufs) if interpreting() else contextlib.nullcontext(None)
    with watch_inputs(**{n: bufs[n] for n in INPUTS if n in bufs}) as changed, watched as ops:
        if grid[0]:
            kernel[grid](*(bufs["ids"] if t is None else t for t in bufs.values()), *sizes, **meta)
    if changed:
        fail(f"{case} changed its input {changed[0]}: inputs are read-only")
    strays = [n for n, b in pad.items() if b[:margin].any() or b[-margin:].any()]
    if strays:
        fail(f"{case} wrote past its tensor '{strays[0]}' (into the zeros around it): mask every lane past a tensor")
    return bufs, ops


def _check_ran(case: str, ops, numel: int, results: dict) -> None:
    """A Triton kernel did the work: it ran, read every id and wrote every result (``results``:
    element indices per tensor); a host function behind ``__getitem__`` launches nothing."""
    if (numel or any(len(want) for want in results.values())) and not ops.launches:
        fail(f"{case}: no Triton kernel ran (the interpreter saw no launch): the work must happen in the kernel")
    if len(ops.read_set("ids")) < numel:
        fail(f"{case}: the kernel read {len(ops.read_set('ids'))} of the {numel} ids; it must read every id itself")
    for t, want in results.items():
        missed = sorted(set(want) - set(ops.written(t).tolist()))
        if missed:
            fail(f"{case}: the kernel never wrote {t}[{missed[0]}], which holds a result: the kernel writes them all")


def _check_memory(case: str, ops) -> None:
    """What every kernel of the workbook must respect, whatever its algorithm (only the count
    kernels' programs share a tensor, ``out``: the align kernel runs one program)."""
    stray = {k: v for k, v in ops.outside.items() if v}
    if stray:
        lanes = ", ".join(f"{v} {k} lanes" for k, v in stray.items())
        fail(
            f"{case} touched memory outside its tensors ({lanes}): mask every lane that is past the ids, "
            "or an id that is negative, past the map or >= E"
        )
    for t in INPUTS:
        if ops.writes(t):
            fail(f"{case} wrote {ops.writes(t)} elements of '{t}', an input (an atomic on it writes too)")
    races = ops.races("out")
    if races:
        fail(
            f"{case}: programs wrote out without an atomic where another program also touched it "
            f"({races[0]}{' and more' if len(races) > 1 else ''}): on a GPU they run at once and updates are "
            "lost; the interpreter runs them one by one and cannot show it"
        )
    if ops.histogram_misses:
        p, v, bins = ops.histogram_misses[0]
        fail(
            f"{case}: program {p} gave tl.histogram the value {v} with {bins} bins; a GPU keeps only the "
            "low bits (it lands in another bin): send ids that must not count to the spare bin"
        )


def _check_programs(case: str, ops, numel: int, E_local: int, block: int, *, scan: bool) -> None:
    """How the work is split: the scan's programs each walk every id and store their own
    expert; the one-pass count's programs each read their own tile, each id once."""
    if scan:
        for p in range(E_local):
            if len(ops.read_set("ids", p)) < numel:
                fail(
                    f"{case}: program {p} read {len(ops.read_set('ids', p))} of the {numel} ids; in the seed's scan "
                    "every program walks every id (its expert's count)"
                )
        for p in range(E_local):
            others = [int(i) for i in ops.written("out", p) if i != p]
            if others:
                fail(
                    f"{case}: program {p} wrote out[{others[0]}]; each program stores its own expert's "
                    "count, at out_ptr + program_id"
                )
        return
    if ops.reads("ids") > numel:
        fail(
            f"{case} read ids {ops.reads('ids')} times for {numel} "
            f"({ops.reads('ids') / numel:.1f} per id, loads and atomics alike): a one-pass count reads each id once"
        )
    if ops.reads("map") > numel:
        fail(f"{case} read the map {ops.reads('map')} times for {numel} ids: gather it at most once per id")
    for p in sorted(ops.programs):
        if ops.reads("ids", p) > block:
            fail(
                f"{case}: program {p} read {ops.reads('ids', p)} ids, more than its tile of BLOCK={block}"
                f"{' (all the work in one program)' if ops.reads('ids', p) >= numel else ''}: the grid has one "
                "program per tile, and each counts its own tile"
            )


def _count_case(kernel, b: Batch, block: int, case: str, *, scan: bool) -> MemoryOps | None:
    """One case of a count kernel: launch it once, as the exercise's text says; compare with the
    reference; under the interpreter, check how it ran. Returns the MemoryOps (None on a GPU)."""
    numel, has_map = b.ids.numel(), b.expert_map is not None
    grid = (b.num_local,) if scan else (-(-numel // block),)  # one program per expert, or per tile
    meta = {"HAS_MAP": has_map, "BLOCK": block} | ({} if scan else {"NUM_BINS": num_bins(b.num_local)})
    tensors = {"ids": b.ids, "map": b.expert_map, "out": torch.zeros(b.num_local, dtype=torch.int32)}
    limit, margin = b.routing.E if has_map else b.num_local, num_bins(b.routing.E) + block
    bufs, ops = _launch(kernel, grid, case, tensors, numel, limit, b.num_local, margin=margin, **meta)
    got, want = bufs["out"].long().cpu().tolist(), count_reference(b.ids, b.num_local, b.expert_map).tolist()
    if got != want:
        fail(f"{case}: got {difference(got, want)}")
    if ops is not None:
        _check_memory(case, ops)
        _check_ran(case, ops, numel, {"out": [e for e, n in enumerate(want) if n]})
        if numel:
            _check_programs(case, ops, numel, b.num_local, block, scan=scan)
    return ops


def _check_work(kernel, sampler: Sampler) -> None:
    """A one-pass count does a fixed amount of work per id: going from 4 to 120 local experts
    may add work per bin (the histogram is wider), never per id and expert."""
    rt = sampler.routing(0, M=128, topk=2, E=120, map="none")
    ids, block, work = sampler.batch(rt).ids, 64, {}
    for E_local in (4, 120):
        sampler.new_case(f"histogram_kernel on {rt}, E_local={E_local}, BLOCK={block}")
        work[E_local] = _count_case(kernel, Batch(rt, ids, None, E_local), block, sampler.case, scan=False).total_work
    programs, extra_bins, grown = ids.numel() // block, num_bins(120) - num_bins(4), work[120] - work[4]
    if grown > WORK_SLACK * extra_bins * programs:
        fail(
            f"histogram_kernel: its work grew from {work[4]} to {work[120]} element operations when E_local went "
            f"from 4 to 120 ({grown / ids.numel():.0f} more per id): a one-pass count does a fixed amount of work "
            "per id, whatever the number of experts (a loop over experts in registers is a scan)"
        )


def _check_counts(kernel, sampler: Sampler, *, scan: bool) -> None:
    what = "scan_kernel" if scan else "histogram_kernel"
    _require_kernel(what, kernel)
    wide = {"E": 255, "map": "none"} if scan else {"E": 511, "map": "none", "M": 64, "topk": 8}  # = NUM_BINS - 1
    for rt in sampler.routings(6, *COUNT_EDGES, wide, max_experts=48 if scan else 512):
        block = sampler.rng.choice(BLOCKS[-1:] if rt.hot else BLOCKS)
        if not rt.hot:  # the interpreter runs every program (and the scan every step) in Python; a tile at least
            most = PROGRAMS * block // (rt.topk * (rt.num_local if scan else 1))
            rt = replace(rt, M=min(rt.M, max(most, -(-block // rt.topk))))
        sampler.new_case(f"{what} on {rt}, BLOCK={block}")
        _count_case(kernel, sampler.batch(rt, block=block, wrap_bits=WRAP_BITS), block, sampler.case, scan=scan)
    if interpreting() and not scan:
        _check_work(kernel, sampler)


def check_scan_kernel(kernel, *, sampler: Sampler) -> None:
    """The seed's algorithm: one program per local expert, each walking every id."""
    _check_counts(kernel, sampler, scan=True)


def check_histogram_kernel(kernel, *, sampler: Sampler) -> None:
    """One pass: right counts, and (under the interpreter) one tile per program, each id and map
    entry read once, atomics where programs meet, and work per id independent of E."""
    _check_counts(kernel, sampler, scan=False)


# ---------------------------------------------------------------------------------------------
# 5. moe_align_block_size


def check_align_kernel(kernel, *, sampler: Sampler) -> None:
    """``align_kernel`` (one program) sorts the pairs by expert and pads each expert to BLOCK_M.
    Any order of an expert's pairs inside its run is accepted (atomics assign the rows); every
    block's expert id is checked, and nothing past ``num_tokens_post_padded`` may be written.
    Under the interpreter, once every answer is right, a program's store and a later load of the
    same element (or a load and a later atomic) need a ``tl.debug_barrier()`` between."""
    _require_kernel("align_kernel", kernel)
    unordered = None  # the first case without a barrier where one is needed: told after the answers
    for rt in sampler.routings(6, *COUNT_EDGES, {"E": 255}, map="none", max_experts=256):  # 255 = NUM_BINS - 1
        block_m = sampler.rng.choice(BLOCK_MS[5:] if rt.hot else BLOCK_MS)
        block = sampler.rng.choice(BLOCKS[-1:] if rt.hot else BLOCKS)
        rt = rt if rt.hot else replace(rt, M=min(rt.M, 4 * PROGRAMS * block_m // rt.topk))  # blocks, one store each
        ids, E, bins = sampler.batch(rt, block=block_m, wrap_bits=WRAP_BITS).ids.reshape(-1), rt.E, num_bins(rt.E)
        numel, bound = ids.numel(), ids.numel() + E * (block_m - 1)  # the most rows E padded runs can take
        sampler.new_case(f"align_kernel on {rt}, BLOCK_M={block_m}, BLOCK={block}")
        tensors = {
            "ids": ids,
            "sorted": torch.full((max(bound, 1),), numel, dtype=torch.int32),
            "expert_ids": torch.full((max(bound // block_m + 1, 1),), UNWRITTEN, dtype=torch.int32),
            "post": torch.zeros(1, dtype=torch.int32),
            "cursor": torch.zeros(bins, dtype=torch.int32),
        }
        meta = {"BLOCK_M": block_m, "BLOCK": block, "NUM_BINS": bins}
        bufs, ops = _launch(kernel, (1,), sampler.case, tensors, numel, E, margin=bins + block, **meta)
        padded = (count_reference(ids, E).long() + block_m - 1) // block_m * block_m  # each expert's run of rows
        total, blocks = int(padded.sum()), int(padded.sum()) // block_m
        srt, eid, post = bufs["sorted"].cpu(), bufs["expert_ids"].cpu(), bufs["post"].item()
        if ops is not None:
            _check_memory(sampler.case, ops)
        if post != total:
            fail(f"{sampler.case}: num_tokens_post_padded {post}, expected {total}")
        for e, end in enumerate(padded.cumsum(0).tolist()):
            start = end - int(padded[e])
            pairs = sorted(p for p in srt[start:end].tolist() if p != numel)
            want = (ids == e).nonzero().flatten().tolist()
            if pairs != want:
                fail(
                    f"{sampler.case}: rows [{start}, {end}) of expert {e} hold {len(pairs)} pairs "
                    f"{pairs[:4]}..., expected {len(want)}: {want[:4]}..."
                )
        want_blocks = torch.repeat_interleave(torch.arange(E), padded // block_m)
        if not torch.equal(eid[:blocks].long(), want_blocks):
            bad = int((eid[:blocks].long() != want_blocks).nonzero()[0])
            fail(
                f"{sampler.case}: expert_ids of the {blocks} blocks: block {bad} holds {int(eid[bad])}, "
                f"expected {int(want_blocks[bad])}"
            )
        if (srt[total:] != numel).any() or (eid[blocks:] != UNWRITTEN).any():
            fail(
                f"{sampler.case}: wrote past num_tokens_post_padded={total} (sorted rows or expert_ids "
                "after the last block): those rows belong to no expert"
            )
        if ops is not None:
            rows = (srt[:total] != numel).nonzero().flatten().tolist()
            _check_ran(sampler.case, ops, numel, {"post": [0], "expert_ids": range(blocks), "sorted": rows})
            unordered = unordered or (hit := ops.unordered()) and (sampler.case, *hit)
    if unordered:  # on a GPU each lane is a thread: one thread's store is not ordered before another's load
        case, t, program, i = unordered
        fail(
            f"{case}: program {program} touched {t}[{i}] by a store, load or atomic, then by another kind, with no "
            "tl.debug_barrier() between: on a GPU another of its threads may get there first (unseen here)"
        )


__all__ = ["BLOCK_MS", "check_align_kernel", "check_histogram_kernel", "check_scan_kernel"]
