"""The GPU's SM clock and board power during a benchmark, from an ``nvidia-smi`` log.

Logged by ``benchmarks/gpu_bench_all.sh`` (``clocks.csv``) or by hand::

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 250 > clocks.csv

Under sustained tensor-core work a board can sit at its power limit and run below its top clock;
a flop floor computed at the top clock is then out of reach. :func:`loaded_summary` gives the
clock the loaded samples ran at, and :func:`plot_clock_log` draws clock and power over time.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from moekit.errors import InvalidInputError
from moekit.viz import axes_or_new

_TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's timestamp column


@dataclass(frozen=True)
class ClockLog:
    """Samples in time order: seconds since the first, SM clock (MHz), board power (W)."""

    seconds: tuple[float, ...]
    clock_mhz: tuple[float, ...]
    power_w: tuple[float, ...]


@dataclass(frozen=True)
class LoadedSummary:
    """The samples drawing more than ``min_watts``: how many, their mean and lowest clock, their
    mean power, and the log's top clock (idle or light load)."""

    min_watts: float
    samples: int
    mean_mhz: float
    min_mhz: float
    mean_w: float
    top_mhz: float


def _number(cell: str, unit: str, path, line: int) -> float:
    text = cell.strip()
    if not text.endswith(unit):
        raise InvalidInputError(f"{path}, line {line}: expected a value in {unit}, got {cell.strip()!r}")
    try:
        return float(text[: -len(unit)])
    except ValueError:
        raise InvalidInputError(f"{path}, line {line}: expected a number before {unit!r}, got {text!r}") from None


def load_clock_log(path: str | Path) -> ClockLog:
    """Parse ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw[,...] --format=csv``.

    Raises:
        InvalidInputError: the header does not start with timestamp, SM clock and power, a row
            holds something else than ``<n> MHz`` / ``<n> W``, or there are no samples.
    """
    path = Path(path)
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    header = [h.strip() for h in rows[0]] if rows else []
    if len(header) < 3 or header[0] != "timestamp" or "MHz" not in header[1] or "[W]" not in header[2]:
        raise InvalidInputError(
            f"{path}: expected nvidia-smi CSV columns timestamp, clocks.sm, power.draw; got {header}"
        )
    times, clocks, powers = [], [], []
    for line, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) < 3:
            raise InvalidInputError(f"{path}, line {line}: expected timestamp, clock and power, got {row}")
        try:
            stamp = datetime.strptime(row[0].strip(), _TIME_FORMAT)
        except ValueError:
            raise InvalidInputError(
                f"{path}, line {line}: expected a timestamp like 2026/12/01 13:48:30.807, got {row[0]!r}"
            ) from None
        times.append(stamp.timestamp())
        clocks.append(_number(row[1], "MHz", path, line))
        powers.append(_number(row[2], "W", path, line))
    if not times:
        raise InvalidInputError(f"{path}: no samples after the header")
    return ClockLog(tuple(t - times[0] for t in times), tuple(clocks), tuple(powers))


def loaded_summary(log: ClockLog, *, min_watts: float = 400.0) -> LoadedSummary:
    """Clock and power over the samples above ``min_watts`` (zeros when none is)."""
    loaded = [(c, p) for c, p in zip(log.clock_mhz, log.power_w, strict=True) if p > min_watts]
    n = len(loaded)
    return LoadedSummary(
        min_watts=min_watts, samples=n,
        mean_mhz=sum(c for c, _ in loaded) / n if n else 0.0, min_mhz=min((c for c, _ in loaded), default=0.0),
        mean_w=sum(p for _, p in loaded) / n if n else 0.0, top_mhz=max(log.clock_mhz),
    )  # fmt: skip


def plot_clock_log(log: ClockLog, *, min_watts: float = 400.0, ax=None):
    """SM clock (left axis) and board power (right axis) against time; the loaded samples'
    mean clock as a dashed line."""
    fig, ax = axes_or_new(ax, width=8.0, height=3.4)
    s = loaded_summary(log, min_watts=min_watts)
    ax.plot(log.seconds, log.clock_mhz, color="tab:blue", lw=1.0, label="SM clock")
    if s.samples:
        ax.axhline(s.mean_mhz, color="tab:blue", ls="--", lw=0.8,
                   label=f"mean under load ({s.samples} samples > {min_watts:.0f} W): {s.mean_mhz:.0f} MHz")
    ax.set_xlabel("seconds")
    ax.set_ylabel("SM clock (MHz)", color="tab:blue")
    power = ax.twinx()
    power.plot(log.seconds, log.power_w, color="tab:red", lw=0.8, alpha=0.7, label="board power")
    power.set_ylabel("board power (W)", color="tab:red")
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title("clock and power while the benchmark ran")
    return fig
