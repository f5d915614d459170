"""Shared pytest setup: the `gpu` marker skips without CUDA, the `interpreter` marker skips where
kernels compile for CUDA (``make test`` runs those tests again with ``MOEKIT_DEVICE=cpu``); seeds
are fixed per test."""

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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _verify_lean_launches():
    """Where kernels compile (a GPU), every direct launch of a kept variant is cross-checked against
    Triton's own binder: a launch key that misses a specialization fails the test that made it."""
    from moekit.kernels.launch import lean_supported, verifying

    if not lean_supported():
        yield
        return
    with verifying():
        yield


@pytest.fixture
def device():
    return moekit.device.get_device()
