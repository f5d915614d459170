"""moekit beside transformers' own experts implementations, on one real-shaped MoE layer.

Builds a one-layer Qwen3-MoE from a config with Qwen3-30B-A3B's dimensions (E=128, topk=8,
hidden 2048, intermediate 768; random weights, no download), bf16 and fine-grained fp8
(:func:`moekit.integrations.hf_fp8.to_fp8_experts`), and times its experts module through every
``experts_implementation`` that runs here: ``moekit``, ``grouped_mm``, ``batched_mm``,
``sonicmoe`` and ``deepgemm`` (when importable and usable), eager and as a CUDA graph, at each M.
Each output is checked against ``eager`` (bf16) or the fp8 oracle on a sample of tokens first; an
implementation that cannot run (a missing kernel, no memory) gets its error in the table::

    python -m benchmarks.gpu_hf_experts [--M 1 128 4096 16384] [--dtypes bf16 fp8] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moekit
import moekit.integrations.transformers as moekit_hf
from benchmarks.harness import common, measure
from moekit.integrations.hf_fp8 import fp8_reference_forward, to_fp8_experts

IMPLS = ("moekit", "grouped_mm", "batched_mm", "sonicmoe", "deepgemm")
BATCHED_MM_MAX_BYTES = 40 * 2**30  # batched_mm gathers one weight matrix per (token, slot)


def build_experts(dtype: str):
    import transformers

    shape = moekit.roofline.get_shape("qwen3_30b_a3b")
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=shape.K, moe_intermediate_size=shape.N // 2, intermediate_size=6144,
        num_experts=shape.E, num_experts_per_tok=shape.topk, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=256, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to("cuda").eval()
    with torch.no_grad():
        for p in model.model.layers[0].mlp.experts.parameters():
            p.normal_(0.0, 0.02)
    if dtype == "fp8":
        to_fp8_experts(model)
    return model, model.model.layers[0].mlp.experts, shape


def routing(M: int, shape, seed: int):
    r = moekit.routing.uniform_router(M, shape.E, shape.topk, seed=seed, device="cuda")
    g = torch.Generator("cuda").manual_seed(seed)
    hidden = torch.randn(M, shape.K, generator=g, device="cuda").bfloat16()
    return hidden, r.topk_ids.long(), r.topk_weights.float()


def run(Ms, dtypes, impls) -> list[dict]:
    moekit_hf.register(name="moekit")
    rows = []
    for dtype in dtypes:
        model, experts, shape = build_experts(dtype)
        for M in Ms:
            hidden, ids, weights = routing(M, shape, seed=M)
            sample = slice(0, min(M, 64))
            with torch.no_grad():
                if dtype == "fp8":
                    want = fp8_reference_forward(experts, hidden[sample], ids[sample], weights[sample]).float()
                else:
                    model.set_experts_implementation("eager")
                    want = experts(hidden[sample], ids[sample], weights[sample]).float()
            for impl in impls:
                row = {"dtype": dtype, "M": M, "impl": impl}
                try:
                    if impl == "batched_mm" and M * shape.topk * shape.N * shape.K * 2 > BATCHED_MM_MAX_BYTES:
                        raise MemoryError(f"batched_mm would gather {M * shape.topk} weight matrices")
                    model.set_experts_implementation(impl)

                    def call(x=hidden, i=ids, w=weights, m=experts):
                        with torch.no_grad():
                            return m(x, i, w)

                    row["rel_err"] = measure.rel_error(call()[sample].float(), want)
                    row["us"] = measure.eager_us(call)
                    try:
                        row["graph_us"] = measure.graph_us([call])
                    except Exception as e:  # a host sync or an uncapturable kernel: a result
                        row["graph_error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    row["status"] = "ok"
                except Exception as e:
                    row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    if not isinstance(e, (MemoryError, KeyError, ValueError, ImportError)):
                        traceback.print_exc(file=sys.stderr)
                torch.cuda.empty_cache()
                rows.append(row)
                print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del model, experts
        torch.cuda.empty_cache()
    for r in rows:  # moekit's ratio to each implementation, same dtype and M
        mk = next((x for x in rows if x["dtype"] == r["dtype"] and x["M"] == r["M"] and x["impl"] == "moekit"
                   and x.get("us")), None)  # fmt: skip
        if mk and r.get("us"):
            r["moekit_speedup"] = r["us"] / mk["us"]
            if r.get("graph_us") and mk.get("graph_us"):
                r["moekit_speedup_graph"] = r["graph_us"] / mk["graph_us"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_hf_experts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--M", type=int, nargs="+", default=[1, 128, 4096, 16384])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS))
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    reason = common.gpu_or_reason()
    if reason is not None:
        print(f"gpu_hf_experts: needs a CUDA GPU ({reason})", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = run(args.M, args.dtypes, args.impls)
    env = common.environment()
    cols = ["dtype", "M", "impl", ("us", "eager us", ".1f"), ("graph_us", "graph us", ".1f"),
            ("moekit_speedup", "x slower than moekit", ".2f"), ("rel_err", "rel err", ".1e"), "status"]  # fmt: skip
    print(common.format_table(rows, cols))
    path = common.write_json("hf-experts", env, {"shape": "qwen3_30b_a3b", "rows": rows}, directory=args.out)
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
