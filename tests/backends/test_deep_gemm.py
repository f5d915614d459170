"""moekit.backends.deep_gemm: detection never raises, and calls go to the API that exists."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from moekit import ModularKernel, QuantScheme
from moekit.backends import deep_gemm as dg
from moekit.errors import BackendUnavailableError, InvalidInputError
from moekit.experts import DeepGemmExperts
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.testing import assert_close


@pytest.fixture
def fresh_cache():
    dg.status(refresh=True)
    yield
    dg.status(refresh=True)  # the next status() probes the real machine again


def test_status_here_is_not_usable_and_says_why(fresh_cache):
    st = dg.status()
    assert isinstance(st, dg.DeepGemmStatus)
    if moekit_device_is_cpu():
        assert not st.usable and st.api is None
    assert st.reason
    assert dg.status() is st  # cached
    assert dg.status(refresh=True) == st


def moekit_device_is_cpu() -> bool:
    import moekit

    return moekit.device.get_device().type == "cpu"


def test_status_never_raises(fresh_cache, monkeypatch):
    def boom(name):
        raise RuntimeError("broken finder")

    monkeypatch.setattr(importlib.util, "find_spec", boom)
    st = dg.status(refresh=True)
    assert not st.usable and "broken finder" in st.reason


def _fake_package(tmp_path, monkeypatch, *, headers: bool):
    pkg = tmp_path / "deep_gemm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported before the cheap checks')\n")
    if headers:
        for d in ("deep_gemm/impls", "cute", "cutlass"):
            (pkg / "include" / d).mkdir(parents=True)
        (pkg / "include" / "deep_gemm" / "impls" / "gemm.cuh").write_text("// header\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    importlib.invalidate_caches()


def test_installed_without_headers_is_not_usable(fresh_cache, tmp_path, monkeypatch):
    _fake_package(tmp_path, monkeypatch, headers=False)
    st = dg.status(refresh=True)
    assert not st.usable
    assert "no JIT headers" in st.reason and "deep-gemm==1.0.0" in st.reason


@pytest.mark.skipif(not moekit_device_is_cpu(), reason="checks the CPU machine's reason")
def test_headers_present_but_no_gpu(fresh_cache, tmp_path, monkeypatch):
    _fake_package(tmp_path, monkeypatch, headers=True)
    st = dg.status(refresh=True)
    assert not st.usable and "no CUDA device" in st.reason


def test_detect_api_names():
    def fn(*args):
        return None

    assert dg.detect_api(SimpleNamespace(m_grouped_gemm_fp8_fp8_bf16_nt_contiguous=fn)) == "1.0"
    assert dg.detect_api(SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=fn)) == "v2"
    both = SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=fn, m_grouped_gemm_fp8_fp8_bf16_nt_contiguous=fn)
    assert dg.detect_api(both) == "v2"
    assert dg.detect_api(SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=1)) is None  # not callable
    assert dg.detect_api(SimpleNamespace()) is None


@pytest.mark.parametrize(
    "api,gemm", [("1.0", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"), ("v2", "m_grouped_fp8_gemm_nt_contiguous")]
)
def test_dispatch_to_the_api_found(api, gemm, fresh_cache):
    calls = []
    module = SimpleNamespace(**{gemm: lambda *args: calls.append(args)})
    a, a_s, out, mi = (torch.zeros(1) + i for i in range(4))
    b, b_s = torch.zeros(2, 4, 8), torch.zeros(2, 1, 1)
    with dg.use(module):
        assert dg.status().usable and dg.status().api == api
        assert dg.grouped_gemm_contiguous(a, a_s, b, b_s, out, mi) is out
    ((lhs, rhs, got_out, got_mi),) = calls
    assert lhs[0] is a and lhs[1] is a_s and rhs[0] is b and rhs[1] is b_s
    assert got_out is out and got_mi is mi


@pytest.mark.skipif(not moekit_device_is_cpu(), reason="checks the CPU machine's reason")
def test_unusable_raises_with_the_reason(fresh_cache):
    x = torch.zeros(2, 4, 8)
    with pytest.raises(BackendUnavailableError, match="moekit runs on the CPU|not installed"):
        dg.grouped_gemm_contiguous(x, x, x, x, x, x)
    with pytest.raises(BackendUnavailableError, match="none of the known"):
        with dg.use(SimpleNamespace()):
            pass


def test_import_moekit_does_not_import_deep_gemm():
    import subprocess

    code = "import sys, moekit, moekit.backends.deep_gemm; print('deep_gemm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class RefusingDeepGemm:
    """A deep_gemm 1.0 stand-in: computes with moekit's contiguous GEMM, except that it "cannot
    build" GEMMs whose K is 128 (as 1.0's "Misaligned barriers" assertion), failing like nvcc."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(self, lhs, rhs, out, m_indices):
        from moekit.kernels.contiguous_gemm import contiguous_gemm

        (a, a_s), (b, b_s) = lhs, rhs
        self.calls.append((b.shape[1], b.shape[2]))
        if b.shape[2] == 128:
            error = 'static assertion failed with "Misaligned barriers"'
            raise subprocess.CalledProcessError(1, ["nvcc"], stderr=error)
        contiguous_gemm(a, a_s, b, b_s, m_indices, out=out)


# The stand-in computes every row of the contiguous layout, padding included, as deep_gemm 1.0 does: those rows
# hold stale bytes, so the interpreter's numpy may warn of overflows there (the data rows are compared).
STALE_PADDING = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


def _fp8_problem(K, N=512):
    from moekit.testing import make_problem

    return make_problem(20, E=3, topk=2, K=K, N=N, quant=QuantScheme.FP8_BLOCK, seed=4)


@STALE_PADDING
def test_a_shape_deep_gemm_cannot_build_falls_back_once_and_says_why(fresh_cache):
    stub = RefusingDeepGemm()
    with dg.use(stub):
        kernel = ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts())
        p = _fp8_problem(K=128)  # GEMM1 reduces over K=128: refused; GEMM2 over N/2=256: built
        for _ in range(3):
            assert_close(kernel(*p.inputs(), **p.options()), p.reference(), dtype=p.dtype)
        # The first call tries both GEMMs; GEMM1's shape failed to build, so it runs on moekit's Triton
        # GEMM from then on and deep_gemm is never asked for it again. GEMM2 stays on deep_gemm.
        assert stub.calls == [(512, 128)] + [(128, 256)] * 3
        (record,) = kernel.last_trace.chunks
        assert record.backend == "deep_gemm[triton GEMM1]" and "GEMM1 on Triton" in record.note
        assert "N=512, K=128" in record.note and "GEMM2" not in record.note
        assert dg.build_failure(512, 128) and dg.build_failure(128, 256) is None
        q = _fp8_problem(K=256)  # both GEMMs build: the real backend runs
        kernel(*q.inputs(), **q.options())
        assert kernel.last_trace.backends == ["deep_gemm"] and kernel.last_trace.chunks[0].note == ""


@STALE_PADDING
def test_when_only_gemm2_cannot_be_built_gemm1_stays_on_deep_gemm(fresh_cache):
    # Issue 25, item 16: a GEMM2 build failure sent both GEMMs of the layer to Triton for good.
    stub = RefusingDeepGemm()
    with dg.use(stub):
        kernel = ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts())
        p = _fp8_problem(K=256, N=256)  # GEMM1 reduces over K=256: built; GEMM2 over N/2=128: refused
        for _ in range(3):
            assert_close(kernel(*p.inputs(), **p.options()), p.reference(), dtype=p.dtype)
        assert stub.calls == [(256, 256), (256, 128), (256, 256), (256, 256)]
        (record,) = kernel.last_trace.chunks
        assert record.backend == "deep_gemm[triton GEMM2]"
        assert record.note.startswith("GEMM2 on Triton: deep_gemm cannot build its GEMM for N=256, K=128")
        assert dg.build_failure(256, 128) and dg.build_failure(256, 256) is None


def test_the_backend_state_is_one_thread_safe_object(fresh_cache):
    # Issue 25, item 16: no module globals swapped by use(); overlapping blocks end in any order.
    import threading

    assert dg.status.__self__ is dg.BACKEND and dg.use.__self__ is dg.BACKEND
    assert not any(hasattr(dg, name) for name in ("_CACHE", "_BUILD_FAILURES"))
    probed = dg.status()
    first, second = RefusingDeepGemm(), RefusingDeepGemm()
    entered, leave_first = threading.Event(), threading.Event()

    def hold_first():
        with dg.use(first, reason="first"):
            entered.set()
            leave_first.wait(10)

    holder = threading.Thread(target=hold_first)
    holder.start()
    entered.wait(10)
    with dg.use(second, reason="second"):
        assert dg.status().reason == "second"
        leave_first.set()
        holder.join(10)  # the first block ends inside the second one
        assert dg.status().reason == "second" and dg.BACKEND.module()[0] is second
    assert dg.status() == probed  # both gone: the probed state is back
    with pytest.raises(InvalidInputError, match="refresh must be True or False"):
        dg.status(refresh="yes")


def test_forcing_deep_gemm_on_a_shape_it_cannot_build_is_named(fresh_cache):
    stub = RefusingDeepGemm()
    with dg.use(stub):
        forced = ModularKernel(NoEPPrepareFinalize(), DeepGemmExperts(backend="deep_gemm"))
        p = _fp8_problem(K=128)
        with pytest.raises(BackendUnavailableError, match="cannot build its GEMM for N=512, K=128"):
            forced(*p.inputs(), **p.options())
        with pytest.raises(BackendUnavailableError, match="cannot build"):  # at the door now, no compile
            forced(*p.inputs(), **p.options())
        assert stub.calls == [(512, 128)]
    assert dg.build_failure(512, 128) is None  # use() restores the probed state


def test_deep_gemm_1_0_under_cuda_13_says_what_to_do(monkeypatch, tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    for tool in ("nvcc", "cuobjdump"):
        (nvcc.parent / tool).write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("DG_NVCC_COMPILER", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert "set DG_NVCC_COMPILER to an nvcc wrapper" in dg.jit_problem("1.0")
    assert dg.jit_problem("v2") is None  # later versions compile under CUDA 13
    monkeypatch.setenv("DG_NVCC_COMPILER", str(nvcc))  # the wrapper is in place
    assert dg.jit_problem("1.0") is None
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("DG_NVCC_COMPILER")
    assert dg.jit_problem("1.0") is None
