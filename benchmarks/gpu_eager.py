"""An eager forward as a user calls it: wall-clock per call, host cost per call, and the graph beside it.

The protocol (so a number means what a user gets): at least 1000 back-to-back plain calls, no
cache flush between them, cycling through 8 input sets allocated fresh for the run, one
synchronize at the end; the same calls replayed from one CUDA graph for comparison; and the host
cost of one call alone (synchronized before it, so the GPU never makes it wait; median). Beside
them, in the same run: the host cost of a bare Triton launch and of ``torch.empty``, and the CPU
model, so a figure from another host can be compared. Qwen3-30B-A3B's layer in bf16::

    python -m benchmarks.gpu_eager [--moekit PATH] [--label NAME] [--out DIR] [--quick] [--only rows]

``--moekit`` imports moekit from another checkout (a before/after comparison in one run); ``--only rows``
times the row plan alone (M=16384: one chunk, R=8192 rows, C=1024 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_eager")
    ap.add_argument("--moekit", default=None, help="a checkout whose moekit/ to import (default: this one)")
    ap.add_argument("--label", default="moekit")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    ap.add_argument("--hf", action="store_true", help="also the transformers integration beside transformers' own")
    ap.add_argument("--only", choices=["rows"], default=None, help="only the row plan's cases")
    return ap.parse_args(argv)


ARGS = _args(sys.argv[1:] if __name__ == "__main__" else [])
sys.path.insert(0, str(Path(ARGS.moekit).resolve()) if ARGS.moekit else str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import moekit  # noqa: E402
from moekit.prepare_finalize import NoEPPrepareFinalize  # noqa: E402

try:  # the wing (what a Hopper GPU runs); a checkout from before the split (--moekit) has it as TritonExperts
    from moekit.hopper.experts import HopperTritonExperts
except ImportError:  # pragma: no cover - an older checkout
    from moekit.experts import TritonExperts as HopperTritonExperts

E, TOPK, K, N = 128, 8, 2048, 1536  # Qwen3-30B-A3B: hidden 2048, intermediate 768
SETS = 8


@triton.jit
def _noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def host_us(fn, calls: int = 500) -> float:
    """Median host microseconds of one call, the GPU idle before each (it never waits)."""
    fn()
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def wall_us(fns, calls: int) -> float:
    """Wall-clock microseconds per call of ``calls`` back-to-back calls cycling over ``fns``, one sync.
    (``benchmarks.harness.measure.back_to_back_us`` does the same; this script imports nothing of its
    checkout but moekit, since ``--moekit`` may point at another one.)"""
    for f in fns:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def graph_us(fns, calls: int) -> float:
    """Microseconds per call of the same calls captured once into one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns * 2:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    replays = max(1, calls // len(fns))
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (replays * len(fns)) * 1e6


def inputs(M: int, w1, seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    hidden = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    r = moekit.routing.uniform_router(M, E, TOPK, seed=seed, device="cuda")
    return hidden, r.topk_weights, r.topk_ids


def weights():
    g = torch.Generator("cuda").manual_seed(0)
    w1 = (torch.randn(E, N, K, generator=g, device="cuda") * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N // 2, generator=g, device="cuda") * (N // 2) ** -0.5).bfloat16()
    return w1, w2


def layer_rows(w1, w2, calls: int, quick: bool) -> list[dict]:
    rows = []
    plain = moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts())
    for M in (1, 128) if quick else (1, 8, 128, 1024, 4096):
        sets = [inputs(M, w1, seed) for seed in range(SETS)]
        fns = [lambda s=s: plain(s[0], w1, w2, s[1], s[2]) for s in sets]
        n = calls if M <= 1024 else max(200, calls // 5)
        row = {"case": "layer", "M": M, "chunks": 1, "eager_us": wall_us(fns, n), "graph_us": graph_us(fns, n),
               "host_us": host_us(fns[0])}  # fmt: skip
        row["eager_over_graph"] = row["eager_us"] / row["graph_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for C in (128, 64, 32, 16):  # host per further chunk, at M=128
        kernel = moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts(), chunk_size=C)
        s = inputs(128, w1, 0)
        fn = lambda k=kernel, s=s: k(s[0], w1, w2, s[1], s[2])
        row = {"case": "host per chunk", "M": 128, "C": C, "chunks": 128 // C, "host_us": host_us(fn)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def fused_moe_rows(w1, w2, calls: int) -> list[dict]:
    """``moekit.fused_moe`` as users call it: on a GPU it replays a graph per signature up to
    ``moekit.api.REPLAY_MAX_TOKENS`` tokens (a checkout without it runs the plain forward)."""
    rows = []
    for M in (1, 8, 128):
        sets = [inputs(M, w1, seed) for seed in range(SETS)]
        fns = [lambda s=s: moekit.fused_moe(s[0], w1, w2, s[1], s[2]) for s in sets]
        row = {"case": "fused_moe", "M": M, "chunks": 1, "eager_us": wall_us(fns, calls),
               "graph_us": graph_us(fns, calls), "host_us": host_us(fns[0])}  # fmt: skip
        row["eager_over_graph"] = row["eager_us"] / row["graph_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for C in (128, 64, 32, 16):
        s = inputs(128, w1, 0)
        fn = lambda C=C, s=s: moekit.fused_moe(s[0], w1, w2, s[1], s[2], chunk_size=C)
        row = {"case": "fused_moe host per chunk", "M": 128, "C": C, "chunks": 128 // C, "host_us": host_us(fn)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def rows_rows(w1, w2, calls: int) -> list[dict]:
    out = []
    sets = [inputs(16384, w1, seed) for seed in range(SETS)]
    for name, kw in (("one chunk", {}), ("rows R=8192", dict(chunk_size=8192, chunk_by="rows")),
                     ("tokens C=1024", dict(chunk_size=1024))):  # fmt: skip
        kernel = moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts(), **kw)
        fns = [lambda k=kernel, s=s: k(s[0], w1, w2, s[1], s[2]) for s in sets]
        n = max(24, calls // 40)
        row = {"case": "M=16384 " + name, "M": 16384, "eager_us": wall_us(fns, n), "graph_us": graph_us(fns, n),
               "host_us": host_us(fns[0], 20)}  # fmt: skip
        out.append(row)
        print(json.dumps(row), flush=True)
    base = out[0]["eager_us"]
    for r in out:
        r["eager_over_one_chunk"] = r["eager_us"] / base
    return out


def hf_rows(calls: int) -> list[dict]:
    import transformers

    import moekit.integrations.transformers as moekit_hf

    moekit_hf.register(name="moekit")
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=K, moe_intermediate_size=N // 2, intermediate_size=6144, num_experts=E,
        num_experts_per_tok=TOPK, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=256, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to("cuda").eval()
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02)
    out = []
    for M in (1, 128):
        sets = [inputs(M, None, seed) for seed in range(SETS)]
        sets = [(h, w.float(), i.long()) for h, w, i in sets]
        for impl in ("moekit", "batched_mm", "grouped_mm"):
            model.set_experts_implementation(impl)

            def call(s, m=experts):
                with torch.no_grad():
                    return m(s[0], s[2], s[1])

            fns = [lambda s=s: call(s) for s in sets]
            row = {"case": "hf experts", "impl": impl, "M": M, "eager_us": wall_us(fns, calls // 2)}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"label": ARGS.label, "moekit_file": moekit.__file__, "torch": torch.__version__,
              "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}  # fmt: skip
    try:
        result["cpu"] = next(x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if "model name" in x)
    except (OSError, StopIteration):
        result["cpu"] = platform.processor()
    x = torch.zeros(64, device="cuda")
    result["bare_launch_host_us"] = host_us(lambda: _noop_kernel[(1,)](x, 64, BLOCK=64), 2000)
    result["torch_empty_host_us"] = host_us(lambda: torch.empty(64, device="cuda"), 2000)
    print(json.dumps(result), flush=True)
    w1, w2 = weights()
    with torch.no_grad():
        if ARGS.only == "rows":
            result["rows"] = rows_rows(w1, w2, ARGS.calls)
        else:
            result["rows"] = layer_rows(w1, w2, ARGS.calls, ARGS.quick) + fused_moe_rows(w1, w2, ARGS.calls)
        if not ARGS.quick and ARGS.only is None:
            result["rows"] += rows_rows(w1, w2, ARGS.calls)
        if ARGS.hf and ARGS.only is None:
            del w1, w2
            torch.cuda.empty_cache()
            result["rows"] += hf_rows(ARGS.calls)
    out = Path(ARGS.out) / f"eager-{ARGS.label}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
