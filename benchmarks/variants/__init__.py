"""Variants of the histogram count kernel that moekit's ``count_expert_num_tokens`` grew out of.

Benchmarks only (``benchmarks/gpu_count_variants.py``, ``python -m benchmarks.harness count
--variants``): :func:`~benchmarks.variants.count_histogram.count_variant` runs one of
:data:`~benchmarks.variants.count_histogram.VARIANTS` with a
:class:`~benchmarks.variants.count_histogram.HistogramTuning` launch shape. The library keeps
one stateless algorithm; these keep the alternatives it was chosen from.
"""

import moekit  # noqa: F401  (first: it turns Triton's interpreter on before triton is imported)
