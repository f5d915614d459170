"""moekit.cli.walkthrough (the runner behind `make walkthrough`), on two tiny notebooks."""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

import pytest

from moekit.cli import walkthrough


def _notebook(path: Path, params: str, body: str, *, tags=()):
    import json

    cells = [
        {"cell_type": "markdown", "id": "0", "metadata": {}, "source": "# t\nYou will learn"},
        {
            "cell_type": "code",
            "id": "1",
            "metadata": {"tags": ["parameters"]},
            "source": params,
            "outputs": [],
            "execution_count": None,
        },
        {
            "cell_type": "code",
            "id": "2",
            "metadata": {"tags": list(tags)},
            "source": body,
            "outputs": [],
            "execution_count": None,
        },
    ]
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def test_declared_parameters_reads_what_papermill_skips(tmp_path):
    _notebook(tmp_path / "01_a.ipynb", "M = 130  # tokens (M = 130 crosses the switch)\nsizes = [1, 2]", "pass")
    assert walkthrough.declared_parameters(tmp_path / "01_a.ipynb") == {"M": 130, "sizes": [1, 2]}


def test_parameters_for():
    nb = Path("02_workspace_shape_crash.ipynb")
    declared = {"M": 130, "C": 128}
    scoped = [("02", "C", 64), ("03", "M", 1)]
    assert walkthrough.parameters_for(nb, declared, {"M": 256, "E": 4}, scoped) == {"M": 256, "C": 64}
    with pytest.raises(SystemExit, match="no parameter 'E'"):
        walkthrough.parameters_for(nb, declared, {}, [("02", "E", 4)])
    assert walkthrough.parse_value("0.5") == 0.5 and walkthrough.parse_value("abc") == "abc"


@pytest.mark.notebooks
def test_walkthrough_main(tmp_path, capsys):
    pytest.importorskip("papermill")
    pytest.importorskip("nbconvert")
    nbs, out, docs = tmp_path / "notebooks", tmp_path / "out", tmp_path / "docs"
    nbs.mkdir()
    plot = "from moekit import viz\nassert M == 7\nviz.plot_tokens_per_expert([1, 2, 3])"
    _notebook(nbs / "01_ok.ipynb", "M = 1", plot, tags=["figure:tiny"])
    _notebook(nbs / "02_fails.ipynb", "M = 1", "raise ValueError('boom')")
    args = ["--notebooks", str(nbs), "--out", str(out), "--update-docs", "--docs-dir", str(docs)]
    assert walkthrough.main([*args, "--only", "01", "-p", "M", "7"]) == 0
    assert (out / "01_ok.html").exists() and (out / "index.html").exists()
    assert (out / "figures" / "tiny.png").read_bytes().startswith(b"\x89PNG")
    assert (docs / "tiny.png").exists()
    assert walkthrough.main([*args, "01:M=7"]) == 1  # 02 fails: exit status 1, docs untouched
    printed = capsys.readouterr()
    assert "02_fails" in printed.out and "FAILED" in printed.out and "boom" in printed.err
    assert printed.out.index("01_ok") < printed.out.index("02_fails")  # two at once, listed in order
    assert "FAILED" in (out / "index.html").read_text()
    # `--only 01 01:M=7` keeps the override (argparse hands it to --only); a prefix that matches
    # nothing, or an override for a notebook outside the run, is an error that lists the notebooks.
    assert walkthrough.main([*args, "--only", "01", "01:M=7"]) == 0
    assert walkthrough.main([*args, "--only", "99"]) == 2
    assert walkthrough.main([*args, "--only", "01", "02:M=7"]) == 2
    printed = capsys.readouterr()
    assert "no notebook matches '99'" in printed.err and "01_ok, 02_fails" in printed.err
    assert "names no notebook of this run" in printed.err


def test_jobs_must_be_a_positive_count(capsys):
    with pytest.raises(SystemExit):
        walkthrough.build_parser().parse_args(["--jobs", "0"])
    assert "expected a whole number >= 1, got 0" in capsys.readouterr().err
    assert walkthrough.build_parser().parse_args(["--jobs", "3"]).jobs == 3


def test_summary_counts_the_notebooks_that_passed():
    results = [walkthrough.Result("01_a", seconds=1.25), walkthrough.Result("02_long_name", 2.5, "FAILED", "boom")]
    lines = walkthrough.summary(results).splitlines()
    assert lines[0].split() == ["notebook", "seconds", "status"]
    assert lines[2].split() == ["01_a", "1.2", "ok"] and lines[3].split() == ["02_long_name", "2.5", "FAILED"]
    assert lines[-1].split() == ["total", "3.8", "1/2", "ok"]
    assert walkthrough.summary(results, wall_seconds=2.6).splitlines()[-1].split() == ["wall", "clock", "2.6"]


def test_extract_figures_saves_each_tagged_png(tmp_path):
    png = b"\x89PNG\r\n\x1a\n" + os.urandom(16)
    output = {"output_type": "display_data", "data": {"image/png": base64.b64encode(png).decode()}, "metadata": {}}
    cells = [
        {"cell_type": "code", "metadata": {"tags": ["figure:one"]}, "outputs": [output]},
        {"cell_type": "code", "metadata": {"tags": ["other"]}, "outputs": [output]},
        {"cell_type": "code", "metadata": {"tags": ["figure:none"]}, "outputs": []},
    ]
    executed = tmp_path / "01_x.ipynb"
    executed.write_text(json.dumps({"cells": cells}))
    assert walkthrough.extract_figures(executed, tmp_path / "figures") == ["one.png"]
    assert (tmp_path / "figures" / "one.png").read_bytes() == png
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["one.png"]


def test_kernel_spec_runs_this_interpreter(monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", "/elsewhere")
    assert walkthrough.use_moekit_kernel() == walkthrough.KERNEL_NAME
    first = os.environ["JUPYTER_PATH"].split(os.pathsep)
    assert first[1:] == ["/elsewhere"]
    spec = json.loads((Path(first[0]) / "kernels" / walkthrough.KERNEL_NAME / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    walkthrough.use_moekit_kernel()  # a second call does not add the folder again
    assert os.environ["JUPYTER_PATH"].split(os.pathsep) == first


def test_kernel_spec_is_private_and_never_a_planted_folder(tmp_path, monkeypatch):
    # Before: a predictable folder under the shared temp dir, accepted as found (mode 0777, another
    # user's) and written through symlinks, then put first on JUPYTER_PATH.
    import hashlib
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(walkthrough, "_SPEC_ROOT", None, raising=False)
    monkeypatch.setattr(walkthrough, "_MADE", set(), raising=False)
    monkeypatch.setenv("JUPYTER_PATH", "")
    planted = tmp_path / f"moekit-kernels-{hashlib.sha1(sys.executable.encode()).hexdigest()[:10]}"
    (planted / "kernels").mkdir(parents=True)
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    (planted / "kernels" / walkthrough.KERNEL_NAME).symlink_to(elsewhere)
    for d in (planted, planted / "kernels", elsewhere):
        d.chmod(0o777)
    os.chown(planted, 65534, 65534) if os.geteuid() == 0 else None  # another user's, where we can
    root = walkthrough.kernel_spec_dir()
    assert root != planted and not list(elsewhere.iterdir()), "used the planted folder"
    assert _private_dir(root)
    spec = root / "kernels" / walkthrough.KERNEL_NAME / "kernel.json"
    assert not spec.is_symlink() and json.loads(spec.read_text())["argv"][0] == sys.executable
    assert walkthrough.kernel_spec_dir() == root  # reused while it stays private
    # Someone swaps our spec folder for a symlink (or opens it up): a fresh private folder is made.
    spec_dir = spec.parent
    spec.unlink()
    spec_dir.rmdir()
    spec_dir.symlink_to(elsewhere)
    walkthrough.use_moekit_kernel()
    other = Path(os.environ["JUPYTER_PATH"].split(os.pathsep)[0])
    assert other != root and _private_dir(other) and not list(elsewhere.iterdir())
    other.chmod(0o755)
    walkthrough.use_moekit_kernel()  # a fresh folder, and the opened one leaves JUPYTER_PATH
    third = os.environ["JUPYTER_PATH"].split(os.pathsep)
    assert third[0] != str(other) and str(other) not in third and _private_dir(Path(third[0]))


def _private_dir(path: Path) -> bool:
    import stat

    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
