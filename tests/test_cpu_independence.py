"""moekit's promises must hold on every CPU, not just this one.

Under the interpreter ``tl.dot`` is numpy's matmul, and numpy's OpenBLAS picks its kernel per CPU
at run time; a row's rounding can depend on where it sits in the tile. A fresh clone once failed
on an AMD EPYC machine because two tests asserted bit-identity between chunked and unchunked
runs. ``OPENBLAS_CORETYPE`` forces another CPU's kernel on this machine, so the chunking tests run
here under the kernels of other CPU families (Haswell and Zen reproduce the EPYC failure). A core
type whose kernels are the ones this CPU runs anyway (OpenBLAS reports which it runs) is skipped:
the suite's own run of those tests has run them.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHUNKING_TESTS = [
    "tests/experts/test_triton.py::test_chunked_equals_unchunked_equals_reference",
    "tests/experts/test_triton.py::test_fused_activation",
    "tests/experts/test_deep_gemm.py::test_chunked_equals_unchunked",
]

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="OPENBLAS_CORETYPE names x86-64 kernels"
)


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


# A forced kernel runs only on a CPU that has its instructions: SkylakeX's AVX-512 kernels die with
# "Illegal instruction" on a CPU without them (an AMD EPYC of CI's kind, for one).
NEEDS = {"Haswell": "avx2", "Zen": "avx2", "SkylakeX": "avx512f"}


# Which kernels numpy's OpenBLAS runs: the name of the kernel table it picked (OpenBLAS's own report).
# A build may map a core type onto another one's kernels (this numpy's runs Haswell's for "Zen").
_KERNELS = """
import ctypes, numpy
from pathlib import Path
for lib in sorted({l.split()[-1] for l in Path("/proc/self/maps").read_text().splitlines() if "openblas" in l.lower()}):
    for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                 "openblas_get_corename"):
        fn = getattr(ctypes.CDLL(lib), name, None)
        if fn is not None:
            fn.restype = ctypes.c_char_p
            print(fn().decode())
            raise SystemExit
"""


def _openblas_kernels(env: dict) -> str | None:
    """The kernel table numpy's OpenBLAS runs under ``env``, or None when it cannot say."""
    try:
        done = subprocess.run([sys.executable, "-c", _KERNELS], env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("coretype", ["Haswell", "Zen", "SkylakeX"])
def test_chunking_promises_hold_under_other_cpu_kernels(coretype):
    if NEEDS[coretype] not in _cpu_flags():
        pytest.skip(f"this CPU has no {NEEDS[coretype]}, which OpenBLAS's {coretype} kernels need")
    env = {**os.environ, "OPENBLAS_CORETYPE": coretype, "MOEKIT_DEVICE": "cpu"}
    forced, own = _openblas_kernels(env), _openblas_kernels(dict(os.environ))
    if forced is not None and forced == own:  # the suite's own run of CHUNKING_TESTS already ran these kernels
        pytest.skip(f"OPENBLAS_CORETYPE={coretype} runs OpenBLAS's {forced} kernels, the ones this CPU runs "
                    "anyway: the suite's own run of the chunking tests covers them")  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CHUNKING_TESTS]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"OPENBLAS_CORETYPE={coretype}:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
