"""GPU benchmarks: ``python -m benchmarks.harness {count,layer,chunking} [...]`` (from a checkout).

Each subcommand checks correctness against :mod:`moekit.reference` before timing, reports
``triton.testing.do_bench`` medians beside the floor of :mod:`moekit.roofline` at the H200's
ceilings (:mod:`benchmarks.ceilings`: bytes / 4.3 TB/s, flops / peak) and the anchors measured on
an H200 (:mod:`benchmarks.harness.anchors`), prints a table and writes JSON under
``benchmarks/results/``.
"""

import moekit  # noqa: F401  (first: it turns Triton's interpreter on before triton is imported)
