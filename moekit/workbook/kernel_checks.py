"""Checks of the Triton exercises (4: the count kernels, 5: the align kernel).

Each launches the learner's ``@triton.jit`` kernel with a fixed signature and grid. The ids and
the map sit inside larger buffers whose margins hold 0, a valid expert: a kernel that loads past
the ids, or gathers ``expert_map[-1]`` without a mask, counts those zeros and fails the
comparison instead of reading memory it does not own. Under the interpreter the loads are also
counted (:func:`moekit.workbook.probes.count_loads`), so a "histogram" that re-reads every id
once per expert fails even when its answer is right.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from moekit.device import interpreting
from moekit.workbook.checks import fail, random_ids
from moekit.workbook.probes import count_loads

MARGIN = 64  # zeros around the ids and the map


def _padded(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D) inside a buffer with MARGIN zeros on each side; returns the view of ``t``."""
    buf = torch.zeros(t.numel() + 2 * MARGIN, dtype=t.dtype, device=t.device)
    buf[MARGIN : MARGIN + t.numel()] = t
    return buf[MARGIN : MARGIN + t.numel()]


def _count_cases():
    """(ids, E_local, expert_map or None, name) with -1 slots, maps with -1, int32/int64, empty input."""
    from moekit.routing import contiguous_expert_map

    i32, i64 = torch.int32, torch.int64
    for M, topk, E, ep, dtype in ((50, 2, 8, 1, i32), (33, 4, 16, 2, i64), (9, 1, 1, 1, i32), (40, 3, 3, 1, i64),
                                  (0, 2, 4, 1, i32), (70, 2, 8, 4, i32)):  # fmt: skip
        ids = random_ids(M, topk, E, seed=M * 7 + E, dtype=dtype, empty_every=4)
        for rank in (0, ep - 1):
            emap = contiguous_expert_map(E, ep, rank, device="cpu").to(dtype) if ep > 1 else None
            name = f"{M}x{topk} {str(dtype)[6:]} ids, E={E}, " + (
                f"rank {rank} of {ep}" if emap is not None else "no map"
            )
            yield ids, E // ep, emap, name


def _launch_count(kernel, ids, mp, E_local, limit, *, scan: bool, block: int = 64):
    numel = ids.numel()
    out = torch.zeros(E_local, dtype=torch.int32, device=ids.device)
    if scan:
        kernel[(E_local,)](ids, mp if mp is not None else ids, out, numel, limit, E_local,
                           HAS_MAP=mp is not None, BLOCK=block)  # fmt: skip
    elif numel:
        bins = max(32, triton.next_power_of_2(E_local + 1))
        kernel[(triton.cdiv(numel, block),)](ids, mp if mp is not None else ids, out, numel, limit, E_local,
                                             HAS_MAP=mp is not None, BLOCK=block, NUM_BINS=bins)  # fmt: skip
    return out


def _check_counts(kernel, *, scan: bool) -> int:
    from moekit.device import get_device
    from moekit.reference import count_reference

    what, device, cases = ("scan_kernel" if scan else "histogram_kernel"), get_device(), 0
    for ids, E_local, emap, name in _count_cases():
        want = count_reference(ids, E_local, emap).long().tolist()
        flat = _padded(ids.reshape(-1).to(device))
        mp = _padded(emap.to(device)) if emap is not None else None
        limit = emap.numel() if emap is not None else E_local
        probe = count_loads(ids=flat, map=mp) if interpreting() else contextlib.nullcontext(None)
        with probe as loads:
            got = _launch_count(kernel, flat, mp, E_local, limit, scan=scan).long().cpu().tolist()
        if got != want:
            fail(f"{what} on {name}: got {got}, expected {want}")
        if loads is not None and not scan and ids.numel():
            if loads["ids"] > ids.numel():
                fail(f"{what} on {name} loaded {loads['ids']} ids for {ids.numel()} "
                     f"({loads['ids'] / ids.numel():.1f} per id): a one-pass count reads each id once")  # fmt: skip
            if emap is not None and loads["map"] > ids.numel():
                fail(f"{what} on {name} read the map {loads['map']} times for {ids.numel()} ids: gather it "
                     "at most once per id")  # fmt: skip
        cases += 1
    return cases


def check_scan_kernel(kernel) -> int:
    """The seed's algorithm: one program per local expert, each walking every id."""
    return _check_counts(kernel, scan=True)


def check_histogram_kernel(kernel) -> int:
    """One pass: right counts, and (under the interpreter) each id and map entry loaded at most once."""
    return _check_counts(kernel, scan=False)


# ---------------------------------------------------------------------------------------------
# 5. moe_align_block_size


def check_align_kernel(kernel) -> int:
    """``align_kernel`` (one program) sorts the pairs by expert and pads each expert to BLOCK_M.
    Any order of an expert's pairs inside its run is accepted (atomics assign the rows)."""
    from moekit.device import get_device
    from moekit.reference import count_reference

    device, cases = get_device(), 0
    for M, topk, E, block_m in ((9, 2, 3, 4), (50, 2, 8, 16), (1, 1, 1, 16), (30, 4, 5, 8), (0, 2, 4, 4)):
        ids = random_ids(M, topk, E, seed=M + E, empty_every=3).to(device)
        numel = ids.numel()
        bound = numel + E * (block_m - 1)
        sorted_ids = torch.full((max(bound, 1),), numel, dtype=torch.int32, device=device)
        expert_ids = torch.full((max(bound // block_m + 1, 1),), -1, dtype=torch.int32, device=device)
        post = torch.zeros(1, dtype=torch.int32, device=device)
        bins = max(32, triton.next_power_of_2(E + 1))
        cursor = torch.zeros(bins, dtype=torch.int32, device=device)
        kernel[(1,)](_padded(ids.reshape(-1)), sorted_ids, expert_ids, post, cursor, numel, E,
                     BLOCK_M=block_m, BLOCK=64, NUM_BINS=bins)  # fmt: skip
        counts = count_reference(ids, E).long().cpu()
        padded = (counts + block_m - 1) // block_m * block_m
        name = f"{M}x{topk} ids, E={E}, BLOCK_M={block_m}"
        if int(post.item()) != int(padded.sum()):
            fail(f"align_kernel on {name}: num_tokens_post_padded {int(post.item())}, expected {int(padded.sum())}")
        flat, srt, eid, start = ids.reshape(-1).cpu(), sorted_ids.cpu(), expert_ids.cpu(), 0
        for e in range(E):
            run = srt[start : start + int(padded[e])]
            pairs = sorted(p for p in run.tolist() if p != numel)
            want = (flat == e).nonzero().flatten().tolist()
            if pairs != want:
                fail(f"align_kernel on {name}: rows [{start}, {start + int(padded[e])}) of expert {e} hold pairs "
                     f"{pairs[:8]}..., expected {want[:8]}...")  # fmt: skip
            blocks = eid[start // block_m : (start + int(padded[e])) // block_m].tolist()
            if blocks != [e] * (int(padded[e]) // block_m):
                fail(f"align_kernel on {name}: expert_ids of expert {e}'s blocks are {blocks}")
            start += int(padded[e])
        cases += 1
    return cases


__all__ = ["check_align_kernel", "check_histogram_kernel", "check_scan_kernel"]
