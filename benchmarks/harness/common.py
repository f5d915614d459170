"""Helpers every benchmark shares: where it ran, how it is timed, floors, tables and JSON.

- :data:`DTYPES` / :func:`quant_of`: the harness's weight dtypes ("bf16", "fp8") and the
  :class:`moekit.QuantScheme` each one means;
- :func:`environment`: GPU name, date and library versions, recorded beside every result;
- :func:`bench_median_us`: ``triton.testing.do_bench`` median in microseconds, optionally with
  the call captured in a CUDA graph (launch overhead removed);
- :func:`cpu_median_us`: a wall-clock median for the interpreter (a sanity check, not a timing);
- :func:`floor_us`: the time a call cannot beat, ``max(bytes / 4.3 TB/s, flops / 790 TF/s)``;
- :func:`format_table`: aligned text columns;
- :func:`clock_log`: ``nvidia-smi`` logging the SM clock and power beside a run (a context);
- :func:`write_json` / :func:`save_rows` / :func:`load_results`:
  ``benchmarks/results/<name>-<gpu>-<date>.json``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import platform
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.ceilings import H200
from moekit.errors import InvalidInputError
from moekit.types import QuantScheme

BF16_FLOPS = H200.flops[QuantScheme.NONE]  # flop/s: bf16 GEMM measured on the H200
# The weight dtypes of the CLI and the JSON, and the QuantScheme each means for moekit.
DTYPES = ("bf16", "fp8")
_QUANT = {"bf16": QuantScheme.NONE, "fp8": QuantScheme.FP8_BLOCK}


def quant_of(dtype: str) -> QuantScheme:
    """``"bf16"`` -> ``QuantScheme.NONE``, ``"fp8"`` -> ``QuantScheme.FP8_BLOCK`` (128x128 blocks)."""
    if dtype not in _QUANT:
        raise InvalidInputError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return _QUANT[dtype]


def default_results_dir() -> Path:
    """``benchmarks/results`` of this checkout (the harness lives in ``benchmarks/harness``)."""
    return Path(__file__).resolve().parents[1] / "results"


@dataclass(frozen=True)
class Environment:
    """Where and with what a benchmark ran (saved in every JSON file)."""

    gpu: str
    sms: int
    date: str
    torch: str
    triton: str
    numpy: str
    moekit: str
    cuda: str | None
    python: str
    interpreter: bool

    @property
    def gpu_slug(self) -> str:
        """File-name form of the GPU name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
        return re.sub(r"[^a-z0-9]+", "-", self.gpu.lower()).strip("-") or "unknown"


def environment() -> Environment:
    """Record the device, today's date (UTC) and the versions of torch, triton, numpy, moekit."""
    import numpy
    import triton

    import moekit

    on_gpu = moekit.device.get_device().type == "cuda"
    props = torch.cuda.get_device_properties(torch.cuda.current_device()) if on_gpu else None
    return Environment(
        gpu=props.name if props else "cpu-interpreter",
        sms=props.multi_processor_count if props else 0,
        date=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d"),
        torch=torch.__version__,
        triton=triton.__version__,
        numpy=numpy.__version__,
        moekit=moekit.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        interpreter=moekit.device.interpreting(),
    )


def gpu_or_reason() -> str | None:
    """None when benchmarks can run (a CUDA device, kernels compiled), else why not."""
    import moekit

    if moekit.device.get_device().type == "cuda":
        return None
    if torch.cuda.is_available():
        return "a GPU is present but MOEKIT_DEVICE=cpu / TRITON_INTERPRET=1 forces the interpreter"
    return "no CUDA GPU here: kernels run in Triton's interpreter, whose timings mean nothing"


def bench_median_us(
    fn: Callable[[], object], *, cuda_graph: bool = False, warmup: int = 25, rep: int = 100
) -> float:
    """Median time of ``fn()`` in microseconds, measured with ``triton.testing.do_bench``.

    With ``cuda_graph=True`` the call is captured once in a CUDA graph and the graph replayed
    (``do_bench_cudagraph``): what remains is device time, without Python or launch overhead.
    ``fn`` must then not sync with the host (no ``.item()``, no ``torch.bincount``).
    """
    import triton.testing

    if cuda_graph:
        ms = triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    else:
        ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return float(ms) * 1e3


def cpu_median_us(fn: Callable[[], object], *, reps: int = 5) -> float:
    """Wall-clock median of ``fn()`` in microseconds (for interpreter sanity runs only)."""
    fn()  # the first call compiles / traces
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def floor_us(*, bytes_moved: float = 0.0, flops: float = 0.0, flops_per_s: float = BF16_FLOPS) -> float:
    """``max(bytes / 4.3 TB/s, flops / peak)`` in microseconds: what no kernel can beat."""
    return max(bytes_moved / H200.bandwidth, flops / flops_per_s) * 1e6


def _cell(value, fmt: str | None) -> str:
    if value is None:
        return "-"
    if fmt:
        try:
            return format(value, fmt)
        except (TypeError, ValueError):  # a note or status string in a numeric column
            return str(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


@contextlib.contextmanager
def clock_log(path: str | Path | None, *, period_ms: int = 500) -> Iterator[Path | None]:
    """Log ``timestamp, clocks.sm, power.draw`` every ``period_ms`` to ``path`` while the block runs
    (read back by :func:`benchmarks.results_view.clocks.load_clock_log`). The H200 runs big GEMMs at its
    700 W cap, where the SM clock moves between 1.1 and 2.0 GHz: same-run ratios need it beside them.
    Yields the path, or None when there is no path or no ``nvidia-smi``."""
    if path is None or shutil.which("nvidia-smi") is None:
        yield None
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as sink:
        proc = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv",
                                 "-lms", str(period_ms)], stdout=sink, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            yield path
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def format_table(rows: Sequence[dict], columns: Sequence[str | tuple[str, str, str | None]]) -> str:
    """Rows of dicts as aligned text. A column is a key, or ``(key, header, format_spec)``."""
    cols = [(c, c, None) if isinstance(c, str) else c for c in columns]
    cells = [[header for _, header, _ in cols]]
    cells += [[_cell(row.get(key), fmt) for key, _, fmt in cols] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    lines = ["  ".join(text.rjust(w) for text, w in zip(line, widths, strict=True)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def results_path(name: str, env: Environment, directory: str | Path | None = None) -> Path:
    """``<directory>/<name>-<gpu>-<date>.json`` (default: :func:`default_results_dir`)."""
    return Path(directory or default_results_dir()) / f"{name}-{env.gpu_slug}-{env.date}.json"


def write_json(name: str, env: Environment, payload: dict, *, directory: str | Path | None = None) -> Path:
    """Write ``{"name", "environment", **payload}`` and return the path."""
    path = results_path(name, env, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "environment": asdict(env), **payload}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")  # str(): paths, dtypes
    return path


def save_rows(rows: list[dict], args, env: Environment, *, name: str, extra: dict | None = None) -> Path:
    """Write ``{"name", "environment", "args", "rows", **extra}`` to ``args.json`` when it is set,
    else under ``args.out`` (:func:`write_json`); returns the path."""
    payload = {"args": dict(vars(args)), "rows": rows, **(extra or {})}
    if not args.json:
        return write_json(name, env, payload, directory=args.out)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "environment": asdict(env), **payload}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def load_results(name: str, directory: str | Path | None = None) -> dict | None:
    """The newest ``<name>-*.json`` under ``directory`` (by the date in its name), or None."""
    folder = Path(directory or default_results_dir())
    files = sorted(folder.glob(f"{name}-*.json"), key=lambda p: (p.stem[-10:], p.name))
    return json.loads(files[-1].read_text()) if files else None
