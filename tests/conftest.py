"""Shared pytest setup: the `gpu` marker skips without CUDA, the `interpreter` marker skips where
kernels compile for CUDA (``make test`` runs those tests again with ``MOEKIT_DEVICE=cpu``); seeds
are fixed per test. When the `browser` tests (a real JupyterLab in chromium) skip, the end of the
run says so in a banner, with how to get them."""

from __future__ import annotations

import pytest
import torch

import moekit


def pytest_collection_modifyitems(config, items):
    if moekit.device.get_device().type == "cuda":
        # These tests build their tensors on the CPU, where only Triton's interpreter can run the
        # kernels (and some promise bit-identity, which holds there only).
        marker, why = "interpreter", "runs its kernels on CPU tensors: rerun with MOEKIT_DEVICE=cpu (make test does)"
    else:
        marker, why = "gpu", "needs a CUDA GPU (moekit.device found none)"
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


_BROWSER_SKIPS: list[str] = []
BROWSER_HOWTO = (
    "apt-get install -y chromium (about 30 s; or set MOEKIT_CHROMIUM to a chromium binary). jupyterlab and "
    "playwright come with `make venv` (the notebooks and dev extras); never run `playwright install`: the tests "
    "drive the system chromium"
)


def pytest_runtest_logreport(report):
    if report.skipped and "browser" in report.keywords:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _BROWSER_SKIPS.append(reason.removeprefix("Skipped: "))


def pytest_terminal_summary(terminalreporter):
    """A banner when the browser tests did not run: `make test` promises them."""
    if not _BROWSER_SKIPS:
        return
    tr = terminalreporter
    tr.write_sep("!", "BROWSER TESTS SKIPPED", yellow=True, bold=True)
    tr.write_line(f"{len(_BROWSER_SKIPS)} JupyterLab browser test(s) did not run: {sorted(set(_BROWSER_SKIPS))[0]}")
    tr.write_line(f"To run them: {BROWSER_HOWTO}. Then `make test` again (.ci/run installs chromium itself).")
    tr.write_sep("!", yellow=True, bold=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _verify_lean_launches():
    """Where kernels compile (a GPU), every direct launch of a kept variant is cross-checked against
    Triton's own binder: a launch key that misses a specialization fails the test that made it."""
    from moekit.hopper.launch import lean_supported, verifying

    if not lean_supported():
        yield
        return
    with verifying():
        yield


@pytest.fixture
def device():
    return moekit.device.get_device()
