"""Adapters that run other libraries' MoE layers through moekit.

- :mod:`moekit.integrations.transformers`: registers ``"moekit"`` as a Hugging Face
  transformers experts implementation (``experts_implementation="moekit"``).

Nothing here imports an optional dependency at import time: ``import moekit.integrations``
works without transformers, and the functions that need it raise
:class:`moekit.errors.OptionalDependencyError` naming the extra to install.
"""

import importlib

_SUBMODULES = ("transformers",)


def __getattr__(name):
    # `moekit.integrations.transformers` without an explicit import of the submodule.
    if name in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["transformers"]
