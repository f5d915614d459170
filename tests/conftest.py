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


@pytest.fixture
def device():
    return moekit.device.get_device()
