"""A same-process run of moekit beside OpenAI's triton_kernels (``../shared/anchors/tk_anchor.py``), read back.

The run's JSON holds one row per (shape, M, contender): the layer's time (``us``; a CUDA graph at
small M), its relative error against an fp32 reference, and at large M a profiler breakdown
(``phases.top``: kernel name -> µs). :func:`peer_rows` turns it into one row per (shape, M) with
each contender's layer time and, where profiled, each one's GEMM time counted like for like: every
GEMM kernel plus the activation (triton_kernels fuses SwiGLU into its first GEMM; moekit runs
``_silu_and_mul_kernel`` after it unless ``fuse_activation``).
"""

from __future__ import annotations

import json
from pathlib import Path

from moekit.errors import InvalidInputError

# Kernels that count as "GEMMs + activation", by name prefix, per library
GEMM_KERNELS = {"moekit": ("_fused_moe_kernel", "_persistent_moe_kernel", "_silu_and_mul_kernel"),
                "tk": ("_p_matmul_ogs", "_matmul_ogs")}  # fmt: skip


def gemm_us(contender: str, top: list[dict]) -> float | None:
    """µs of the GEMM kernels and the activation in a profiler breakdown, or None without one."""
    prefixes = GEMM_KERNELS["tk" if contender.startswith("tk") else "moekit"]
    found = [k["us"] for k in top if k["name"].startswith(prefixes)]
    return sum(found) if found else None


def peer_rows(path: str | Path) -> list[dict]:
    """One row per (shape, M): ``<contender> us`` (layer), ``<contender> gemm us``, ``<contender> err``."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"expected a tk_anchor result file, got {path} (no such file)")
    run = json.loads(path.read_text())
    if "layer" not in run:
        raise InvalidInputError(f"{path} holds no 'layer' rows: not a tk_anchor result file")
    rows: dict[tuple, dict] = {}
    for r in run["layer"]:
        if "contender" not in r or r.get("status") != "ok":
            continue
        row = rows.setdefault((r["shape"], r["M"]), {"shape": r["shape"], "M": r["M"], "floor us": r.get("floor_us")})
        name = r["contender"]
        row[f"{name} us"] = r["us"]
        row[f"{name} err"] = r.get("rel_err_vs_fp32_ref")
        g = gemm_us(name, (r.get("phases") or {}).get("top", []))
        if g is not None:
            row[f"{name} gemm us"] = g
    return list(rows.values())
