"""SASS of the Qwen3-30B-A3B bf16 GEMMs at M=16384, moekit's wing beside triton_kernels, compiled offline.

    .venv/bin/python -m benchmarks.research.sass_compare [--tk DIR] [--dump DIR] [--gemm1 SPECS] [--fp8]

CPU only: both libraries' host code runs on untouched CPU tensors while Triton is shown an sm_90a
device with 132 SMs and 227 KiB of shared memory per block (an H200); each launch compiles, none
runs. moekit: gated GEMM1 (silu_and_mul in the epilogue) and GEMM2 with the tile table's configs;
triton_kernels 3.6: ``matmul_ogs`` as ``../shared/anchors/tk_anchor.py`` calls it (row gather and a
fused silu(gate) * up, then the scatter with fp32 gammas), with the opt flags its heuristics pick.
The main loop is the innermost conditional backward branch around HGMMA (QGMMA for fp8); in triton_kernels' flattened
tile walk it also holds once-per-tile code behind forward branches, so the steady path drops what
those branches jump over (and never-run ``@!PT`` fillers). Counts are per warp per K-step; per 1k
MACs multiplies by the warps and divides by the block's MACs per K-step. SASS says what is issued,
not how long it waits: nothing about speed by itself. The H200 runs Triton 3.6 (this venv: 3.9):
``pip install --no-deps --target /tmp/t36 triton==3.6.0`` and ``PYTHONPATH=/tmp/t36`` compile with
it (registers and shared memory then match Nsight Compute's: ``checks/ncu-*-qwen3-16384-*``).
``--fp8``: moekit's fp8 GEMMs instead (DeepSeek-V3-like, M=16384, as the fp8 layer runs them: gated GEMM1
with fp8 out and 1x128 scales, then GEMM2), the ``--gemm1`` tiles in fp8; triton_kernels is not compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import subprocess
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path

if __name__ == "__main__":  # compiled kernels, not the interpreter: set before moekit, in this script's
    os.environ["TRITON_INTERPRET"] = "0"  # own process only (a test importing it must not switch its own)
import moekit  # noqa: F401,I001  (first: it reads the switch)
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

M, E, TOPK, K, I = 16384, 128, 8, 2048, 768
BF16 = torch.bfloat16
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# class -> opcodes (the part before the first dot; U-prefixed uniform forms count with their class)
CLASSES = {
    "HGMMA": "HGMMA QGMMA",  # (QGMMA: the fp8 form)
    "WARPGROUP arrive/wait": "WARPGROUP",
    "TMA load (UTMALDG)": "UTMALDG",
    "LDGSTS (cp.async)": "LDGSTS",
    "LDG": "LDG",
    "LDS/LDSM": "LDS LDSM",
    "STS": "STS STSM",
    "global/TMA store": "STG UTMASTG RED ATOMG",
    "barrier/sync": "BAR SYNCS WARPSYNC DEPBAR LDGDEPBAR MEMBAR FENCE ARRIVES CCTL",
    "int/address": "IMAD IADD3 IADD LEA SHF LOP3 IABS IMNMX SGXT VIADD VIADDMNMX VIMNMX PRMT MOV SEL FLO POPC BMSK",
    "predicate/branch": "ISETP PLOP3 P2R R2P BRA BSSY BSYNC EXIT VOTE VOTEU ELECT",
    "other": "",
}
OPCLASS = {op: c for c, ops in CLASSES.items() for op in ops.split()}
GMMA = ("HGMMA", "QGMMA")  # warpgroup MMAs: 16-bit, fp8


def op_class(ins: str) -> str:
    op = ins.split(".")[0].split()[0]
    return OPCLASS.get(op) or OPCLASS.get(op[1:] if op.startswith("U") else op, "other")


@contextlib.contextmanager
def offline_h200(compiled: list):
    """Inside, every Triton launch compiles for sm_90a (appended to ``compiled``) and runs nothing."""
    props = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232448)
    cuda = torch.cuda
    saved = JITFunction.run, cuda.get_device_properties, cuda.get_device_capability, cuda.current_device

    def compile_only(self, *args, grid, warmup, **kwargs):
        compiled.append(saved[0](self, *args, grid=grid, warmup=True, **kwargs))
        return compiled[-1]

    driver.set_active(types.SimpleNamespace(  # what Triton asks of the driver, for a device that is not here
        get_current_target=lambda: GPUTarget("cuda", 90, 32), get_current_device=lambda: 0,
        get_current_stream=lambda *_: 0))  # fmt: skip
    JITFunction.run, cuda.get_device_properties = compile_only, lambda *_: props
    cuda.get_device_capability, cuda.current_device = lambda *_: (9, 0), lambda: 0
    try:
        yield
    finally:
        JITFunction.run, cuda.get_device_properties, cuda.get_device_capability, cuda.current_device = saved
        driver.set_active(None)  # (reset_active would look for a real GPU)


def layout(pairs: int, experts: int, block_m: int):
    """An uninitialized aligned layout of ``pairs`` over ``experts`` (its values do not change the code)."""
    from moekit.kernels.align import AlignedBlocks, align_shape

    shape = align_shape(pairs, experts, experts, block_m)
    return AlignedBlocks(torch.empty(shape.size, dtype=torch.int32), shape)


def moekit_gemms(extra: tuple = ()) -> list[tuple[str, object, dict]]:
    """moekit's two GEMMs as ``HopperTritonExperts(fuse_activation=True)`` launches them, then gated
    GEMM1 with each config of ``extra`` (``KernelConfig``s)."""
    from moekit.hopper import grouped_gemm as gg
    from moekit.hopper.configs import get_config
    from moekit.hopper.gemm_args import GatedOutput

    gg.sm_count = lambda _: 132  # (a cached CUDA query)
    cfg1 = get_config(M, 2 * I, K, E, TOPK, BF16, stage=1, gated=True)
    cfg2 = get_config(M, K, I, E, TOPK, BF16, stage=2)
    blocks = lambda block_m: layout(M * TOPK, E, block_m)
    empty = lambda *shape: torch.empty(*shape, dtype=BF16)
    compiled = []
    with offline_h200(compiled):
        gg.fused_moe_gemm(empty(M, K), empty(E, 2 * I, K), empty(M, TOPK, I), blocks(cfg1.BLOCK_M), pairs_per_row=TOPK,
                          config=cfg1, gated=GatedOutput())  # fmt: skip
        gg.fused_moe_gemm(empty(M * TOPK, I), empty(E, K, I), empty(M, TOPK, K), blocks(cfg2.BLOCK_M), pairs_per_row=1,
                          config=cfg2)  # fmt: skip
        for cfg in extra:
            w1, gated = empty(E, 2 * I, K), GatedOutput()
            gg.fused_moe_gemm(empty(M, K), w1, empty(M, TOPK, I), blocks(cfg.BLOCK_M), pairs_per_row=TOPK, config=cfg,
                              gated=gated)  # fmt: skip
    gemms = ((cfg1, 2, K), (cfg2, 1, I), *((c, 2, K) for c in extra))  # (a gated product is 2 * BLOCK_N wide)
    tiles = [dict(BM=c.BLOCK_M, BN=c.BLOCK_N * n, BK=c.BLOCK_K, K=k, note=str(c)) for c, n, k in gemms]
    names = ["moekit GEMM1 gated", "moekit GEMM2", *(f"moekit GEMM1 gated #{i + 1}" for i in range(len(extra)))]
    return list(zip(names, compiled, tiles, strict=True))


def moekit_fp8_gemms(extra: tuple = ()) -> list[tuple[str, object, dict]]:
    """moekit's fp8 GEMMs at DeepSeek-V3-like sizes as the fp8 layer launches them, with the table's configs:
    gated GEMM1 (fp8 out with its 1x128 scales), gated GEMM1 with each of ``extra``, GEMM2, and GEMM1 without
    the activation (bf16 out, as ``fuse_activation=False`` runs it)."""
    from moekit.hopper import grouped_gemm as gg
    from moekit.hopper.configs import get_config
    from moekit.hopper.gemm_args import GatedOutput
    from moekit.quant import FP8

    gg.sm_count = lambda _: 132
    m, e, k, i = M, 256, 7168, 2048
    gemm1 = (get_config(m, 2 * i, k, e, TOPK, FP8, stage=1, gated=True), *extra)
    gemm2 = get_config(m, k, i, e, TOPK, FP8, stage=2)
    plain1 = get_config(m, 2 * i, k, e, TOPK, FP8, stage=1)  # GEMM1 without the activation (bf16 out)
    blocks = lambda block_m: layout(m * TOPK, e, block_m)
    fp8 = lambda *shape: torch.empty(*shape, dtype=FP8)
    compiled = []
    with offline_h200(compiled):
        for cfg in gemm1:
            gated = GatedOutput(out_scale=torch.empty(i // 128, m * TOPK).t())  # column-major, as the layer's
            gg.fused_moe_gemm(fp8(m, k), fp8(e, 2 * i, k), fp8(m, TOPK, i), blocks(cfg.BLOCK_M), pairs_per_row=TOPK,
                              config=cfg, a_scale=torch.empty(k // 128, m).t(),
                              w_scale=torch.empty(e, 2 * i // 128, k // 128), gated=gated)  # fmt: skip
        gg.fused_moe_gemm(fp8(m * TOPK, i), fp8(e, k, i), torch.empty(m, TOPK, k, dtype=BF16), blocks(gemm2.BLOCK_M),
                          pairs_per_row=1, config=gemm2, a_scale=torch.empty(i // 128, m * TOPK).t(),
                          w_scale=torch.empty(e, k // 128, i // 128))  # fmt: skip
        gg.fused_moe_gemm(fp8(m, k), fp8(e, 2 * i, k), torch.empty(m, TOPK, 2 * i, dtype=BF16), blocks(plain1.BLOCK_M),
                          pairs_per_row=TOPK, config=plain1, a_scale=torch.empty(k // 128, m).t(),
                          w_scale=torch.empty(e, 2 * i // 128, k // 128))  # fmt: skip
    tiles = [dict(BM=c.BLOCK_M, BN=2 * c.BLOCK_N, BK=c.BLOCK_K, K=k, note=str(c), bytes=1) for c in gemm1]
    tiles.append(dict(BM=gemm2.BLOCK_M, BN=gemm2.BLOCK_N, BK=gemm2.BLOCK_K, K=i, note=str(gemm2), bytes=1))
    tiles.append(dict(BM=plain1.BLOCK_M, BN=plain1.BLOCK_N, BK=plain1.BLOCK_K, K=k, note=str(plain1), bytes=1))
    names = ["moekit fp8 GEMM1 gated", *(f"moekit fp8 GEMM1 gated #{n + 1}" for n in range(len(extra)))]
    return list(zip([*names, "moekit fp8 GEMM2", "moekit fp8 GEMM1"], compiled, tiles, strict=True))


@triton.jit
def _silu_gate_times_up(x):
    """triton_kernels' GEMM1 columns interleave gate and up (g0, u0, g1, u1, ...)."""
    gate, up = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    gate = gate.to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)


def tk_gemms(tk_dir: Path) -> list[tuple[str, object, dict]]:
    """triton_kernels' two ``matmul_ogs`` calls (uniform routing: index values do not change the code)."""
    sys.path.insert(0, str(tk_dir))
    import triton_kernels.matmul_ogs as tk
    from triton_kernels.tensor import make_ragged_tensor_metadata_torch

    flags, make = [], tk.make_opt_flags
    tk.make_opt_flags = lambda *a, **k: flags.append(make(*a, **k)) or flags[-1]
    n = M * TOPK
    combine = torch.argsort(torch.arange(n) % E, stable=True).to(torch.int32)  # expert-sorted row -> pair
    dispatch = torch.argsort(combine).to(torch.int32)
    meta = make_ragged_tensor_metadata_torch(torch.full((E,), n // E, dtype=torch.int32), n)
    gammas = torch.empty(n, dtype=torch.float32)  # fp32, as its topk makes them from fp32 logits
    routing = tk.RoutingData(gammas, meta.slice_sizes, E, TOPK, meta)
    act = tk.FusedActivation(tk.FnSpecs("silu_mul", _silu_gate_times_up, (), reduction_n=2), ())
    compiled = []
    try:
        with offline_h200(compiled):  # w as [E, K, N], N-contiguous (the anchor's "kn" layout)
            h = tk.matmul_ogs(torch.empty(M, K, dtype=BF16), torch.empty(E, K, 2 * I, dtype=BF16), None, routing,
                              gather_indx=tk.GatherIndx(combine, dispatch), fused_activation=act)  # fmt: skip
            tk.matmul_ogs(h, torch.empty(E, I, K, dtype=BF16), None, routing,
                          scatter_indx=tk.ScatterIndx(dispatch, combine), gammas=gammas)  # fmt: skip
    finally:
        tk.make_opt_flags = make
    gemms = [k for k in compiled if "_reduce" not in k.name]  # (not its top-k sum after GEMM2)
    keys = "block_m block_n block_k num_warps num_stages group_m split_k is_persistent epilogue_subtile".split()
    note = lambda f: " ".join(f"{k}={getattr(f, k)}" for k in keys)
    tiles = [
        dict(BM=f.block_m, BN=f.block_n, BK=f.block_k, K=k, note=note(f)) for f, k in zip(flags, (K, I), strict=True)
    ]
    return list(zip(["triton_kernels GEMM1 +act", "triton_kernels GEMM2"], gemms, tiles, strict=True))


def cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([BIN / "cuobjdump", flag, f.name], capture_output=True, text=True, check=True).stdout


def sass(cubin: bytes) -> tuple[str, list[tuple[int, str, str]]]:
    """The cubin's function name and ``(address, predicate, instruction)`` of each SASS line."""
    text = cuobjdump(cubin, "-sass")
    lines = re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([^;]+);", text)
    return re.search(r"Function : (\S+)", text)[1], [(int(m[1], 16), (m[2] or "").strip(), m[3]) for m in lines]


def target(ins: str) -> int | None:
    m = re.match(r"BRA(?:\.\S+)?\s+0x([0-9a-f]+)", ins)
    return int(m[1], 16) if m else None


def main_loop(code):
    """``(start, end, steady-path instructions, skipped regions)`` of the main loop, and the tile walk's range."""
    back = [(target(i), a, p) for a, p, i in code if target(i) is not None and target(i) < a]
    mma = [(s, e) for s, e, p in back if p and any(s <= a <= e and i.startswith(GMMA) for a, _, i in code)]
    start, end = min(mma, key=lambda se: se[1] - se[0])
    skipped = [(a + 16, target(i)) for a, _, i in code if start <= a < end and target(i) and a < target(i) <= end]
    live = lambda a, p: start <= a <= end and p != "@!PT" and not any(s <= a < t for s, t in skipped)
    # the tile walk: the loop around the main loop (moekit's ends in an unconditional BRA after its EXIT test),
    # or the main loop itself where the walk is flattened into it (triton_kernels)
    walks = [(s, e) for s, e, _ in back if s <= start and end <= e and (s, e) != (start, end)] or [(start, end)]
    tile = min(walks, key=lambda se: se[1] - se[0])
    return start, end, [i for a, p, i in code if live(a, p)], skipped, tile


def report(name: str, kernel, tile: dict) -> dict:
    (function, code), meta = sass(kernel.asm["cubin"]), kernel.metadata
    res = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", cuobjdump(kernel.asm["cubin"], "-res-usage")))
    start, end, steady, skipped, (t0, t1) = main_loop(code)
    per_tile = sum(t0 <= a <= t1 and p != "@!PT" for a, p, _ in code) - len(steady)  # static, outside the steady path
    shapes = Counter(i.split()[0] for i in steady if i.startswith(GMMA))
    macs = {s: math.prod(int(x) for x in re.match(r"[HQ]GMMA\.(\d+)x(\d+)x(\d+)", s).groups()) for s in shapes}
    trip_macs = meta.num_warps // 4 * sum(n * macs[s] for s, n in shapes.items())  # one HGMMA per warpgroup
    kstep_macs = tile["BM"] * tile["BN"] * tile["BK"]
    ksteps = trip_macs / kstep_macs  # K-steps per loop trip (1 unless the loop was unrolled)
    counts = Counter(op_class(i) for i in steady)
    per_k = {c: counts[c] / ksteps for c in CLASSES}
    print(f"\n== {name} (cubin function {function})\n   config: {tile['note']}")
    print(
        f"   registers {res['REG']}, spills (local memory) {res['LOCAL']} B/thread, stack {res['STACK']} B, dynamic "
        f"shared memory {meta.shared} B, {meta.num_warps} warps, {meta.num_stages} stages; {len(code)} instructions"
    )
    print(f"   main loop {start:#x}-{end:#x} ({sum(start <= a <= end for a, _, _ in code)} instructions), steady path "
          f"{len(steady)}, {ksteps:g} K-step(s) per trip, {kstep_macs} MACs per block per K-step; skipped: "
          + (", ".join(f"{s:#x}-{t:#x}" for s, t in skipped) or "none"))  # fmt: skip
    print("   " + ", ".join(f"{s} x{n}" for s, n in shapes.items()) + " per warp per trip")
    k_per_tile = -(-tile["K"] // tile["BK"])
    print(f"   tile walk {t0:#x}-{t1:#x}: {per_tile} static instructions per tile besides the steady path (setup, "
          f"epilogue), {per_tile / k_per_tile:.1f} per K-step over {k_per_tile} K-steps per tile")  # fmt: skip
    print(f"   {'class':<24}{'per K-step':>11}{'per 1k MACs':>13}")
    for c, v in per_k.items():
        print(f"   {c:<24}{v:>11.1f}{v * meta.num_warps * 1000 / kstep_macs:>13.3f}")
    for c in ("barrier/sync", "LDGSTS (cp.async)", "other"):
        ops = Counter(i.split()[0] for i in steady if op_class(i) == c)
        print(f"   {c}: " + (", ".join(f"{o} {n / ksteps:g}" for o, n in ops.most_common(8)) or "-"))
    size = tile.get("bytes", 2)  # bytes per operand element
    a, b = size * tile["BM"] * tile["BK"], size * tile["BK"] * tile["BN"]
    print(f"   operand tiles per block per K-step ({size} B per element, from the config): A {a // 1024} KiB + "
          f"B {b // 1024} KiB = {(a + b) * 1000 / kstep_macs:.1f} B per 1k MACs")  # fmt: skip
    return dict(per_k=per_k, total=len(steady) / ksteps, regs=res["REG"], shared=meta.shared)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    found = [d / "triton_kernels-3.6" for d in (ROOT / "third_party", ROOT.parent / "shared" / "vendor")]
    found = [d for d in found if d.exists()]
    p.add_argument("--tk", type=Path, default=found[0] if found else None,
                   help="folder holding the triton_kernels package (release/3.6.x)")  # fmt: skip
    p.add_argument("--dump", type=Path, help="write each kernel's PTX and SASS here")
    p.add_argument("--gemm1", default="", help="more gated GEMM1 tiles, comma-separated benchmarks.triton_tiles.C "
                   "specs ('128x128x64 g8 w8 s4 t p i': i = gate and up in one interleaved accumulator)")  # fmt: skip
    p.add_argument("--fp8", action="store_true", help="moekit's fp8 GEMMs (DeepSeek-V3-like) instead")
    args = p.parse_args()
    if args.fp8:
        what = f"DeepSeek-V3-like fp8 E=256 topk={TOPK} K=7168 I=2048, M={M} ({M * TOPK // 256} rows per expert)"
    else:
        what = f"Qwen3-30B-A3B bf16 E={E} topk={TOPK} K={K} I={I}, M={M} ({M * TOPK // E} rows per expert)"
    print(f"triton {triton.__version__} ({Path(triton.__file__).parent}), sm_90a offline, 132 SMs; {what}")  # fmt: skip
    from benchmarks.triton_tiles import C

    extra = tuple(C(spec.strip()) for spec in args.gemm1.split(",") if spec.strip())
    kernels = moekit_fp8_gemms(extra) if args.fp8 else moekit_gemms(extra)
    if args.tk is None and not args.fp8:
        print("triton_kernels not found (--tk): moekit only")
    elif not args.fp8:
        print(f"triton_kernels from {args.tk}")
        kernels += tk_gemms(args.tk)
    rows = {name: report(name, kernel, tile) for name, kernel, tile in kernels}
    for name, kernel, _ in kernels if args.dump else ():
        args.dump.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"\W+", "_", name)
        (args.dump / f"{stem}.ptx").write_text(kernel.asm["ptx"])
        code = sass(kernel.asm["cubin"])[1]
        (args.dump / f"{stem}.sass").write_text("\n".join(f"{a:#06x} {p} {i}" for a, p, i in code))
    print("\n== steady path, SASS instructions per warp per K-step")
    print(f"   {'':<24}" + "".join(f"{n:>27}" for n in rows))
    for c in [*CLASSES, "total"]:
        print(f"   {c:<24}" + "".join(f"{r['total'] if c == 'total' else r['per_k'][c]:>27.1f}" for r in rows.values()))
    print(f"   {'registers / shared B':<24}" + "".join(f"{r['regs']} / {r['shared']}".rjust(27) for r in rows.values()))


if __name__ == "__main__":
    main()
