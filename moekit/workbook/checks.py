"""Checks of the exercises written in Python and torch (1, 2, 3 and 6).

Each ``check_*`` draws its cases from a :class:`moekit.workbook.cases.Sampler` over the whole
space the exercise's text allows (its edges always among them), runs the learner's code against
:mod:`moekit.reference` (or the library's own plan), holds it to the contract every exercise
shares (inputs are read-only; new data of the same sizes gets a new answer, in new objects and
written into the same ones), checks *how* where the exercise is about how, and raises
:class:`moekit.errors.ExerciseFailed` with one line naming the first failing case.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moekit.errors import ExerciseFailed
from moekit.types import ALIGN_M
from moekit.workbook.cases import HOT_INT16, Sampler
from moekit.workbook.probes import is_view_of, watch_inputs

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
SCALES = ("per-token", "per-group", "per-tensor", "no")  # [M, 1]; [M, K/128] column-major; [1]; None
AGAIN = ", called again on new data of the same sizes"
REFILLED = f"{AGAIN}, written into the same input (as into a CUDA graph's static buffer)"
LAST_LOCAL = {"map": "strided", "E": 512, "ep": 2, "rank": 1}  # map[-1] is an expert; 256 local: past int8's range
OTHER_ROWS = ", called again with the chunk's rows kept and every other row changed (bug 2 counts those too)"


def fail(message: str):
    raise ExerciseFailed(message)


def _read_only(sampler: Sampler, fn, names: str, *args):
    """``fn(*args)``; fails when it changed a tensor or list among ``args`` (``names`` names
    them, one word per argument): every exercise's inputs are read-only."""
    watched = {n: a for n, a in zip(names.split(), args, strict=True) if isinstance(a, (torch.Tensor, list))}
    with watch_inputs(**watched) as changed:
        result = fn(*args)
    if changed:
        fail(f"{sampler.case} changed its input {changed[0]}: inputs are read-only (the caller still uses them)")
    return result


def difference(got, want) -> str:
    """The first difference between two lists (or 1-D tensors) of counts, in a few words (never the lists)."""
    if len(got) != len(want):
        return f"{len(got)} counts; expected {len(want)}, one per local expert"
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    return f"{int(got[bad[0]])} for expert {bad[0]}; expected {int(want[bad[0]])} ({len(bad)} of {len(want)} differ)"


def _short(items: list, what: str = "chunks") -> str:
    return str(items) if len(items) <= 4 else f"[{items[0]}, {items[1]}, ..., {items[-1]}] ({len(items)} {what})"


# ---------------------------------------------------------------------------------------------
# 1. the chunk plan


def check_chunk_plan(chunk_plan, chunk_inputs, *, sampler: Sampler) -> None:
    """``chunk_plan(M, C)`` equals :func:`moekit.chunk_ranges` for M >= 0 and C None or >= 1;
    ``chunk_inputs`` returns the chunk's rows of activations (any dtype, strided too) and ids
    (every dtype) as views, the rows of a per-token scale as a view and a per-tensor scale
    whole, and changes none of its inputs."""
    from moekit.plan import chunk_ranges

    r = sampler.rng
    for M in (0, 1, r.randint(2, 300), r.randint(300, 5000)):
        for C in (None, 1, M + 1, max(M, 1), max(M - 1, 1), r.randint(1, M + 1)):
            sampler.new_case(f"chunk_plan(M={M}, C={C})")
            want = [(c.start, c.end) for c in chunk_ranges(M, C)]
            got = [tuple(int(v) for v in rng) for rng in chunk_plan(M, C)]
            if got != want:
                fail(f"{sampler.case} gave {_short(got)}; expected {_short(want)}")
    for i in range(12):  # case i takes the i-th activation dtype and kind of scale in turn
        dtype, kind = ACT_DTYPES[i % 4], SCALES[i % 4]
        M = 0 if i == 0 else r.randint(1, 300)
        K = r.randint(129, 600) if kind == "per-group" else r.randint(1, 300)  # more than one group of 128
        rt = sampler.routing(i, M=M)
        plan = [(c.start, c.end) for c in chunk_ranges(M, r.randint(1, max(M // 2, 1)))] or [(0, 0)]
        s, e = plan[-1] if i % 2 == 0 else r.choice(plan)  # even cases: the last chunk (a per-tensor scale's)
        for note in ("", AGAIN):
            hidden = sampler.tensor(M, K + 3 * (i % 2)).to(dtype)[:, :K]  # odd cases: a strided view
            ids = sampler.batch(rt).ids
            shape = {"per-token": (M, 1), "per-group": (-(-K // 128), M), "per-tensor": (1,)}.get(kind)
            scale = None if shape is None else sampler.tensor(*shape)
            scale = scale.t() if kind == "per-group" else scale  # column-major [M, K/128], as DeepGEMM keeps it
            sampler.new_case(
                f"chunk_inputs(rows [{s}, {e}) of {M}x{K} {str(dtype)[6:]} activations{' (strided)' * (i % 2)}, "
                f"{rt}, {kind} scale){note}"
            )
            got = _read_only(sampler, chunk_inputs, "hidden topk_ids a_scale start end", hidden, ids, scale, s, e)
            rows = (0, 1) if kind == "per-tensor" else (s, e)
            want = {"hidden": (hidden, s, e), "topk_ids": (ids, s, e), "a_scale": (scale, *rows)}
            for (name, (base, a, b)), x in zip(want.items(), got, strict=True):
                if base is None and x is None:
                    continue
                if base is None or x is None:
                    fail(f"{sampler.case} returned {x if x is None else tuple(x.shape)} as {name}, for {kind} scale")
                if tuple(x.shape) != tuple(base[a:b].shape) or not torch.equal(x.float(), base[a:b].float()):
                    fail(
                        f"{sampler.case} returned {tuple(x.shape)} {name}; expected its rows [{a}, {b})"
                        + " (a per-tensor scale is shared by every chunk: it passes whole)" * (kind == "per-tensor")
                    )
                if not is_view_of(x, base, a, b):
                    fail(
                        f"{sampler.case} copied {name}{' (a cast)' * (x.dtype != base.dtype)}: a chunk's {name} "
                        "must be a view of the batch's (slicing allocates nothing)"
                    )


# ---------------------------------------------------------------------------------------------
# 2. workspace shapes of a new backend


def check_workspace_shapes(experts_class, *, sampler: Sampler) -> None:
    """``experts_class()`` (a :class:`moekit.workbook.backends.GatedTorchExperts`) runs in the
    real ModularKernel for M >= 0, any C, topk, K and N (independent), act dtypes and EP ranks,
    with and without ``tokens_meta`` (``NoEPPrepareFinalize(return_counts=True)``: the chunk's
    local pairs, fewer than its rows when experts live on other ranks), and matches the
    reference; each chunk's workspaces are declared in act_dtype and hold at least the bytes
    that the kit's solution declares for that chunk, and fewer than twice as many."""
    from moekit.modular_kernel import ModularKernel
    from moekit.prepare_finalize import NoEPPrepareFinalize
    from moekit.testing import assert_close, make_problem
    from moekit.types import ProblemSize
    from moekit.workbook.solutions.workspace import MyExperts

    r = sampler.rng
    # edges: case 0, two chunks of different sizes, on one of 2 ranks; 1, K > N; 2, K < N/2, one rank; 3, no tokens
    for i in range(6):  # even cases hand workspace_shapes tokens_meta
        M = 130 if i == 0 else 0 if i == 3 else r.randint(1, 200)
        C = 128 if i == 0 else r.choice((None, r.randint(max(M // 6, 1), M + 1)))  # at most about 6 chunks
        K = r.randint(65, 160) if i == 1 else r.randint(1, 15) if i == 2 else r.randint(1, 160)
        N = 2 * (r.randint(1, 16) if i == 1 else r.randint(16, 64))
        E, dtype, meta = r.randint(2 if i == 0 else 1, 12), ACT_DTYPES[i % 3], i % 2 == 0
        topk, ep = r.randint(1, E), 2 if i == 0 else 1 if i == 2 else r.randint(1, E)
        rank = r.randrange(ep)
        p = make_problem(M, E=E, topk=topk, K=K, N=N, dtype=dtype, seed=r.getrandbits(31))
        p = p.shard(rank, ep) if ep > 1 else p
        where = f"E={E} (rank {rank} of {ep}), topk={topk}, K={K}, N={N}, {str(dtype)[6:]}{', tokens_meta' * meta}"
        sampler.new_case(f"M={M}, C={C}, {where}")
        kernel = ModularKernel(NoEPPrepareFinalize(return_counts=meta), experts_class(), chunk_size=C)
        try:
            out = kernel(*p.inputs(), **p.options())
        except Exception as e:  # the learner meets the failure where the real code meets it
            chunk = len(kernel.last_trace.chunks) - 1 if kernel.last_trace else 0
            fail(f"{sampler.case}: chunk {chunk} failed with {type(e).__name__}: {[*str(e).splitlines(), ''][0][:200]}")
        try:
            assert_close(out, p.reference(), dtype=dtype)
        except AssertionError as e:
            fail(f"{sampler.case}: the output differs from the reference ({str(e).splitlines()[0][:120]})")
        for c in kernel.last_trace:
            size = ProblemSize(c.M, N, K, topk, E, p.w1.shape[0])
            need = MyExperts().workspace_shapes(size, act_dtype=dtype).workspace_bytes
            got = c.needed.workspace_bytes
            if not need <= got < 2 * need or c.needed.dtype != dtype:
                fail(
                    f"{sampler.case}, chunk {c.index} ({c.M} tokens): declared {c.needed.workspace13} and "
                    f"{c.needed.workspace2} of {c.needed.dtype} (act_dtype {dtype}), {got} bytes where this chunk "
                    f"needs {need}: size each buffer by this chunk's own problem (its M and topk, not the batch's "
                    "or its local pairs), in act_dtype"
                )


# ---------------------------------------------------------------------------------------------
# 3. the per-chunk recount


def check_recount(chunk_counts, *, sampler: Sampler) -> None:
    """``chunk_counts(topk_ids, start, end, E_local, expert_map)`` equals the reference count of
    rows ``[start, end)`` for every ids dtype and kind of map (none, contiguous, strided,
    random), -1 slots, ids past the map or >= E_local, E = 1, an expert past int16's limit, and
    chunks whole, empty or inside; it counts the chunk's own rows, changes none of its inputs,
    and answers new data of the same sizes anew (new ids, and new ids in the same tensor)."""
    from moekit.reference import count_reference

    names = "topk_ids start end num_local_experts expert_map"
    for rt in sampler.routings(4, {"M": 0}, {"M": 1, "E": 1}, HOT_INT16, LAST_LOCAL):
        first, again, other = sampler.batch(rt), sampler.batch(rt), sampler.batch(rt)
        for s, e in sampler.ranges(rt.M):
            outside = other.ids.clone()
            outside[s:e] = first.ids[s:e]  # the chunk's rows as in `first`: its counts must be `first`'s
            for b, note in ((first, ""), (again, AGAIN), (replace(first, ids=outside), OTHER_ROWS), (first, REFILLED)):
                if note == REFILLED:  # a cache keyed by the tensor (or its address) is stale
                    kept = first.ids.clone()
                    first.ids.copy_(sampler.batch(rt).ids)
                sampler.new_case(f"chunk_counts(rows [{s}, {e}) of {rt}){note}")
                got = torch.as_tensor(_read_only(sampler, chunk_counts, names, b.ids, s, e, b.num_local, b.expert_map))
                want = count_reference(b.ids[s:e], b.num_local, b.expert_map).long()
                if got.dtype not in (torch.int32, torch.int64):
                    fail(f"{sampler.case} gave counts of {got.dtype}; counts are int32 or int64")
                if not torch.equal(got.long(), want):  # compared as tensors: a wrong answer may be huge
                    fail(f"{sampler.case} gave {difference(got, want)}")
            first.ids.copy_(kept)  # the next chunk is of the first ids again


# ---------------------------------------------------------------------------------------------
# 6. a chunk plan along the sorted rows


def check_row_plan(row_chunk_plan, *, sampler: Sampler) -> None:
    """``row_chunk_plan(counts, R)`` for 1 to 64 experts with 0, 1, exact multiples of 128 and
    many blocks of rows, R any multiple of 128: chunks of at most R sorted rows, starting on
    128-row blocks, tiling every expert's padded run, as few as R allows, and so each expert is
    read by about one chunk: expert reads <= experts touched + chunks - 1. (For ranges that tile
    the layout the last bound follows from the tiling: each boundary cuts at most one expert. It
    is kept as the statement of what the plan is for.) ``counts`` is read-only; new counts, in a
    new list and written into the same list, get a new plan."""
    from moekit.viz.rows import expert_segments

    r = sampler.rng
    for i in range(10):
        E = 1 if i == 1 else r.randint(1, 64)
        R = ALIGN_M * (10_000 if i == 2 else r.randint(1, 12))  # case 2: R past the whole layout
        menu = [0, 1, 127, 128, 129, 256, 1000, r.randint(0, 3000)]
        menu = [0, 128, 256, 640] if i == 0 else [0] if i == 1 else menu  # case 0: whole blocks; case 1: no rows
        counts = []
        for note in ("", AGAIN, REFILLED):
            counts = counts if note == REFILLED else []  # REFILLED: the same list, new values
            counts[:] = [r.choice(menu) for _ in range(E)]
            sampler.new_case(f"row_chunk_plan({_short(counts, 'experts')}, R={R}){note}")
            bounds = expert_segments(torch.tensor(counts))
            total = int(bounds[-1])
            plan = [tuple(int(v) for v in c) for c in _read_only(sampler, row_chunk_plan, "counts R", counts, R)]
            if plan and [s for s, _ in plan] + [total] != [0] + [e for _, e in plan]:  # each starts where one ends
                fail(f"{sampler.case} gave {_short(plan)}: the chunks must tile [0, {total})")
            if any(e - s > R or e <= s for s, e in plan) or any(s % ALIGN_M for s, _ in plan):
                fail(
                    f"{sampler.case} gave {_short(plan)}: every chunk must hold 1..R rows and start on a 128-row block"
                )
            if len(plan) != -(-total // R):
                fail(f"{sampler.case} used {len(plan)} chunks for {total} rows; {-(-total // R)} suffice")
            start, end = bounds[:-1], bounds[:-1] + torch.tensor(counts)
            reads = sum(int(((start < e) & (end > s) & (end > start)).sum()) for s, e in plan)
            touched = sum(c > 0 for c in counts)
            if reads > touched + max(len(plan) - 1, 0):
                fail(
                    f"{sampler.case} gave {_short(plan)}: {reads} expert reads for {touched} experts in {len(plan)} "
                    "chunks; each expert is read once, plus once more for each chunk boundary that cuts it"
                )


__all__ = ["check_chunk_plan", "check_recount", "check_row_plan", "check_workspace_shapes", "difference", "fail"]
