"""``moekit walkthrough``: run every notebook and write an HTML report.

::

    moekit walkthrough                      # all notebooks -> build/walkthrough/index.html
    moekit walkthrough -p M 256             # M=256 in every notebook that has a parameter M
    moekit walkthrough 02:M=256 02:C=64     # only in notebook 02
    moekit walkthrough --only 02 03         # a subset
    moekit walkthrough --only 02 02:M=300   # a subset, with a parameter
    moekit walkthrough --update-docs        # also copy the key figures to docs/figures/
    moekit walkthrough --jobs 1             # one notebook at a time (default: two, each in its own kernel)

For each notebook it writes the executed ``.ipynb`` and its HTML (nbconvert), then an
``index.html`` linking them (with what it ran on: ``moekit info``), prints a table (notebook,
seconds, status) and returns 1 if any notebook failed. Cells tagged ``figure:<name>`` have
their PNG saved as ``figures/<name>.png`` (the README's figures). papermill, nbconvert and tqdm
are imported inside the functions.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import base64
import html
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

KERNEL_NAME = "moekit-python"
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


def repo_root() -> Path:
    """The checkout that holds ``notebooks/`` (this package's parent), else the cwd."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "notebooks").is_dir() else Path.cwd()


_SPEC_ROOT: Path | None = None  # this process's private kernelspec folder, once made
_MADE: set[str] = set()  # every such folder this process put on JUPYTER_PATH


def _private(path: Path) -> bool:
    """``path`` is a real directory (not a symlink), owned by this user, that nobody else may enter."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def kernel_spec_dir() -> Path:
    """A kernelspec named ``moekit-python`` for *this* interpreter; returns the dir to put on JUPYTER_PATH.

    A user-level ``python3`` kernelspec could point at another Python; this one cannot. The folder
    is made fresh by :func:`tempfile.mkdtemp` (atomically, mode 0700, a name nobody can guess
    beforehand) once per process and removed at exit. Nothing under a shared, predictable path is
    ever used: another user could have made it first, or planted a symlink in it, and would then
    choose the command papermill runs.
    """
    global _SPEC_ROOT
    if _SPEC_ROOT is None or not _private(_SPEC_ROOT) or not _private(_SPEC_ROOT / "kernels" / KERNEL_NAME):
        root = Path(tempfile.mkdtemp(prefix="moekit-kernels-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        (root / "kernels" / KERNEL_NAME).mkdir(mode=0o700, parents=True)
        _SPEC_ROOT = root
    spec = _SPEC_ROOT / "kernels" / KERNEL_NAME
    # log_level: the kernel warns at every start that loopback TCP is unencrypted, and logs
    # "KeyboardInterrupt caught in kernel" at ERROR when nbclient interrupts it at shutdown. Its
    # real errors reach the notebook as cell outputs, so its own log stays quiet.
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--IPKernelApp.log_level=CRITICAL"]
    body = json.dumps({"argv": argv, "display_name": "Python (moekit)", "language": "python"}, indent=1)
    path = spec / "kernel.json"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)
    return _SPEC_ROOT


def use_moekit_kernel() -> str:
    """Put :func:`kernel_spec_dir` first on JUPYTER_PATH (this process); returns the kernel name."""
    path = str(kernel_spec_dir())
    _MADE.add(path)
    current = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    if path not in current:  # and drop a folder of ours that was replaced (see kernel_spec_dir)
        os.environ["JUPYTER_PATH"] = os.pathsep.join([path] + [p for p in current if p not in _MADE])
    return KERNEL_NAME


def parse_value(text: str):
    """A Python literal if ``text`` is one (``256``, ``0.5``, ``'x'``, ``None``), else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def declared_parameters(notebook: Path) -> dict[str, object]:
    """Names and default values assigned in the cell tagged ``parameters`` (parsed with ``ast``).

    papermill's own inspector skips any line holding two ``=`` (a comment like ``# 0 = uniform``).
    """
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            found = {}
            for node in ast.parse(src).body:
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            found[target.id] = ast.literal_eval(node.value)
            return found
    return {}


def parameters_for(notebook: Path, declared: dict, global_params: dict, scoped: list[tuple[str, str, object]]):
    """The overrides that apply to ``notebook``: global ones it declares, plus ``NN:name=value``."""
    params = {k: v for k, v in global_params.items() if k in declared}
    for scope, key, value in scoped:
        if notebook.stem == scope or notebook.stem.split("_")[0] == scope:
            if key not in declared:
                raise SystemExit(
                    f"moekit walkthrough: {notebook.name} has no parameter {key!r} "
                    f"(it has {', '.join(declared) or 'none'})"
                )
            params[key] = value
    return params


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


def write_index(results: list[Result], out_dir: Path) -> Path:
    """``index.html``: what it ran on, one row per notebook with links, then every saved figure."""
    from moekit.cli.system_info import collect_info

    esc = html.escape
    ran_on = "<pre>" + esc("\n".join(collect_info().lines())) + "</pre>"
    rows = "".join(
        f"<tr><td><a href='{esc(r.name)}.html'>{esc(r.name)}</a> "
        f"(<a href='{esc(r.name)}.ipynb'>ipynb</a>)</td>"
        f"<td>{r.seconds:.1f}</td><td class='{'ok' if r.status == 'ok' else 'bad'}'>{esc(r.status)}</td>"
        f"<td><code>{esc(json.dumps(r.parameters))}</code></td><td>{esc(r.error)}</td></tr>"
        for r in results
    )
    figs = "".join(
        f"<figure><img src='figures/{esc(f)}' width='640'><figcaption>{esc(f)}</figcaption></figure>"
        for r in results
        for f in r.figures
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>moekit walkthrough</title><style>"
        "body{font-family:sans-serif;margin:2em}td,th{padding:4px 10px;border-bottom:1px solid #ddd}"
        ".ok{color:green}.bad{color:#b00;font-weight:bold}</style></head><body><h1>moekit walkthrough</h1>"
        f"{ran_on}<table><tr><th>notebook</th><th>seconds</th><th>status</th><th>parameters</th><th>error</th></tr>"
        f"{rows}</table><h2>Figures</h2>{figs}</body></html>"
    )
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``moekit walkthrough`` (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="moekit walkthrough",
        description="\n\n".join(__doc__.split("\n\n")[:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", metavar="NN:NAME=VALUE", help="a parameter for one notebook (e.g. 02:M=256)")
    p.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="set NAME in every notebook that declares it (repeatable)",
    )
    p.add_argument("--only", nargs="+", default=None, metavar="NN",
                   help="run only these notebooks (prefixes); NN:NAME=VALUE items here are overrides")
    p.add_argument("--notebooks", type=Path, default=None, help="folder of notebooks (default: <repo>/notebooks)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: <repo>/build/walkthrough)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per cell before a notebook fails")
    p.add_argument("--jobs", type=_positive, default=min(2, os.cpu_count() or 1),
                   help="notebooks run at once, each in its own kernel process (default: 2, or 1 on one core)")
    p.add_argument("--no-html", action="store_true", help="skip the nbconvert HTML export")
    p.add_argument("--update-docs", action="store_true", help="copy the figures to --docs-dir")
    p.add_argument("--docs-dir", type=Path, default=None, help="default: <repo>/docs/figures")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text}")
    return value


def _scoped(items: list[str]) -> list[tuple[str, str, object]]:
    out = []
    for item in items:
        scope, sep, rest = item.partition(":")
        key, eq, value = rest.partition("=")
        if not sep or not eq or not key:
            raise SystemExit(f"moekit walkthrough: expected NN:NAME=VALUE, got {item!r}")
        out.append((scope, key, parse_value(value)))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the walkthrough; returns the exit status (0 when every notebook passed)."""
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    if args.only:  # `--only 02 02:M=300`: argparse hands the override to --only; take it back
        args.overrides += [o for o in args.only if ":" in o or "=" in o]
        args.only = [o for o in args.only if ":" not in o and "=" not in o] or None
    root = repo_root()
    nb_dir = (args.notebooks or root / "notebooks").resolve()
    out_dir = (args.out or root / "build" / "walkthrough").resolve()
    every = sorted(nb_dir.glob("[0-9][0-9]_*.ipynb"))
    if not every:
        print(f"moekit walkthrough: no notebooks found in {nb_dir}", file=sys.stderr)
        return 2
    notebooks = every
    if args.only:
        notebooks = [n for n in every if any(n.stem.startswith(o) for o in args.only)]
        unmatched = [o for o in args.only if not any(n.stem.startswith(o) for n in every)]
        if unmatched or not notebooks:
            names = ", ".join(n.stem for n in every)
            print(f"moekit walkthrough: no notebook matches {', '.join(map(repr, unmatched or args.only))}; "
                  f"the notebooks are: {names}", file=sys.stderr)
            return 2
    global_params = {k: parse_value(v) for k, v in args.parameter}
    scoped = _scoped(args.overrides)
    for scope, key, _ in scoped:
        if not any(n.stem == scope or n.stem.split("_")[0] == scope for n in notebooks):
            print(f"moekit walkthrough: {scope}:{key}=... names no notebook of this run "
                  f"({', '.join(n.stem for n in notebooks)})", file=sys.stderr)
            return 2
    plans = [(n, parameters_for(n, declared_parameters(n), global_params, scoped)) for n in notebooks]
    shutil.rmtree(out_dir / "figures", ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    kernel, start = use_moekit_kernel(), time.perf_counter()
    results: list[Result | None] = [None] * len(plans)
    # Each notebook runs in a kernel process of its own: threads here only wait on them. The
    # table and the index keep the notebooks' order, whichever finishes first.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool, \
            tqdm(total=len(plans), unit="notebook", file=sys.stderr, dynamic_ncols=True) as bar:
        futures = {pool.submit(run_one, notebook, out_dir, params, kernel=kernel, timeout=args.timeout,
                               html_report=not args.no_html): i for i, (notebook, params) in enumerate(plans)}
        for done in as_completed(futures):
            r = results[futures[done]] = done.result()
            bar.update(1)
            bar.set_postfix(last=f"{r.name} {r.status} {r.seconds:.0f}s")
    index = write_index(results, out_dir)
    print(summary(results, wall_seconds=time.perf_counter() - start))
    for r in results:
        if r.error:
            print(f"{r.name}: {r.error}", file=sys.stderr)
    print(f"report: {index}")
    ok = all(r.status == "ok" for r in results)
    if args.update_docs and not ok:
        print("docs/figures left unchanged: a notebook failed", file=sys.stderr)
    elif args.update_docs:
        docs = args.docs_dir or root / "docs" / "figures"
        docs.mkdir(parents=True, exist_ok=True)
        for png in sorted((out_dir / "figures").glob("*.png")):
            shutil.copy2(png, docs / png.name)
        print(f"figures copied to {docs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
