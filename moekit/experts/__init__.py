"""Experts implementations, one per file (see ``base.py`` for the contract)."""

from moekit.experts.base import Experts

__all__ = ["Experts"]
