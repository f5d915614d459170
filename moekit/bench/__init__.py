"""GPU benchmarks: ``python -m moekit.bench {count,layer,chunking} [...]``.

Each subcommand checks correctness against :mod:`moekit.reference` before timing, reports
``triton.testing.do_bench`` medians beside the floor (bytes / 4.3 TB/s, flops / 790 TF/s) and
the anchors measured on an H200, prints a table and writes JSON under ``benchmarks/results/``.
"""
