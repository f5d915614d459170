"""Prepare/finalize stages: quantize and dispatch before the experts, combine after."""

from moekit import lazy_attributes
from moekit.prepare_finalize.base import PrepareFinalize
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize

_LAZY = {
    "BatchedPrepareFinalize": "moekit.prepare_finalize.batched",
    "All2AllPrepareFinalize": "moekit.prepare_finalize.all2all",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = ["All2AllPrepareFinalize", "BatchedPrepareFinalize", "NoEPPrepareFinalize", "PrepareFinalize"]
