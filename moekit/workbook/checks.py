"""Checks of the exercises written in Python and torch (1, 2, 3 and 6).

Each ``check_*`` runs the learner's code on seeded random and edge cases against
:mod:`moekit.reference` (or the library's own plan), checks *how* where the exercise is about
how, and raises :class:`moekit.errors.ExerciseFailed` with one line naming the first failing case.
"""

from __future__ import annotations

import torch

from moekit.errors import ExerciseFailed
from moekit.types import ALIGN_M
from moekit.workbook.probes import is_view_of

MS = (0, 1, 2, 7, 128, 130, 257)
CS = (None, 1, 3, 64, 128, 129, 1000)


def fail(message: str):
    raise ExerciseFailed(message)


def random_ids(M, topk, E, *, seed, dtype=torch.int32, empty_every=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(E, 1), (M, topk), generator=g).to(dtype)
    if empty_every:
        ids[::empty_every, -1] = -1
    return ids


# ---------------------------------------------------------------------------------------------
# 1. the chunk plan


def check_chunk_plan(chunk_plan, chunk_inputs) -> int:
    """``chunk_plan(M, C)`` must equal :func:`moekit.chunk_ranges`; ``chunk_inputs`` must return
    views of the batch's rows and pass a per-tensor scale whole (#28728 sliced it empty)."""
    from moekit.plan import chunk_ranges

    cases = 0
    for M in MS:
        for C in CS:
            want = [(r.start, r.end) for r in chunk_ranges(M, C)]
            got = [tuple(int(v) for v in r) for r in chunk_plan(M, C)]
            if got != want:
                fail(f"chunk_plan(M={M}, C={C}) gave {_short(got)}; expected {_short(want)}")
            cases += 1
    g = torch.Generator().manual_seed(1)
    M, K = 130, 16
    # bf16, as served: an upcast (.float()) would be a copy, where on fp32 it hands back the view
    hidden = torch.randn(M, K, generator=g).to(torch.bfloat16)
    for dtype in (torch.int32, torch.int64):
        ids = random_ids(M, 2, 8, seed=2, dtype=dtype)
        for kind, scale in (
            ("per-token", torch.rand(M, 1, generator=g)),
            ("per-tensor", torch.rand(1, generator=g)),
            ("no", None),
        ):
            for s, e in ((0, 128), (128, 130), (0, 130)):
                h, i, sc = chunk_inputs(hidden, ids, scale, s, e)
                if h.dtype != hidden.dtype or i.dtype != ids.dtype:
                    fail(
                        f"chunk_inputs(..., {s}, {e}) returned {h.dtype} activations and {i.dtype} ids for "
                        f"{hidden.dtype} and {ids.dtype}: a cast copied the rows; a chunk must be a view of the batch"
                    )
                if not (torch.equal(h, hidden[s:e]) and torch.equal(i, ids[s:e])):
                    fail(f"chunk_inputs(..., {s}, {e}) did not return rows [{s}, {e}) of hidden and topk_ids")
                if not (is_view_of(h, hidden, s, e) and is_view_of(i, ids, s, e)):
                    fail(
                        f"chunk_inputs(..., {s}, {e}) copied the rows: a chunk must be a view of the batch "
                        "(slicing allocates nothing)"
                    )
                want_scale = None if scale is None else scale if scale.numel() == 1 else scale[s:e]
                if (sc is None) != (want_scale is None) or (sc is not None and not torch.equal(sc, want_scale)):
                    fail(
                        f"chunk_inputs with a {kind} scale, chunk [{s}, {e}): got scale "
                        f"{None if sc is None else tuple(sc.shape)}, expected "
                        f"{None if want_scale is None else tuple(want_scale.shape)}"
                        + (
                            " (a per-tensor scale is shared by every chunk; #28728 sliced it empty)"
                            if kind == "per-tensor"
                            else ""
                        )
                    )
                cases += 1
    return cases


def _short(ranges) -> str:
    return str(ranges) if len(ranges) <= 4 else f"[{ranges[0]}, {ranges[1]}, ..., {ranges[-1]}] ({len(ranges)} chunks)"


# ---------------------------------------------------------------------------------------------
# 2. workspace shapes of a new backend


def check_workspace_shapes(experts_class) -> int:
    """``experts_class()`` (a :class:`moekit.workbook.backends.GatedTorchExperts`) runs in the real
    ModularKernel at several (M, C) and matches the reference; its shapes follow each chunk's M."""
    from moekit.modular_kernel import ModularKernel
    from moekit.prepare_finalize import NoEPPrepareFinalize
    from moekit.testing import make_problem

    cases = 0
    for M, C in ((130, 128), (7, 3), (64, None), (1, 1), (257, 64)):
        p = make_problem(M, E=4, topk=2, K=32, N=64, dtype=torch.float32, seed=M)
        kernel = ModularKernel(NoEPPrepareFinalize(), experts_class(), chunk_size=C)
        try:
            out = kernel(*p.inputs())
        except Exception as e:  # the learner meets the failure where the real code meets it
            fail(
                f"M={M}, C={C}: chunk {len(kernel.last_trace.chunks) - 1 if kernel.last_trace else 0} failed with "
                f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            )
        ref = p.reference()
        if not torch.allclose(out, ref, rtol=1e-4, atol=1e-4):
            fail(f"M={M}, C={C}: the output differs from the reference by {(out - ref).abs().max().item():.3g}")
        for c in kernel.last_trace:
            pairs, N = c.M * 2, 64
            need = {"workspace13": pairs * N, "workspace2": pairs * N // 2}
            for name, numel in need.items():
                shape = getattr(c.shapes, name)
                got = int(torch.Size(shape).numel())
                if got > 2 * numel:
                    fail(
                        f"M={M}, C={C}, chunk {c.index} ({c.M} tokens): {name} declared {shape}, {got} elements "
                        f"for {numel} needed: declare what this chunk needs (its own M), not the batch"
                    )
            cases += 1
    return cases


# ---------------------------------------------------------------------------------------------
# 3. the per-chunk recount


def check_recount(chunk_counts) -> int:
    """``chunk_counts(topk_ids, start, end, E_local, expert_map)`` equals the reference count of
    rows ``[start, end)`` for maps with -1, -1 slots, ids beyond the map and >= E_local without
    one, int32/int64 ids, E=1, topk=E, empty chunks (at the end and in the middle), and does not
    change when rows outside the chunk change."""
    from moekit.reference import count_reference
    from moekit.routing import contiguous_expert_map

    cases = 0
    for M, E, topk, ep in ((37, 8, 2, 1), (130, 16, 4, 2), (9, 1, 1, 1), (20, 4, 4, 2), (64, 6, 2, 3)):
        for dtype in (torch.int32, torch.int64):
            ids = random_ids(M, topk, E, seed=M + E, dtype=dtype, empty_every=3)
            ids.view(-1)[1::7] = E + ids.view(-1)[1::7].abs() % 3  # past the map; >= E_local without one
            E_local = E // ep
            for rank in range(ep):
                emap = contiguous_expert_map(E, ep, rank, device="cpu") if ep > 1 else None
                for s, e in ((0, min(16, M)), (min(16, M), M), (M, M), (M // 2, M // 2)):
                    want = count_reference(ids[s:e], E_local, emap).long().tolist()
                    got = torch.as_tensor(chunk_counts(ids, s, e, E_local, emap)).long().tolist()
                    if got != want:
                        fail(
                            f"chunk_counts(rows [{s}, {e}) of {M}x{topk} ids, E_local={E_local}, "
                            f"{'a map' if emap is not None else 'no map'}) gave {got}; expected {want}"
                        )
                    other = ids.clone()
                    other[:s] = random_ids(s, topk, E, seed=99, dtype=dtype)
                    other[e:] = random_ids(M - e, topk, E, seed=98, dtype=dtype)
                    again = torch.as_tensor(chunk_counts(other, s, e, E_local, emap)).long().tolist()
                    if again != got:
                        fail(
                            f"chunk_counts(..., {s}, {e}) changed when rows outside [{s}, {e}) changed: count "
                            "the chunk's own rows (bug 2: whole-batch counts handed to a chunk)"
                        )
                    cases += 1
    return cases


# ---------------------------------------------------------------------------------------------
# 6. a chunk plan along the sorted rows


def check_row_plan(row_chunk_plan) -> int:
    """``row_chunk_plan(counts, R)``: chunks of at most R sorted rows, starting on 128-row
    blocks, tiling every expert's padded run, as few as R allows, and so each expert is read by
    about one chunk: expert reads <= experts touched + chunks - 1. (For ranges that tile the
    layout the last bound follows from the tiling: each boundary cuts at most one expert. It is
    kept as the statement of what the plan is for.)"""
    from moekit.viz.rows import expert_segments

    cases = 0
    g = torch.Generator().manual_seed(3)
    exact = torch.tensor([128, 0, 256, 1, 127, 384, 129])  # whole blocks on purpose: no padding to add
    for E in (1, 4, 16, exact.numel()):
        for R in (128, 256, 384):
            counts = exact.clone() if E == exact.numel() else torch.randint(0, 400, (E,), generator=g)
            counts[::3] = 0 if 2 < E < exact.numel() else counts[::3]
            bounds = expert_segments(counts)
            total = int(bounds[-1])
            plan = [tuple(int(v) for v in r) for r in row_chunk_plan(counts.tolist(), R)]
            gaps = any(a[1] != b[0] for a, b in zip(plan, plan[1:], strict=False))
            if plan and (plan[0][0] != 0 or plan[-1][1] != total or gaps):
                fail(f"row_chunk_plan({counts.tolist()}, R={R}) gave {_short(plan)}: the chunks must tile [0, {total})")
            if any(e - s > R or e <= s for s, e in plan) or any(s % ALIGN_M for s, _ in plan):
                fail(
                    f"row_chunk_plan(..., R={R}) gave {_short(plan)}: every chunk must hold 1..R rows and start on "
                    "a 128-row block"
                )
            if len(plan) != -(-total // R) or (not plan and total):
                fail(f"row_chunk_plan(..., R={R}) used {len(plan)} chunks for {total} rows; {-(-total // R)} suffice")
            start, end = bounds[:-1], bounds[:-1] + counts
            reads = sum(int(((start < e) & (end > s) & (counts > 0)).sum()) for s, e in plan)
            touched = int((counts > 0).sum())
            if reads > touched + max(len(plan) - 1, 0):
                fail(
                    f"row_chunk_plan({_short(counts.tolist())}, R={R}) gave {_short(plan)}: {reads} expert reads for "
                    f"{touched} experts in {len(plan)} chunks; each expert is read once, plus once more for each "
                    "chunk boundary that cuts it"
                )
            cases += 1
    return cases


__all__ = ["check_chunk_plan", "check_recount", "check_row_plan", "check_workspace_shapes", "fail"]
