"""benchmarks/results_view/clocks.py: an nvidia-smi log parsed, its loaded-sample summary, its plot, bad files."""

import random

import pytest

from benchmarks.results_view.clocks import load_clock_log, loaded_summary, plot_clock_log
from moekit.errors import InvalidInputError

HEADER = "timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu\n"


def _write(tmp_path, rows):
    path = tmp_path / "clocks.csv"
    lines = [f"2026/12/01 13:48:{30 + i // 4:02d}.{(i % 4) * 250:03d}, {c} MHz, {p:.2f} W, 40\n"
             for i, (c, p) in enumerate(rows)]
    path.write_text(HEADER + "".join(lines))
    return path


def test_parse_and_summary_match_the_rows(tmp_path):
    rng = random.Random(7)
    rows = [(rng.choice([345, 1980]), rng.uniform(70, 120)) for _ in range(6)]
    rows += [(rng.randrange(1050, 1980, 15), rng.uniform(600, 700)) for _ in range(9)]
    log = load_clock_log(_write(tmp_path, rows))
    assert log.clock_mhz == tuple(float(c) for c, _ in rows)
    assert log.power_w == pytest.approx([p for _, p in rows], abs=0.006)
    assert log.seconds[0] == 0.0 and log.seconds[4] == pytest.approx(1.0)
    s = loaded_summary(log, min_watts=400)
    loaded = [(c, p) for c, p in zip(log.clock_mhz, log.power_w, strict=True) if p > 400]
    assert s.samples == 9
    assert s.mean_mhz == pytest.approx(sum(c for c, _ in loaded) / 9)
    assert s.min_mhz == min(c for c, _ in loaded) and s.top_mhz == max(c for c, _ in rows)
    assert s.mean_w == pytest.approx(sum(p for _, p in loaded) / 9)
    assert loaded_summary(log, min_watts=10_000).samples == 0


def test_plot_returns_a_figure(tmp_path):
    pytest.importorskip("matplotlib")

    fig = plot_clock_log(load_clock_log(_write(tmp_path, [(1980, 90.0), (1500, 690.0), (1530, 688.0)])))
    assert len(fig.axes) == 2  # clock and, on a twin axis, power


@pytest.mark.parametrize("text, what", [
    ("time, clock\n", "columns"),
    (HEADER, "no samples"),
    (HEADER + "2026/12/01 13:48:30.807, fast, 81.69 W, 38\n", "MHz"),
    (HEADER + "yesterday, 345 MHz, 81.69 W, 38\n", "timestamp"),
])
def test_bad_files_are_named(tmp_path, text, what):
    path = tmp_path / "clocks.csv"
    path.write_text(text)
    with pytest.raises(InvalidInputError, match=what):
        load_clock_log(path)
