"""Tiles for the TritonExperts GPU check (``benchmarks/gpu_check_triton.py``).

- :func:`C`: a short tile spec, ``"128x256x64 g8 w8 s3 t"``, as a ``KernelConfig``;
- :data:`SWEEP`: the candidates per (dtype, bucket, GEMM) that the check times beside the
  committed table's tile;
- :class:`FixedTiles`: ``TritonExperts`` whose ``tile_configs`` returns fixed tiles;
- :func:`compile_only`: compile GEMM and align variants in parallel threads before timing. It
  swaps the function in moekit's private launchers for its ``warmup``: a shortcut of this check
  only (the check falls back to compiling on first use when it fails).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch

import moekit.hopper.align as align_mod
import moekit.hopper.grouped_gemm as gemm_mod  # moekit first: it turns the interpreter on before triton loads
from moekit.hopper.configs import KernelConfig
from moekit.hopper.experts import HopperTritonExperts
from moekit.types import ProblemSize

_FLAGS = {"t": "tma", "p": "persistent", "ws": "warp_specialize", "i": "interleave"}


def C(spec: str) -> KernelConfig:
    """'128x256x64 g8 w8 s3 t' -> KernelConfig (t: TMA weights, p: persistent, ws: warp-specialized,
    i: gate and up interleaved in one accumulator, tail32: TAIL_M=32)."""
    parts = spec.split()
    bm, bn, bk = map(int, parts[0].split("x"))
    flags = {_FLAGS[p]: True for p in parts[1:] if p in _FLAGS}
    tail = [int(p[4:]) for p in parts[1:] if p.startswith("tail")]
    numbers = [p for p in parts[1:] if p not in _FLAGS and not p.startswith("tail")]
    kw = {"g": 8, "w": 4, "s": 3} | {p[0]: int(p[1:]) for p in numbers}
    return KernelConfig(bm, bn, bk, GROUP_M=kw["g"], num_warps=kw["w"], num_stages=kw["s"],
                        TAIL_M=tail[0] if tail else 0, **flags)  # fmt: skip


def _specs(text: str) -> list[KernelConfig]:
    return [C(s.strip()) for s in text.split(",")]


# Candidates per (dtype, bucket, GEMM); the table's own tile is always timed first. Shared memory
# (stages x (BM*BK + BN*BK) x bytes, two weight tiles when gated) stays under 227 KB, and each
# was compiled for sm_90 with triton 3.6 without register spills (fp8 gated at 128 x 128 spills).
_LARGE = "128x256x64 w8, 128x256x64 w8 t, 128x256x64 w8 s4, 128x128x64 w8, 128x128x64 w8 t, 128x128x64 w4 s4, " \
         "256x128x64 w8, 64x256x64 w4 s4, 64x256x64 w4 s4 t, 64x128x64 w4 s4, 128x128x128 w8"  # fmt: skip
_DECODE = "16x128x128 g1, 16x128x128 g1 t, 16x64x128 g1 s4, 16x128x128 g1 s4, 16x256x128 g1 w8, 16x64x128 g1 t"
SWEEP = {
    ("bf16", "decode"): {
        "gemm1": _specs(_DECODE),
        "gemm1_gated": _specs("16x64x128 g1, 16x64x128 g1 t, 16x64x128 g1 s4, 16x128x128 g1, 16x32x128 g1 s4"),
        "gemm2": _specs(_DECODE),
    },
    ("bf16", "large"): {
        "gemm1": _specs(_LARGE),
        "gemm1_gated": _specs(
            "128x128x64 w8, 128x128x64 w8 t, 128x128x64 w8 s4, 64x128x64 w4 s4, 64x128x64 w4 s4 t, "
            "64x128x64 w8 s4, 128x64x64 w4 s4, 256x64x64 w8"
        ),
        "gemm2": _specs(_LARGE),
    },
    ("fp8", "large"): {
        "gemm1": _specs("64x256x128 w8, 64x256x128 w8 t, 128x128x128 w8, 128x128x128 w8 t, 64x128x128 w4 s4"),
        "gemm1_gated": _specs("64x128x128 w8, 64x128x128 w8 t, 64x128x128 w8 s4, 64x128x128 w8 s4 t"),
        "gemm2": _specs("64x256x128 w8, 64x256x128 w8 t, 128x128x128 w8, 128x128x128 w8 t, 64x128x128 w4 s4"),
    },
}


def _launchers() -> list:
    """The launchers whose kernels a sweep compiles: the grouped GEMM's two (one program per tile, the
    persistent walk) and the align's four."""
    return [gemm_mod._GEMM, gemm_mod._PERSISTENT, align_mod._ONE_LAUNCH, align_mod._COUNT, align_mod._SCAN,
            align_mod._SCATTER]  # fmt: skip


class _WarmupOnly:
    """Stands in for a ``@triton.jit`` function: ``f[grid](*args)`` compiles (``warmup``) and launches nothing."""

    def __init__(self, fn):
        self.fn, self.__name__ = fn, fn.__name__

    def __getitem__(self, grid):
        def compile_it(*args, **kwargs):
            self.fn.warmup(*args, grid=grid, **kwargs)
            # None: the launcher keeps no variant (what warmup returns under AsyncCompileMode is a
            # handle of a compile in flight, not a kernel to launch later)

        return compile_it


@contextlib.contextmanager
def compile_only(threads: int):
    """Inside, GEMM and align launches only compile, in parallel threads; all done on exit.

    moekit launches through ``moekit.hopper.launch.LeanLauncher`` objects that hold the jitted
    function, so it is their ``fn`` that is swapped (swapping the modules' kernel names would
    change nothing). Variants already kept by a launcher still launch (they are compiled).
    """
    import triton

    launchers = _launchers()
    saved = [(launcher, launcher.fn) for launcher in launchers]
    for launcher, fn in saved:
        launcher.fn = _WarmupOnly(fn)
    try:
        with triton.AsyncCompileMode(ThreadPoolExecutor(threads), ignore_errors=True):
            yield
    finally:
        for launcher, fn in saved:
            launcher.fn = fn


class FixedTiles(HopperTritonExperts):
    """HopperTritonExperts with fixed ``(GEMM1, GEMM2)`` tiles instead of the committed table's."""

    def __init__(self, configs: tuple[KernelConfig, KernelConfig], **kwargs):
        super().__init__(**kwargs)
        self.configs = configs

    def tile_configs(self, problem: ProblemSize, dtype: torch.dtype) -> tuple[KernelConfig, KernelConfig]:
        return self.configs
