"""Adapters that run other libraries' MoE layers through moekit.

- :mod:`moekit.integrations.transformers`: registers ``"moekit"`` as a Hugging Face
  transformers experts implementation (``experts_implementation="moekit"``).

Nothing here imports an optional dependency at import time: ``import moekit.integrations``
works without transformers, and the functions that need it raise
:class:`moekit.errors.OptionalDependencyError` naming the extra to install.
"""

from moekit import lazy_attributes

# `moekit.integrations.transformers` without an explicit import of the submodule.
__getattr__ = lazy_attributes(__name__, {}, ("transformers",))


__all__ = ["transformers"]
