"""Adapters to optional third-party kernels (imported lazily; ``import moekit`` never needs them)."""
