"""Prepare/finalize stages: quantize and dispatch before the experts, combine after."""

import importlib

from moekit.prepare_finalize.base import PrepareFinalize
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize

_LAZY = {
    "BatchedPrepareFinalize": "moekit.prepare_finalize.batched",
    "All2AllPrepareFinalize": "moekit.prepare_finalize.all2all",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'moekit.prepare_finalize' has no attribute {name!r}")


__all__ = ["All2AllPrepareFinalize", "BatchedPrepareFinalize", "NoEPPrepareFinalize", "PrepareFinalize"]
