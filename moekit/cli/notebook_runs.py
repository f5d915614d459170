"""The walkthrough's runs: one notebook through papermill, its figures, and the table and page that report them.

:class:`Result` is how one notebook went; :func:`summary` is the table printed at the end and
:func:`write_index` the ``index.html`` that links every executed notebook. papermill, nbconvert
and :mod:`moekit.cli.system_info` are imported inside the functions.
"""

from __future__ import annotations

import base64
import html
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

FIGURE_TAG = "figure:"


@dataclass
class Result:
    """How one notebook went."""

    name: str
    seconds: float = 0.0
    status: str = "ok"
    error: str = ""
    parameters: dict = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)


def extract_figures(executed: Path, figures_dir: Path) -> list[str]:
    """Save the PNG of every cell tagged ``figure:<name>`` as ``figures_dir/<name>.png``."""
    nb = json.loads(executed.read_text())
    saved = []
    for cell in nb["cells"]:
        names = [t[len(FIGURE_TAG) :] for t in cell.get("metadata", {}).get("tags", []) if t.startswith(FIGURE_TAG)]
        pngs = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        for name, png in zip(names, pngs, strict=False):
            figures_dir.mkdir(parents=True, exist_ok=True)
            (figures_dir / f"{name}.png").write_bytes(base64.b64decode(png))
            saved.append(f"{name}.png")
    return saved


def run_one(notebook: Path, out_dir: Path, parameters: dict, *, kernel: str, timeout: int, html_report: bool):
    """Execute one notebook with papermill (cwd = its folder); export HTML; return a Result."""
    import papermill as pm

    result, executed = Result(notebook.stem, parameters=parameters), out_dir / notebook.name
    start = time.perf_counter()
    try:
        pm.execute_notebook(
            str(notebook),
            str(executed),
            parameters=parameters,
            kernel_name=kernel,
            cwd=str(notebook.parent),
            progress_bar=False,
            execution_timeout=timeout,
        )
    except Exception as e:  # papermill's PapermillExecutionError, a dead kernel, a timeout
        result.status = "FAILED"
        result.error = f"{type(e).__name__}: {getattr(e, 'ename', '')} {getattr(e, 'evalue', e)}".strip()
    result.seconds = time.perf_counter() - start
    if executed.exists():
        result.figures = extract_figures(executed, out_dir / "figures")
        if html_report:
            from nbconvert import HTMLExporter

            body, _ = HTMLExporter().from_filename(str(executed))
            executed.with_suffix(".html").write_text(body, encoding="utf-8")
    return result


def summary(results: list[Result], *, wall_seconds: float | None = None) -> str:
    """The table printed at the end: notebook, seconds, status; the total is the notebooks' own
    seconds added up, and ``wall_seconds`` (when given) the time the run took with them in parallel."""
    width = max([len("notebook")] + [len(r.name) for r in results])
    lines = [f"{'notebook':<{width}}  {'seconds':>7}  status", "-" * (width + 18)]
    lines += [f"{r.name:<{width}}  {r.seconds:7.1f}  {r.status}" for r in results]
    lines.append(
        f"{'total':<{width}}  {sum(r.seconds for r in results):7.1f}  "
        f"{sum(r.status == 'ok' for r in results)}/{len(results)} ok"
    )
    if wall_seconds is not None:
        lines.append(f"{'wall clock':<{width}}  {wall_seconds:7.1f}")
    return "\n".join(lines)


def write_index(results: list[Result], out_dir: Path, *, title: str = "moekit walkthrough") -> Path:
    """``index.html``: what it ran on, one row per notebook with links, then every saved figure."""
    from moekit.cli.system_info import collect_info

    esc = html.escape
    ran_on = "<pre>" + esc("\n".join(collect_info().lines())) + "</pre>"
    rows = "".join(
        f"<tr><td><a href='{esc(r.name)}.html'>{esc(r.name)}</a> (<a href='{esc(r.name)}.ipynb'>ipynb</a>)</td>"
        f"<td>{r.seconds:.1f}</td><td class='{_status_class(r.status)}'>{esc(r.status)}</td>"
        f"<td><code>{esc(json.dumps(r.parameters))}</code></td><td>{esc(r.error)}</td></tr>"
        for r in results
    )
    figs = "".join(
        f"<figure><img src='figures/{esc(f)}' width='640'><figcaption>{esc(f)}</figcaption></figure>"
        for r in results
        for f in r.figures
    )
    head = "<tr><th>notebook</th><th>seconds</th><th>status</th><th>parameters</th><th>error</th></tr>"
    return _write_page(out_dir, title, f"{ran_on}<table>{head}{rows}</table><h2>Figures</h2>{figs}")


def _status_class(status: str) -> str:
    return "ok" if status == "ok" else "bad"


def _write_page(folder: Path, title: str, body: str) -> Path:
    """``folder/index.html``: a page of ``title`` (its heading too) around ``body``; returns its path."""
    head = f"<meta charset='utf-8'><title>{html.escape(title)}</title>{_STYLE}"
    page = f"<!doctype html><html><head>{head}</head><body><h1>{html.escape(title)}</h1>{body}</body></html>"
    index = folder / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


_STYLE = (
    "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 10px;border-bottom:1px solid #ddd}"
    ".ok{color:green}.bad{color:#b00;font-weight:bold}</style>"
)
RUN_MARKER = ".moekit-walkthrough-run.json"  # in every run folder: what the run wrote, and how it went


def run_name(notebooks: list[str], parameters: dict[str, dict], *, every: bool) -> str:
    """The folder of a run: ``all`` for every notebook with their defaults, else the notebooks and
    the overrides it ran (``02_workspace_shape_crash+M=300``), so that another run never replaces it."""
    if every and not any(parameters.values()):
        return "all"
    parts = []
    for name in notebooks:
        given = parameters.get(name) or {}
        parts.append(name.split("_")[0] + "".join(f"+{k}={v}" for k, v in sorted(given.items())))
    slug = "_".join(parts)
    return "".join(ch if ch.isalnum() or ch in "+=_-." else "-" for ch in slug)[:120]


def claim_run_folder(run_dir: Path) -> None:
    """Make ``run_dir`` ready for a run: new, or one this walkthrough wrote before, from which only the
    files it wrote then are removed. Raises FileExistsError for a folder the walkthrough did not make
    (a user's files are never deleted or overwritten)."""
    marker = run_dir / RUN_MARKER
    if run_dir.exists() and not marker.is_file():
        raise FileExistsError(f"{run_dir} exists and was not written by `moekit walkthrough`; choose another --out")
    if marker.is_file():
        for name in json.loads(marker.read_text()).get("files", []):
            path = run_dir / name
            if path.is_file() and path.resolve().is_relative_to(run_dir.resolve()):
                path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"files": []}))


def record_run(run_dir: Path, results: list[Result]) -> None:
    """Write the run's marker: the files it wrote (the next run of the same name removes only those)
    and a line per notebook for the index of runs."""
    files = [
        p.relative_to(run_dir).as_posix() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != RUN_MARKER
    ]
    notebooks = [asdict(r) for r in results]
    (run_dir / RUN_MARKER).write_text(json.dumps({"files": files, "notebooks": notebooks, "time": time.time()}))


def write_runs_index(out_dir: Path) -> Path:
    """``out_dir/index.html``: every run kept under ``out_dir/runs/``, newest first, with its notebooks."""
    esc, rows = html.escape, []
    runs = []
    for marker in (out_dir / "runs").glob(f"*/{RUN_MARKER}"):
        try:
            runs.append((json.loads(marker.read_text()), marker.parent.name))
        except (OSError, ValueError):
            continue
    for info, name in sorted(runs, key=lambda r: -r[0].get("time", 0)):
        cells = ", ".join(
            f"<span class='{_status_class(n['status'])}'>{esc(n['name'])}</span>" for n in info.get("notebooks", [])
        )
        rows.append(f"<tr><td><a href='runs/{esc(name)}/index.html'>{esc(name)}</a></td><td>{cells}</td></tr>")
    table = f"<table><tr><th>run</th><th>notebooks</th></tr>{''.join(rows)}</table>"
    return _write_page(out_dir, "moekit walkthrough runs", table)
