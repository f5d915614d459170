"""moekit.cli.walkthrough (the runner behind `make walkthrough`): the command line, on two tiny notebooks."""

from __future__ import annotations

import pytest

from moekit.cli import notebook_runs, walkthrough


@pytest.mark.notebooks
def test_walkthrough_main(tmp_path, capsys, write_notebook):
    pytest.importorskip("papermill")
    pytest.importorskip("nbconvert")
    nbs, out, docs = tmp_path / "notebooks", tmp_path / "out", tmp_path / "docs"
    nbs.mkdir()
    plot = "from moekit import viz\nassert M == 7\nviz.plot_tokens_per_expert([1, 2, 3])"
    write_notebook(nbs / "01_ok.ipynb", "M = 1", plot, tags=["figure:tiny"])
    write_notebook(nbs / "02_fails.ipynb", "M = 1", "raise ValueError('boom')")
    args = ["--notebooks", str(nbs), "--out", str(out), "--update-docs", "--docs-dir", str(docs)]
    assert walkthrough.main([*args, "--only", "01", "-p", "M", "7"]) == 0
    first = out / "runs" / "01+M=7"  # a run's folder is named by what it ran
    assert (first / "01_ok.html").exists() and (first / "index.html").exists() and (out / "index.html").exists()
    assert (first / "figures" / "tiny.png").read_bytes().startswith(b"\x89PNG")
    assert (docs / "tiny.png").exists()
    assert walkthrough.main([*args, "01:M=7"]) == 1  # 02 fails: exit status 1, docs untouched
    printed = capsys.readouterr()
    assert "02_fails" in printed.out and "FAILED" in printed.out and "boom" in printed.err
    assert printed.out.index("01_ok") < printed.out.index("02_fails")  # two at once, listed in order
    assert "FAILED" in (out / "runs" / "01+M=7_02" / "index.html").read_text()
    # the first run's pages are still there, and the index of runs links both
    assert (first / "01_ok.html").exists()
    runs = (out / "index.html").read_text()
    assert "runs/01+M=7/index.html" in runs and "runs/01+M=7_02/index.html" in runs
    # `--only 01 01:M=7` keeps the override (argparse hands it to --only); a prefix that matches
    # nothing, or an override for a notebook outside the run, is an error that lists the notebooks.
    assert walkthrough.main([*args, "--only", "01", "01:M=7"]) == 0
    assert walkthrough.main([*args, "--only", "99"]) == 2
    assert walkthrough.main([*args, "--only", "01", "02:M=7"]) == 2
    printed = capsys.readouterr()
    assert "no notebook matches '99'" in printed.err and "01_ok, 02_fails" in printed.err
    assert "names no notebook of this run" in printed.err


def test_the_walkthrough_leaves_what_it_did_not_write_alone(tmp_path, capsys, write_notebook):
    """An --out that is or holds the notebooks' folder is refused (the executed copies would overwrite
    the notebooks); a run folder the walkthrough did not make is refused; a run again in its own folder
    removes only the files it wrote the first time."""
    from moekit.cli.notebook_runs import RUN_MARKER, claim_run_folder

    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    write_notebook(nbs / "01_ok.ipynb", "M = 1", "x = 1")
    source = (nbs / "01_ok.ipynb").read_text()
    for out in (nbs, tmp_path):
        assert walkthrough.main(["--notebooks", str(nbs), "--out", str(out)]) == 2
        assert "holds the notebooks' folder" in capsys.readouterr().err
    assert (nbs / "01_ok.ipynb").read_text() == source
    users = tmp_path / "out" / "runs" / "all"
    users.mkdir(parents=True)
    (users / "fig1_final.pdf").write_text("mine")
    assert walkthrough.main(["--notebooks", str(nbs), "--out", str(tmp_path / "out")]) == 2
    assert "was not written by `moekit walkthrough`" in capsys.readouterr().err
    assert (users / "fig1_final.pdf").read_text() == "mine"
    mine = tmp_path / "run"
    claim_run_folder(mine)
    (mine / "page.html").write_text("from the walkthrough")
    notebook_runs.record_run(mine, [])
    (mine / "notes.txt").write_text("the user's")  # added after the run: not the walkthrough's
    claim_run_folder(mine)
    assert not (mine / "page.html").exists() and (mine / "notes.txt").read_text() == "the user's"
    assert (mine / RUN_MARKER).is_file()


def test_run_names():
    assert notebook_runs.run_name(["01_a", "02_b"], {}, every=True) == "all"
    assert notebook_runs.run_name(["02_b"], {"02_b": {"M": 300, "C": 64}}, every=False) == "02+C=64+M=300"
    assert notebook_runs.run_name(["01_a"], {"01_a": {"s": "x/../y"}}, every=False) == "01+s=x-..-y"


def test_jobs_must_be_a_positive_count(capsys):
    with pytest.raises(SystemExit):
        walkthrough.build_parser().parse_args(["--jobs", "0"])
    assert "expected a whole number >= 1, got 0" in capsys.readouterr().err
    assert walkthrough.build_parser().parse_args(["--jobs", "3"]).jobs == 3


def test_the_checkout_is_found_from_any_folder(tmp_path, monkeypatch):
    # From another folder the walkthrough still finds the checkout's notebooks (an installed copy
    # without them falls back to the current folder).
    monkeypatch.chdir(tmp_path)
    root = walkthrough.repo_root()
    assert (root / "notebooks").is_dir() and (root / "moekit" / "cli" / "walkthrough.py").is_file()
