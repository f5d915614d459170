"""moekit.backends.deep_gemm: detection never raises, and calls go to the API that exists."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from moekit.backends import deep_gemm as dg
from moekit.errors import BackendUnavailableError


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(dg, "_CACHE", None)
    yield
    dg._CACHE = None  # the next status() probes the real machine again


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
    "api,gemm,align",
    [
        ("1.0", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", "get_m_alignment_for_contiguous_layout"),
        ("v2", "m_grouped_fp8_gemm_nt_contiguous", "get_mk_alignment_for_contiguous_layout"),
    ],
)
def test_dispatch_to_the_api_found(api, gemm, align, fresh_cache, monkeypatch):
    calls = []
    module = SimpleNamespace(**{gemm: lambda *args: calls.append(args), align: lambda: 128})
    monkeypatch.setattr(dg, "_CACHE", (dg.DeepGemmStatus(True, "fake", api), module))
    a, a_s, b, b_s, out, mi = (torch.zeros(1) + i for i in range(6))
    assert dg.grouped_gemm_contiguous(a, a_s, b, b_s, out, mi) is out
    ((lhs, rhs, got_out, got_mi),) = calls
    assert lhs[0] is a and lhs[1] is a_s and rhs[0] is b and rhs[1] is b_s
    assert got_out is out and got_mi is mi
    assert dg.m_alignment() == 128


def test_unusable_raises_with_the_reason(fresh_cache, monkeypatch):
    monkeypatch.setattr(dg, "_CACHE", (dg.DeepGemmStatus(False, "no Hopper here"), None))
    x = torch.zeros(1)
    with pytest.raises(BackendUnavailableError, match="no Hopper here"):
        dg.grouped_gemm_contiguous(x, x, x, x, x, x)
    with pytest.raises(BackendUnavailableError, match="no Hopper here"):
        dg.m_alignment()


def test_import_moekit_does_not_import_deep_gemm():
    import subprocess

    code = "import sys, moekit, moekit.backends.deep_gemm; print('deep_gemm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
