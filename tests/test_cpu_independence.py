"""moekit's promises must hold on every CPU, not just this one.

Under the interpreter ``tl.dot`` is numpy's matmul, and numpy's OpenBLAS picks its kernel per CPU
at run time; a row's rounding can depend on where it sits in the tile. A fresh clone once failed
on an AMD EPYC machine because two tests asserted bit-identity between chunked and unchunked
runs. ``OPENBLAS_CORETYPE`` forces another CPU's kernel on this machine, so the chunking tests run
here under the kernels of other CPU families (Haswell and Zen reproduce the EPYC failure).
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


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("coretype", ["Haswell", "Zen", "SkylakeX"])
def test_chunking_promises_hold_under_other_cpu_kernels(coretype):
    if NEEDS[coretype] not in _cpu_flags():
        pytest.skip(f"this CPU has no {NEEDS[coretype]}, which OpenBLAS's {coretype} kernels need")
    env = {**os.environ, "OPENBLAS_CORETYPE": coretype, "MOEKIT_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CHUNKING_TESTS]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"OPENBLAS_CORETYPE={coretype}:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
