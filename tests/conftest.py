"""Shared pytest setup: the `gpu` marker skips without CUDA; seeds are fixed per test."""

from __future__ import annotations

import pytest
import torch

import moekit


def pytest_collection_modifyitems(config, items):
    if moekit.device.get_device().type == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (moekit.device found none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device():
    return moekit.device.get_device()
