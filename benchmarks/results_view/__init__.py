"""What the benchmarks recorded, read back and drawn: result records, anchors, clock logs.

The workshop's side of the notebooks that show GPU numbers (04, 05, 06, 09): moekit itself never
reads ``benchmarks/results``. Every reader takes the path it reads, so a notebook passes its
``results_dir`` parameter (the checkout's ``benchmarks/results`` by default).

- :mod:`.records`: result records and anchors loaded, summarized, tabulated;
- :mod:`.plots`: one plot per kind of record (layer, chunking, count, ep), and a grid;
- :mod:`.clocks`: the SM clock and board power that nvidia-smi logged beside a benchmark;
- :mod:`.peer_run`: a same-process run beside OpenAI's triton_kernels (``tk_anchor.py``), as rows.
"""

from benchmarks.results_view.clocks import ClockLog, LoadedSummary, load_clock_log, loaded_summary, plot_clock_log
from benchmarks.results_view.peer_run import peer_rows
from benchmarks.results_view.plots import plot_bench, plot_bench_grid, plot_count_timings
from benchmarks.results_view.records import (
    bench_results,
    count_timing_rows,
    kind,
    latest_result,
    load_anchors,
    summary_rows,
)

__all__ = [
    "ClockLog",
    "LoadedSummary",
    "bench_results",
    "count_timing_rows",
    "kind",
    "latest_result",
    "load_anchors",
    "load_clock_log",
    "loaded_summary",
    "peer_rows",
    "plot_bench",
    "plot_bench_grid",
    "plot_clock_log",
    "plot_count_timings",
    "summary_rows",
]
