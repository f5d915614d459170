"""``moekit walkthrough``: run every notebook and write an HTML report.

::

    moekit walkthrough                      # all notebooks -> build/walkthrough/runs/all/index.html
    moekit walkthrough -p M 256             # M=256 in every notebook that has a parameter M
    moekit walkthrough 02:M=256 02:C=64     # only in notebook 02
    moekit walkthrough --only 02 03         # a subset
    moekit walkthrough --only 02 02:M=300   # a subset, with a parameter
    moekit walkthrough --update-docs        # also copy the key figures to docs/figures/
    moekit walkthrough --jobs 1             # one notebook at a time (default: two, each in its own kernel)

Each run writes into a folder of its own, ``<out>/runs/<name>/``, named by what it ran (``all``,
or the notebooks and overrides: ``02+M=300``), so one run never replaces another's pages; the
walkthrough removes only files it wrote itself (a folder it did not make is refused), and refuses
an ``--out`` that is or holds the notebooks' folder. For each notebook it writes the executed
``.ipynb`` and its HTML (nbconvert), then the run's ``index.html`` linking them (with what it ran
on: ``moekit info``), and ``<out>/index.html`` lists every run. It prints a table (notebook,
seconds, status) and returns 1 if any notebook failed, 2 for bad arguments. Cells tagged
``figure:<name>`` have their PNG saved as ``figures/<name>.png`` in the run's folder (the README's
figures). papermill, nbconvert and tqdm are imported inside the functions.

This module is the command line (:func:`build_parser`, :func:`main`); the parts it calls live in
:mod:`moekit.cli.notebook_parameters` (what each notebook declares and gets),
:mod:`moekit.cli.notebook_runs` (one notebook through papermill, the figures, the table and the
index) and :mod:`moekit.cli.kernel_spec` (the kernel the notebooks run in).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from moekit.cli import notebook_runs
from moekit.cli.kernel_spec import use_moekit_kernel
from moekit.cli.notebook_parameters import declared_parameters, parameters_for, parse_value, scoped_overrides


def repo_root() -> Path:
    """The checkout that holds ``notebooks/`` (the parent of the ``moekit`` package), else the cwd."""
    here = Path(__file__).resolve().parents[2]  # moekit/cli/walkthrough.py -> the checkout
    return here if (here / "notebooks").is_dir() else Path.cwd()


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
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NN",
        help="run only these notebooks (prefixes); NN:NAME=VALUE items here are overrides",
    )
    p.add_argument("--notebooks", type=Path, default=None, help="folder of notebooks (default: <repo>/notebooks)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: <repo>/build/walkthrough)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per cell before a notebook fails")
    p.add_argument(
        "--jobs",
        type=_positive,
        default=min(2, os.cpu_count() or 1),
        help="notebooks run at once, each in its own kernel process (default: 2, or 1 on one core)",
    )
    p.add_argument("--no-html", action="store_true", help="skip the nbconvert HTML export")
    p.add_argument("--update-docs", action="store_true", help="copy the figures to --docs-dir")
    p.add_argument("--docs-dir", type=Path, default=None, help="default: <repo>/docs/figures")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text}")
    return value


class _Refused(Exception):
    """A command line the walkthrough refuses before any notebook runs (exit status 2)."""


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
    try:
        if nb_dir == out_dir or nb_dir.is_relative_to(out_dir):
            raise _Refused(
                f"--out {out_dir} is or holds the notebooks' folder ({nb_dir}); the executed copies would "
                "overwrite the notebooks. Choose a folder outside it (default: build/walkthrough)."
            )
        every = sorted(nb_dir.glob("[0-9][0-9]_*.ipynb"))
        if not every:
            raise _Refused(f"no notebooks found in {nb_dir}")
        notebooks = [n for n in every if not args.only or any(n.stem.startswith(o) for o in args.only)]
        unmatched = [o for o in args.only or () if not any(n.stem.startswith(o) for n in every)]
        if unmatched:
            names = ", ".join(n.stem for n in every)
            raise _Refused(f"no notebook matches {', '.join(map(repr, unmatched))}; the notebooks are: {names}")
        global_params = {k: parse_value(v) for k, v in args.parameter}
        scoped = scoped_overrides(args.overrides)
        for scope, key, _ in scoped:
            if not any(n.stem == scope or n.stem.split("_")[0] == scope for n in notebooks):
                names = ", ".join(n.stem for n in notebooks)
                raise _Refused(f"{scope}:{key}=... names no notebook of this run ({names})")
        plans = [(n, parameters_for(n, declared_parameters(n), global_params, scoped)) for n in notebooks]
        # Each run has a folder of its own under out_dir/runs/, named by what it ran: another run (other
        # notebooks, other parameters) never replaces it, and out_dir/index.html lists them all.
        given = {n.stem: p for n, p in plans}
        run_dir = out_dir / "runs" / notebook_runs.run_name(list(given), given, every=notebooks == every)
        notebook_runs.claim_run_folder(run_dir)
    except (_Refused, FileExistsError) as error:
        print(f"moekit walkthrough: {error}", file=sys.stderr)
        return 2
    run = functools.partial(
        notebook_runs.run_one, kernel=use_moekit_kernel(), timeout=args.timeout, html_report=not args.no_html
    )
    start = time.perf_counter()
    results: list[notebook_runs.Result | None] = [None] * len(plans)
    # Each notebook runs in a kernel process of its own: threads here only wait on them. The
    # table and the index keep the notebooks' order, whichever finishes first.
    with (
        ThreadPoolExecutor(max_workers=args.jobs) as pool,
        tqdm(total=len(plans), unit="notebook", file=sys.stderr, dynamic_ncols=True) as bar,
    ):
        futures = {pool.submit(run, notebook, run_dir, params): i for i, (notebook, params) in enumerate(plans)}
        for done in as_completed(futures):
            r = results[futures[done]] = done.result()
            bar.update(1)
            bar.set_postfix(last=f"{r.name} {r.status} {r.seconds:.0f}s")
    index = notebook_runs.write_index(results, run_dir, title=f"moekit walkthrough: {run_dir.name}")
    notebook_runs.record_run(run_dir, results)
    notebook_runs.write_runs_index(out_dir)
    print(notebook_runs.summary(results, wall_seconds=time.perf_counter() - start))
    for r in results:
        if r.error:
            print(f"{r.name}: {r.error}", file=sys.stderr)
    print(f"report: {index} (every run: {out_dir / 'index.html'})")
    ok = all(r.status == "ok" for r in results)
    if args.update_docs and not ok:
        print("docs/figures left unchanged: a notebook failed", file=sys.stderr)
    elif args.update_docs:
        docs = args.docs_dir or root / "docs" / "figures"
        docs.mkdir(parents=True, exist_ok=True)
        for png in sorted((run_dir / "figures").glob("*.png")):
            shutil.copy2(png, docs / png.name)
        print(f"figures copied to {docs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
