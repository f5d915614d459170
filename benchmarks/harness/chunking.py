"""``python -m benchmarks.harness chunking``: what chunking costs in time, and what it saves in memory.

For each chunk size C (``None`` = one chunk) one ModularKernel runs the same M tokens. The bench
checks each against the fp32 reference and against the unchunked output, times it, and reads
the workspace peak from ``ModularKernel.last_trace.peak_workspace_bytes``. Target: C=1024
takes <= 1.08x the unchunked time. ``--rows`` adds chunks of expert-sorted rows
(``ModularKernel(chunk_by="rows")``; default: R = C x topk, the same workspace rows as each C),
and every run records the weight bytes its chunks read. A second, declared-only table (no GPU) shows the workspace
the experts ask for at several M: for a fixed C it stops growing once M >= C::

    python -m benchmarks.harness chunking --shape qwen3_30b_a3b --M 16384 --C 256 512 1024 2048 4096 None
    python -m benchmarks.harness chunking --M 16384 --C 1024 None --rows 8192 16384
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

from benchmarks.ceilings import H200
from benchmarks.harness import common, measure
from moekit import roofline
from moekit.api import BY_NAME, experts_class
from moekit.errors import MoekitError
from moekit.quant import FP8

TARGET_C, TARGET_RATIO = 1024, 1.08
EXPERTS = tuple(sorted(BY_NAME))  # every name of moekit's experts registry


def parse_chunk(text: str) -> int | None:
    """``"None"`` (or ``"none"``, ``"0"``) -> None, else a positive int."""
    if text.lower() in ("none", "0"):
        return None
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"chunk sizes must be > 0 or None, got {text}")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness chunking", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3_30b_a3b", choices=sorted(roofline.SHAPES))
    p.add_argument("--M", type=int, default=16384)
    p.add_argument("--C", type=parse_chunk, nargs="+", default=[256, 512, 1024, 2048, 4096, None])
    p.add_argument("--rows", type=parse_chunk, nargs="*", default=None,
                   help="sorted rows per chunk for chunk_by='rows' (multiples of 128; default C x topk "
                        "for each C; pass --rows with no value to skip)")
    p.add_argument("--dtype", default="bf16", choices=common.DTYPES)
    p.add_argument("--experts", default="triton", choices=EXPERTS)
    p.add_argument("--ws-M", type=int, nargs="+", default=[1024, 4096, 16384, 65536],
                   help="token counts for the declared-workspace table")
    p.add_argument("--check-rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="output file (default: --out/<name>-<gpu>-<date>.json)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and declared workspaces only")
    return p.parse_args(argv)


def make_experts(name: str, dtype: str):
    """The experts of ``name`` (:data:`moekit.api.BY_NAME`) for the harness's ``dtype``."""
    return experts_class(name)(quant=common.quant_of(dtype))


def declared_workspace_bytes(experts, shape: roofline.LayerShape, M: int, C: int | None, *,
                             act_dtype: torch.dtype = torch.bfloat16) -> int:
    """Pool bytes that the chunk loop would hold for M tokens in chunks of C.

    Asks ``experts.workspace_shapes`` for every chunk and replays the requests on a
    :class:`~moekit.workspace.WorkspacePool` on the ``meta`` device: the same alignment
    arithmetic as a real run, with no memory touched.
    """
    from moekit.plan import chunk_ranges
    from moekit.types import ProblemSize
    from moekit.workspace import WorkspacePool

    pool = WorkspacePool("meta")
    problem = ProblemSize(M, shape.N, shape.K, shape.topk, shape.E, shape.E)
    for r in chunk_ranges(M, C):
        pool.take(experts.workspace_shapes(problem.with_M(r.size), act_dtype=act_dtype))
    return pool.peak_bytes


def declared_table(experts, shape, Cs, Ms, *, act_dtype=torch.bfloat16) -> list[dict]:
    """One row per C: declared workspace bytes at each M of ``Ms``."""
    return [{"C": C, **{f"M={M}": declared_workspace_bytes(experts, shape, M, C, act_dtype=act_dtype)
                        for M in Ms}} for C in Cs]


def _act_dtype(dtype: str) -> torch.dtype:
    return FP8 if dtype == "fp8" else torch.bfloat16


HOST_REPEATS = 5  # calls timed for the host's enqueue time (the median is kept)


def _limits(call, chunks: int) -> dict:
    """What bounds a plan: the host's enqueue time (per chunk) against the kernels' device time,
    and the CUDA-graph time (no host cost at all)."""
    import statistics
    import time

    host = []
    for _ in range(HOST_REPEATS):
        measure.synchronize()
        start = time.perf_counter()
        call()  # the GPU starts idle: the queue never fills, so this is Python and launch time
        host.append((time.perf_counter() - start) * 1e6)
    measure.synchronize()
    row = {"host_us": statistics.median(host), "host_us_per_chunk": statistics.median(host) / max(chunks, 1)}
    phases = measure.kernel_phases(call)
    row |= {"device_us": phases.gemm_us + phases.other_us, "gemm_us": phases.gemm_us, "kernels": phases.kernels}
    try:
        row["graph_us"] = measure.graph_us([call])
    except Exception as exc:
        row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def row_sizes(args: argparse.Namespace, topk: int) -> list[int]:
    """The R of ``--rows``, or C x topk rounded up to 128 rows for each C."""
    if args.rows is not None:
        return [R for R in args.rows if R is not None]
    return sorted({-(-C * topk // 128) * 128 for C in args.C if C is not None})


def run(args: argparse.Namespace, emit, *, device) -> list[dict]:
    """Time and check every plan (the unchunked baseline first) on ``device``; ``emit(rows)`` after each."""
    from benchmarks.harness.problem import build_problem, reference_for
    from moekit.modular_kernel import ModularKernel
    from moekit.prepare_finalize import NoEPPrepareFinalize

    shape = roofline.get_shape(args.shape)
    x = build_problem(shape, args.M, args.dtype, seed=args.seed, device=device)
    sample = measure.sample_rows(args.M, args.check_rows).to(device)
    ref = reference_for(x, sample)
    unique = int(torch.unique(x.topk_ids).numel())
    floor = roofline.layer_floor(shape, args.M, unique, common.quant_of(args.dtype), ceilings=H200)
    order = [("tokens", None)] + [("tokens", C) for C in args.C if C is not None]
    order += [("rows", R) for R in row_sizes(args, shape.topk)]
    rows: list[dict] = []
    baseline_out, baseline_us = None, None
    for plan, C in order:
        row = {"C": C, "chunk_by": plan, "M": args.M, "experts": args.experts, "floor_us": floor.us}
        try:
            kernel = ModularKernel(NoEPPrepareFinalize(), make_experts(args.experts, args.dtype),
                                   chunk_size=C, chunk_by=plan, trace_counts=True)
            call = lambda k=kernel: k(*x.inputs(), **x.options())
            out = call()
            kernel.trace_counts = False  # the counts (for weight_bytes) only in the checked run
            row["rel_err"] = measure.rel_error(out[sample], ref)
            if baseline_out is None:
                baseline_out = out
            else:
                row["rel_diff_vs_unchunked"] = measure.rel_error(out, baseline_out.float())
            trace = kernel.last_trace
            row |= {"chunks": len(trace), "backends": sorted(set(trace.backends)),
                    "peak_workspace_bytes": trace.peak_workspace_bytes, "weight_bytes": trace.weight_bytes}
            del out
            row["us"] = measure.eager_us(call)
            row |= _limits(call, len(trace))
            row["pool_grows"] = kernel.pool.grows  # 1: only the first chunk allocated
            row["peak_bytes"] = measure.peak_bytes(call, release=kernel.pool.release)
            if C is None:
                baseline_us = row["us"]
            row["ratio_vs_unchunked"] = row["us"] / baseline_us if baseline_us else None
            if C == TARGET_C and baseline_us:
                row["target"] = {"max_ratio": TARGET_RATIO, "met": row["ratio_vs_unchunked"] <= TARGET_RATIO}
            row["status"] = "ok" if row["rel_err"] <= (0.06 if args.dtype == "fp8" else 0.02) else "WRONG"
            kernel.pool.release()
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            row["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        emit(rows)
    return rows


COLUMNS = ["chunk_by", "C", "chunks", ("weight_gib", "weights GiB", ".2f"), ("us", "us", ".1f"),
           ("ratio_vs_unchunked", "x unchunked", ".3f"), "target_met", ("graph_us", "graph us", ".1f"),
           ("device_us", "kernels us", ".1f"), ("host_us_per_chunk", "host us/chunk", ".1f"),
           ("ws_mib", "workspace MiB", ".1f"), ("peak_mib", "peak MiB", ".0f"), "pool_grows",
           ("rel_err", "rel err", ".1e"), ("rel_diff_vs_unchunked", "vs C=None", ".1e"), "status"]


def _display(row: dict) -> dict:
    mib = lambda key: row[key] / 2**20 if row.get(key) is not None else None
    met = row.get("target", {}).get("met")
    gib = row["weight_bytes"] / 2**30 if row.get("weight_bytes") is not None else None
    return row | {"ws_mib": mib("peak_workspace_bytes"), "peak_mib": mib("peak_bytes"), "weight_gib": gib,
                  "target_met": None if met is None else ("met" if met else "MISSED"),
                  "C": "None" if row.get("C") is None else row["C"]}


def main(argv: list[str] | None = None, *, device=None) -> int:
    """Run the chunking benchmark on ``device`` (default :func:`moekit.device.get_device`);
    returns a process exit code."""
    import moekit
    from benchmarks.harness.common import environment, format_table, save_rows

    args = parse(list(sys.argv[1:] if argv is None else argv))
    shape = roofline.get_shape(args.shape)
    Cs = list(dict.fromkeys(args.C))
    try:
        declared = declared_table(make_experts(args.experts, args.dtype), shape, Cs, args.ws_M,
                                  act_dtype=_act_dtype(args.dtype))
    except MoekitError as exc:  # these experts refuse this dtype (DeepGemmExperts is fp8 only)
        declared, note = [], f"(no declared table: {type(exc).__name__}: {exc})"
    else:
        note = ""
    print(f"declared workspace bytes, {args.experts} experts, {shape.name} {args.dtype} "
          f"(no GPU needed; for a fixed C the bytes stop growing once M >= C) {note}")
    if declared:
        print(format_table([r | {"C": str(r["C"])} for r in declared], ["C", *[f"M={M}" for M in args.ws_M]]))
    reason = common.gpu_or_reason()
    if args.dry_run or reason is not None:
        print(f"\nplan: M={args.M}, C in {Cs}, sorted rows R in {row_sizes(args, shape.topk)}, time vs C=None "
              f"(target: C={TARGET_C} <= {TARGET_RATIO}x)")
        if reason is not None and not args.dry_run:
            print(f"chunking bench: needs a CUDA GPU ({reason}); pass --dry-run to print only the plan.",
                  file=sys.stderr)
            return 2
        return 0
    device = moekit.device.get_device() if device is None else torch.device(device)
    env = environment()
    name = f"chunking-{shape.name}-{args.dtype}"
    print(f"\n{env.gpu}, torch {env.torch}, triton {env.triton}, {env.date}: {name}, M={args.M}", flush=True)
    extra = {"declared_workspace_bytes": declared}

    def emit(rows):
        r = _display(rows[-1])
        print(f"  {r['chunk_by']:>6} C={r['C']:>5} {r.get('us') or float('nan'):>10.1f} us  {r['status']}", flush=True)
        save_rows(rows, args, env, name=name, extra=extra)

    rows = run(args, emit, device=device)
    print()
    print(format_table([_display(r) for r in rows], COLUMNS))
    print(f"\nwrote {save_rows(rows, args, env, name=name, extra=extra)}")
    return 0
