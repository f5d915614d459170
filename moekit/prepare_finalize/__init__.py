"""Prepare/finalize stages: quantize and dispatch before the experts, combine after."""

from moekit.prepare_finalize.base import PrepareFinalize
from moekit.prepare_finalize.no_ep import NoEPPrepareFinalize

__all__ = ["NoEPPrepareFinalize", "PrepareFinalize"]
