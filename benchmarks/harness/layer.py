"""``python -m benchmarks.harness layer``: one MoE layer, moekit's experts beside their peers.

For each M: draw weights and routing (:func:`moekit.testing.make_problem`), check every peer
against the fp32 reference on a sample of rows, then time it (a CUDA graph for M <=
--graph-max-M, else eager ``do_bench`` medians), and report the floor (:mod:`moekit.roofline` at
:data:`benchmarks.ceilings.H200`), the fraction of it reached, peak memory, the recorded H200
anchors and the issue's targets. Example::

    python -m benchmarks.harness layer --shape qwen3_30b_a3b --M 1 128 4096 16384 --dtype bf16
    python -m benchmarks.harness layer --shape deepseek_v3 --M 4096 --dtype fp8 --phases
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import traceback

import torch

from benchmarks.ceilings import H200
from benchmarks.harness import anchors, common, measure
from benchmarks.harness.peers import DEFAULT_PEERS, PEERS, make_peer
from benchmarks.harness.problem import build_problem, reference_for, with_tokens
from moekit import roofline
from moekit.testing import MoEProblem

TOLERANCE = {"bf16": 0.02, "fp8": 0.06}  # ||out - ref|| / ||ref|| on the sampled rows


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness layer", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3_30b_a3b", choices=sorted(roofline.SHAPES))
    p.add_argument("--M", type=int, nargs="+", default=[1, 128, 4096, 16384])
    p.add_argument("--dtype", default="bf16", choices=common.DTYPES)
    p.add_argument("--peers", default=None, help=f"comma list of {','.join(PEERS)} (default by dtype)")
    p.add_argument("--chunk", type=int, default=1024, help="C of the triton_chunked peer")
    p.add_argument("--graph-max-M", type=int, default=128, help="time M <= this as CUDA graph replays")
    p.add_argument("--rounds", type=int, default=1,
                   help="timings per peer and M, peers shuffled each round (us = the median)")
    p.add_argument("--rotate", type=int, default=8, help="input sets a graph cycles through")
    p.add_argument("--router", default="uniform", choices=("uniform", "skewed"))
    p.add_argument("--check-rows", type=int, default=256, help="rows checked against the reference")
    p.add_argument("--phases", action="store_true", help="profile kernels: GEMM vs the rest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="output file (default: --out/<name>-<gpu>-<date>.json)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and floors, run nothing")
    args = p.parse_args(argv)
    args.peers = tuple(args.peers.split(",")) if args.peers else DEFAULT_PEERS[args.dtype]
    bad = [n for n in args.peers if n not in PEERS]
    if bad:
        p.error(f"unknown peers {bad}; choose from {PEERS}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def plan_rows(args: argparse.Namespace) -> list[dict]:
    """What a run will measure, with floors from the expected experts hit (no GPU needed)."""
    shape = roofline.get_shape(args.shape)
    rows = []
    for M in args.M:
        unique = round(roofline.expected_unique_experts(shape, M))
        floor = roofline.layer_floor(shape, M, unique, common.quant_of(args.dtype), ceilings=H200)
        key = (shape.name, args.dtype, M)
        rows.append({
            "M": M, "mode": "graph" if M <= args.graph_max_M else "eager", "peers": list(args.peers),
            "floor_us": round(floor.us, 1), "bound": floor.bound, "flops": floor.flops, "bytes": floor.bytes,
            "anchors_us": anchors.ANCHORS.get(key, {}),
            "targets": "; ".join(t.describe() for t in anchors.TARGETS.get(key, [])),
        })
    return rows


def measure_peer(peer, sets: list[MoEProblem], rows, ref, *, args, floor) -> dict:
    """Check, then time one peer at one M; every failure lands in the row, never raises."""
    x, M = sets[0], sets[0].hidden.shape[0]
    row = {"peer": peer.name, "M": M}
    if peer.skipped:
        return row | {"status": f"skipped: {peer.skipped}"}
    try:
        err = measure.rel_error(peer.run(x)[rows], ref)
        row["rel_err"] = err
        if not err <= TOLERANCE[args.dtype]:
            return row | {"status": f"WRONG: rel_err {err:.3g} > {TOLERANCE[args.dtype]}"}
        call = lambda: peer.run(x)
        row |= time_peer(peer, sets, args=args)
        row["us_rounds"] = [row["us"]]
        if M <= args.graph_max_M:
            row["host_syncs"] = measure.host_syncs(call)
        row["peak_bytes"] = measure.peak_bytes(call, release=peer.release)
        if args.phases:
            ph = measure.kernel_phases(call)
            row |= {"gemm_us": ph.gemm_us, "other_us": ph.other_us, "kernels": ph.kernels,
                    "gemm_act_us": ph.gemm_and_activation_us,
                    "gemm_tflops": floor.flops / ph.gemm_us / 1e6 if ph.gemm_us else None,
                    "non_gemm_fraction": ph.non_gemm_fraction}
        row["status"] = "ok"
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        row["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
    return row


def time_peer(peer, sets: list[MoEProblem], *, args) -> dict:
    """One timing of a checked peer: eager ``do_bench``, and a CUDA graph replay cycling through the
    input sets for M <= --graph-max-M (the eager time stays beside it; a failed capture is reported)."""
    x = sets[0]
    out = {"eager_us": measure.eager_us(lambda: peer.run(x)), "mode": "eager"}
    out["us"] = out["eager_us"]
    if x.hidden.shape[0] <= args.graph_max_M:
        try:
            out["us"] = measure.graph_us([lambda s=s: peer.run(s) for s in sets])
            out["mode"] = f"graph x{len(sets)}"
        except Exception as exc:  # report what breaks the capture, keep the eager time
            out["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            measure.synchronize()
    return out


def more_rounds(timed: list[tuple[object, dict]], sets: list[MoEProblem], *, args, seed: int) -> None:
    """Rounds 2..--rounds: every checked peer timed again, in a new shuffled order each round (the
    SM clock follows the power cap, so a peer timed only first or only last would be favoured).
    Each row's ``us`` becomes the median of its rounds, ``spread`` (max - min) / median."""
    order = [(peer, row) for peer, row in timed if row.get("status") == "ok"]
    for r in range(1, args.rounds):
        random.Random(seed + r).shuffle(order)
        for peer, row in order:
            row["us_rounds"].append(time_peer(peer, sets, args=args)["us"])
    for _, row in order:
        rounds = row["us_rounds"]
        row["us"] = statistics.median(rounds)
        row["spread"] = (max(rounds) - min(rounds)) / row["us"]


def _annotate(row: dict, shape, dtype: str, floor) -> dict:
    key = (shape.name, dtype, row["M"])
    row |= {"floor_us": floor.us, "bound": floor.bound, "bytes": floor.bytes, "flops": floor.flops,
            "anchors_us": anchors.ANCHORS.get(key, {})}
    us = row.get("us")
    if us:
        row["floor_fraction"] = floor.us / us
        row["tflops"] = floor.flops / us / 1e6
        row["targets"] = [
            {"target": t.describe(),
             "met": anchors.check_target(t, row["peer"], us=us, gemm_tflops=row.get("gemm_tflops"),
                                         non_gemm_fraction=row.get("non_gemm_fraction"))}
            for t in anchors.TARGETS.get(key, [])
        ]
    return row


def run(args: argparse.Namespace, emit, *, device) -> list[dict]:
    """Measure every (M, peer) on ``device``; ``emit(rows)`` is called after each row (incremental JSON).

    Each M gets its own problem; the extra input sets of a CUDA graph share its weights."""
    shape = roofline.get_shape(args.shape)
    peers = [make_peer(n, args.dtype, chunk_size=args.chunk) for n in args.peers]
    rows: list[dict] = []
    for M in args.M:
        seed = args.seed + 1000 * M
        problem = build_problem(shape, M, args.dtype, router=args.router, seed=seed, device=device)
        n_sets = args.rotate if M <= args.graph_max_M else 1
        # seeds away from the problem's own, so that each set routes its tokens to other experts
        sets = [problem] + [with_tokens(problem, M, router=args.router, seed=seed + 500 + i) for i in range(1, n_sets)]
        unique = int(torch.unique(problem.topk_ids).numel())
        floor = roofline.layer_floor(shape, M, unique, common.quant_of(args.dtype), ceilings=H200)
        sample = measure.sample_rows(M, args.check_rows).to(device)
        ref = reference_for(problem, sample)
        timed = [(peer, measure_peer(peer, sets, sample, ref, args=args, floor=floor)) for peer in peers]
        more_rounds(timed, sets, args=args, seed=seed)
        for _, row in timed:
            rows.append(_annotate(row | {"unique_experts": unique}, shape, args.dtype, floor))
            emit(rows)
        del sets, problem, ref
        measure.empty_cache()
    return rows


def _display(row: dict) -> dict:
    recorded = row.get("anchors_us") or {}
    vllm = recorded.get("vllm_triton", recorded.get("vllm_triton_tuned"))
    verdicts = [t["met"] for t in row.get("targets", []) if t["met"] is not None]
    notes = row.get("status", "")
    if row.get("graph_error"):
        notes += f"; graph failed: {row['graph_error'][:60]}"
    return row | {
        "pct_floor": 100 * row["floor_fraction"] if row.get("floor_fraction") else None,
        "vs_vllm": vllm / row["us"] if vllm and row.get("us") else None,
        "target": ("met" if all(verdicts) else "MISSED") if verdicts else None,
        "peak_mb": row["peak_bytes"] / 2**20 if row.get("peak_bytes") is not None else None,
        "gemm_pct": None if row.get("non_gemm_fraction") is None else 100 * (1 - row["non_gemm_fraction"]),
        "notes": notes,
    }


COLUMNS = [
    "M", "peer", "mode", ("us", "us", ".1f"), ("eager_us", "eager us", ".1f"),
    ("floor_us", "floor us", ".1f"),
    ("pct_floor", "% floor", ".0f"), ("tflops", "TF/s", ".0f"), ("vs_vllm", "x vLLM", ".2f"), "target",
    ("gemm_tflops", "GEMM TF/s", ".0f"), ("gemm_pct", "GEMM %", ".0f"), ("gemm_act_us", "GEMM+act us", ".1f"),
    ("peak_mb", "peak MiB", ".0f"),
    ("spread", "spread", ".0%"), ("rel_err", "rel err", ".1e"), "notes",
]


def print_summary(rows: list[dict], args) -> None:
    """The table, the anchors and targets, and every host sync or failed capture, by peer."""
    print(common.format_table([_display(r) for r in rows], COLUMNS))
    print(f"\nanchors (recorded on an H200, us) and targets for {args.shape} {args.dtype}:")
    for M in args.M:
        key = (args.shape, args.dtype, M)
        targets = "; ".join(t.describe() for t in anchors.TARGETS.get(key, [])) or "-"
        print(f"  M={M}: anchors {anchors.ANCHORS.get(key, {}) or '-'}; target {targets}")
    for r in rows:
        if r.get("host_syncs") or r.get("graph_error"):
            print(f"\nCUDA graph, {r['peer']} M={r['M']}: {r.get('graph_error') or 'captured'}")
            for s in r.get("host_syncs", []):
                print(f"  host sync at {s}")


def main(argv: list[str] | None = None, *, device=None) -> int:
    """Run the layer benchmark on ``device`` (default :func:`moekit.device.get_device`); returns
    a process exit code."""
    import moekit

    args = parse(list(sys.argv[1:] if argv is None else argv))
    reason = common.gpu_or_reason()
    if args.dry_run or reason is not None:
        print(f"layer bench plan: {args.shape} {args.dtype}, peers {', '.join(args.peers)}, "
              f"router {args.router}")
        print(common.format_table(plan_rows(args), ["M", "mode", ("floor_us", "floor us", ".1f"), "bound",
                                                    "anchors_us", "targets"]))
        if reason is not None and not args.dry_run:
            print(f"\nlayer bench: needs a CUDA GPU ({reason}); pass --dry-run to print only the plan.",
                  file=sys.stderr)
            return 2
        return 0
    device = moekit.device.get_device() if device is None else torch.device(device)
    env = common.environment()
    name = f"layer-{args.shape}-{args.dtype}" + ("" if args.router == "uniform" else f"-{args.router}")
    print(f"{env.gpu}, torch {env.torch}, triton {env.triton}, {env.date}: {name}", flush=True)

    def emit(rows):
        r = _display(rows[-1])
        print(f"  M={r['M']:>6} {r['peer']:<16} {r.get('us') or float('nan'):>10.1f} us  "
              f"floor {r['floor_us']:.1f}  {r['notes']}", flush=True)
        common.save_rows(rows, args, env, name=name)

    with common.clock_log(common.results_path(name, env, args.out).with_suffix(".clocks.csv")) as clocks:
        rows = run(args, emit, device=device)
    if clocks is not None:
        print(f"SM clock and power every 500 ms: {clocks}")
    print()
    print_summary(rows, args)
    print(f"\nwrote {common.save_rows(rows, args, env, name=name)}")
    return 0
