"""Checks of the Triton exercises (4: the count kernels, 5: the align kernel).

Each launches the learner's ``@triton.jit`` kernel with a fixed signature and grid, on cases
built on purpose: -1 slots, maps with -1, ids beyond the map, ids >= E_local without a map, ids
>= num_experts and >= NUM_BINS, int32 and int64 ids, empty input, experts with exactly a
multiple of BLOCK_M pairs. Every tensor sits inside a larger buffer whose margins hold 0, a
valid expert, so a kernel that strays past its tensors reads numbers it can miscount instead of
memory it does not own.

Under the interpreter the checks also watch *how* the kernel ran
(:func:`moekit.workbook.probes.watch_memory`): every lane outside the given tensors, any write
to an input, any non-atomic write that two programs make to one element (the interpreter runs
programs one after another, so a race never shows in the answer), ``tl.histogram`` values
outside its bins (a GPU keeps their low bits), which program read which ids, and the work done
per id. A scan in disguise, a one-program "histogram" or a load-add-store counter gives the
right answer here and still fails.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from moekit.device import interpreting
from moekit.workbook.checks import fail, random_ids
from moekit.workbook.probes import watch_memory

MARGIN = 64  # zeros around every tensor the kernel gets
BLOCK = 64  # the ids' tile: the checks launch every count kernel with it
WORK_SLACK = 16  # element operations a one-pass count may spend per bin and program


def _padded(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D) inside a buffer with MARGIN zeros on each side; returns the view of ``t``."""
    buf = torch.zeros(t.numel() + 2 * MARGIN, dtype=t.dtype, device=t.device)
    buf[MARGIN : MARGIN + t.numel()] = t
    return buf[MARGIN : MARGIN + t.numel()]


def num_bins(n: int) -> int:
    """The histogram's bins for ids below ``n``: a power of two above n, at least 32."""
    return max(32, triton.next_power_of_2(n + 1))


def beyond(ids: torch.Tensor, limit: int, *, every: int = 5) -> torch.Tensor:
    """``ids`` with every ``every``-th slot set to an id at or past ``limit`` (limit, limit + 3,
    and one at or past the histogram's bins), which the kernel must not count."""
    out, flat = ids.clone(), ids.clone().reshape(-1)
    far = (limit, limit + 3, num_bins(limit) + 1)
    for j, i in enumerate(range(2, flat.numel(), every)):
        flat[i] = far[j % len(far)]
    assert max(far) < limit + MARGIN, "out-of-range ids stay inside the margins"
    return flat.view(out.shape)


def _count_cases():
    """(ids, E_local, expert_map or None, name): -1 slots, maps with -1, out-of-range ids,
    int32/int64, E_local = 1, one tile and several, empty input."""
    from moekit.routing import contiguous_expert_map

    i32, i64 = torch.int32, torch.int64
    for M, topk, E, ep, dtype in (
        (50, 2, 8, 1, i32),
        (33, 4, 16, 2, i64),
        (9, 1, 1, 1, i32),
        (40, 3, 3, 1, i64),
        (0, 2, 4, 1, i32),
        (70, 2, 8, 4, i32),
        (64, 2, 6, 1, i64),
    ):
        ids = random_ids(M, topk, E, seed=M * 7 + E, dtype=dtype, empty_every=4)
        if M not in (9, 64):  # (9: in range only; 64: exactly two tiles of in-range ids)
            ids = beyond(ids, E)  # past the map with one, >= E_local without
        for rank in (0, ep - 1):
            emap = contiguous_expert_map(E, ep, rank, device="cpu").to(dtype) if ep > 1 else None
            name = f"{M}x{topk} {str(dtype)[6:]} ids, E={E}, " + (
                f"rank {rank} of {ep}" if emap is not None else "no map"
            )
            yield ids, E // ep, emap, name


def _launch_count(kernel, ids, mp, out, E_local, limit, *, scan: bool):
    numel = ids.numel()
    if scan:
        kernel[(E_local,)](
            ids, mp if mp is not None else ids, out, numel, limit, E_local, HAS_MAP=mp is not None, BLOCK=BLOCK
        )
    elif numel:
        grid = (triton.cdiv(numel, BLOCK),)
        kernel[grid](
            ids,
            mp if mp is not None else ids,
            out,
            numel,
            limit,
            E_local,
            HAS_MAP=mp is not None,
            BLOCK=BLOCK,
            NUM_BINS=num_bins(E_local),
        )


def _run_count(kernel, ids, E_local, emap, *, scan: bool):
    """Launch once on padded copies; returns (counts, MemoryOps or None)."""
    from moekit.device import get_device

    device = get_device()
    flat = _padded(ids.reshape(-1).to(device))
    mp = _padded(emap.to(device)) if emap is not None else None
    out = _padded(torch.zeros(E_local, dtype=torch.int32, device=device))
    limit = emap.numel() if emap is not None else E_local
    probe = watch_memory(ids=flat, map=mp, out=out) if interpreting() else contextlib.nullcontext(None)
    with probe as ops:
        _launch_count(kernel, flat, mp, out, E_local, limit, scan=scan)
    return out.long().cpu().tolist(), ops


def _check_memory(what: str, name: str, ops, *, inputs=("ids", "map"), shared=("out",)) -> None:
    """What every kernel of the workbook must respect, whatever its algorithm."""
    stray = {k: v for k, v in ops.outside.items() if v}
    if stray:
        lanes = ", ".join(f"{v} {k} lanes" for k, v in stray.items())
        fail(
            f"{what} on {name} touched memory outside its tensors ({lanes}): mask every lane that is past the ids, "
            "or an id that is negative, past the map or >= E"
        )
    for t in inputs:
        if ops.writes(t):
            fail(f"{what} on {name} wrote {ops.writes(t)} elements of '{t}', an input (an atomic on it writes too)")
    for t in shared:
        races = ops.races(t)
        if races:
            fail(
                f"{what} on {name}: programs wrote {t} without an atomic where another program also touched it "
                f"({races[0]}{' and more' if len(races) > 1 else ''}): on a GPU they run at once and updates are "
                "lost; the interpreter runs them one by one and cannot show it"
            )
    if ops.histogram_misses:
        p, v, bins = ops.histogram_misses[0]
        fail(
            f"{what} on {name}: program {p} gave tl.histogram the value {v} with {bins} bins; a GPU keeps only the "
            "low bits (it lands in another bin): send ids that must not count to the spare bin"
        )


def _check_programs(what: str, name: str, ops, numel: int, E_local: int, *, scan: bool) -> None:
    """How the work is split: the scan's programs each walk every id and store their own
    expert; the one-pass count's programs each read their own tile, each id once."""
    if scan:
        for p in range(E_local):
            seen = ops.read_set("ids", p)
            if len(seen) < numel:
                fail(
                    f"{what} on {name}: program {p} read {len(seen)} of the {numel} ids; in the seed's scan every "
                    "program walks every id (its expert's count)"
                )
        for p in range(E_local):
            others = [int(i) for i in ops.written("out", p) if i != p]
            if others:
                fail(
                    f"{what} on {name}: program {p} wrote out[{others[0]}]; each program stores its own expert's "
                    "count, at out_ptr + program_id"
                )
        return
    if ops.reads("ids") > numel:
        fail(
            f"{what} on {name} read ids {ops.reads('ids')} times for {numel} "
            f"({ops.reads('ids') / numel:.1f} per id, loads and atomics alike): a one-pass count reads each id once"
        )
    if ops.reads("map") > numel:
        fail(f"{what} on {name} read the map {ops.reads('map')} times for {numel} ids: gather it at most once per id")
    for p in sorted(ops.programs):
        if ops.reads("ids", p) > BLOCK:
            fail(
                f"{what} on {name}: program {p} read {ops.reads('ids', p)} ids, more than its tile of BLOCK={BLOCK}"
                f"{' (all the work in one program)' if ops.reads('ids', p) >= numel else ''}: the grid has one "
                "program per tile, and each counts its own tile"
            )


def _check_work(kernel) -> int:
    """A one-pass count does a fixed amount of work per id: going from 4 to 120 local experts
    may add work per bin (the histogram is wider), never per id and expert."""
    ids = random_ids(4 * BLOCK // 2, 2, 120, seed=11)
    work = {}
    for E_local in (4, 120):
        got, ops = _run_count(kernel, ids, E_local, None, scan=False)
        if got != _count_reference(ids, E_local):
            fail(f"histogram_kernel on {ids.shape[0]}x2 ids, E={E_local}, no map: got {got}")
        work[E_local] = ops.total_work
    programs, extra_bins = 4, num_bins(120) - num_bins(4)
    grown = work[120] - work[4]
    if grown > WORK_SLACK * extra_bins * programs:
        fail(
            f"histogram_kernel: its work grew from {work[4]} to {work[120]} element operations when E_local went "
            f"from 4 to 120 ({grown / ids.numel():.0f} more per id): a one-pass count does a fixed amount of work "
            "per id, whatever the number of experts (a loop over experts in registers is a scan)"
        )
    return 1


def _count_reference(ids, E_local, emap=None):
    from moekit.reference import count_reference

    return count_reference(ids, E_local, emap).long().tolist()


def _check_counts(kernel, *, scan: bool) -> int:
    what, cases = ("scan_kernel" if scan else "histogram_kernel"), 0
    for ids, E_local, emap, name in _count_cases():
        want = _count_reference(ids, E_local, emap)
        got, ops = _run_count(kernel, ids, E_local, emap, scan=scan)
        if got != want:
            fail(f"{what} on {name}: got {got}, expected {want}")
        if ops is not None:
            _check_memory(what, name, ops)
            if ids.numel():
                _check_programs(what, name, ops, ids.numel(), E_local, scan=scan)
        cases += 1
    if interpreting() and not scan:
        cases += _check_work(kernel)
    return cases


def check_scan_kernel(kernel) -> int:
    """The seed's algorithm: one program per local expert, each walking every id."""
    return _check_counts(kernel, scan=True)


def check_histogram_kernel(kernel) -> int:
    """One pass: right counts, and (under the interpreter) one tile per program, each id and map
    entry read once, atomics where programs meet, and work per id independent of E."""
    return _check_counts(kernel, scan=False)


# ---------------------------------------------------------------------------------------------
# 5. moe_align_block_size


def _align_cases():
    """(ids, E, BLOCK_M, name): random ids with -1 and ids >= num_experts (and >= NUM_BINS),
    experts with exactly one and two blocks of pairs, one expert, empty input."""
    exact = torch.tensor([0] * 8 + [1] * 16 + [2] * 9 + [4] * 8, dtype=torch.int32)  # BLOCK_M=8: 1, 2, 2, 0, 1, 0
    yield exact[torch.randperm(exact.numel(), generator=torch.Generator().manual_seed(5))].view(-1, 1), 6, 8, "exact"
    for M, topk, E, block_m in ((9, 2, 3, 4), (50, 2, 8, 16), (1, 1, 1, 16), (30, 4, 5, 8), (0, 2, 4, 4)):
        ids = random_ids(M, topk, E, seed=M + E, empty_every=3)
        yield (beyond(ids, E) if M > 1 else ids), E, block_m, "random"


def check_align_kernel(kernel) -> int:
    """``align_kernel`` (one program) sorts the pairs by expert and pads each expert to BLOCK_M.
    Any order of an expert's pairs inside its run is accepted (atomics assign the rows); every
    block's expert id is checked, and nothing past ``num_tokens_post_padded`` may be written."""
    from moekit.device import get_device
    from moekit.reference import count_reference

    device, cases = get_device(), 0
    for ids, E, block_m, kind in _align_cases():
        ids = ids.to(device)
        numel, bins = ids.numel(), num_bins(E)
        bound = numel + E * (block_m - 1)
        sorted_ids = _padded(torch.full((max(bound, 1),), numel, dtype=torch.int32, device=device))
        expert_ids = _padded(torch.full((max(bound // block_m + 1, 1),), -1, dtype=torch.int32, device=device))
        post = _padded(torch.zeros(1, dtype=torch.int32, device=device))
        cursor = _padded(torch.zeros(bins, dtype=torch.int32, device=device))
        flat_ids = _padded(ids.reshape(-1))
        probe = (
            watch_memory(ids=flat_ids, sorted=sorted_ids, expert_ids=expert_ids, post=post, cursor=cursor)
            if interpreting()
            else contextlib.nullcontext(None)
        )
        with probe as ops:
            kernel[(1,)](
                flat_ids, sorted_ids, expert_ids, post, cursor, numel, E, BLOCK_M=block_m, BLOCK=BLOCK, NUM_BINS=bins
            )
        counts = count_reference(ids, E).long().cpu()
        padded = (counts + block_m - 1) // block_m * block_m
        total, name = int(padded.sum()), f"{ids.shape[0]}x{ids.shape[1]} ids ({kind}), E={E}, BLOCK_M={block_m}"
        if ops is not None:
            _check_memory("align_kernel", name, ops, inputs=("ids",), shared=())
        if int(post.item()) != total:
            fail(f"align_kernel on {name}: num_tokens_post_padded {int(post.item())}, expected {total}")
        flat, srt, eid, start = ids.reshape(-1).cpu(), sorted_ids.cpu(), expert_ids.cpu(), 0
        for e in range(E):
            run = srt[start : start + int(padded[e])]
            pairs = sorted(p for p in run.tolist() if p != numel)
            want = (flat == e).nonzero().flatten().tolist()
            if pairs != want:
                fail(
                    f"align_kernel on {name}: rows [{start}, {start + int(padded[e])}) of expert {e} hold pairs "
                    f"{pairs[:8]}..., expected {want[:8]}..."
                )
            start += int(padded[e])
        want_blocks = torch.repeat_interleave(torch.arange(E), padded // block_m).tolist()
        if eid[: total // block_m].tolist() != want_blocks:
            fail(
                f"align_kernel on {name}: expert_ids of the {total // block_m} blocks are "
                f"{eid[: total // block_m].tolist()[:12]}, expected {want_blocks[:12]}"
            )
        if (srt[total:] != numel).any() or (eid[total // block_m :] != -1).any():
            fail(
                f"align_kernel on {name}: wrote past num_tokens_post_padded={total} (sorted rows or expert_ids "
                "after the last block): those rows belong to no expert"
            )
        cases += 1
    return cases


__all__ = ["BLOCK", "MARGIN", "beyond", "check_align_kernel", "check_histogram_kernel", "check_scan_kernel", "num_bins"]
