"""A real JupyterLab in headless chromium: Run All, move a slider, see the plot change.

Starts ``jupyter lab`` on a free loopback port with a random token and fresh config/data/runtime
dirs, on a temporary copy of the notebooks; drives it with Playwright's Python API and the
system chromium (never ``playwright install``); saves screenshots under build/test-browser/;
stops the server by its PID. Skipped, with the reason, when chromium or playwright is missing.

The copies of notebooks 02 and 03 get smaller parameters, injected as papermill injects them (a
cell tagged ``injected-parameters`` after the ``parameters`` cell): these tests are about the UI,
and ``tests/test_notebooks.py`` runs every notebook at its defaults already.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = Path(os.environ.get("MOEKIT_NOTEBOOKS_DIR", ROOT / "notebooks"))
SHOTS = ROOT / "build" / "test-browser"
CHROMIUM = Path(os.environ.get("MOEKIT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
EXPLORER = "03_per_chunk_expert_assignment.ipynb"
CRASH = "02_workspace_shape_crash.ipynb"
WORKBOOK = "10_workbook.ipynb"
# What the UI tests run the notebooks at. 03: its three forwards at the defaults (M=256 tokens, E=32)
# took most of the explorer test's 80 s; here four chunks of C=16 per router, and the slider halves C.
# 02: M=130 in chunks of 128 is the smallest batch whose pre-fix run crashes (chunk 0 takes
# DeepGEMM's layout, chunk 1 Triton's), so it keeps them; one slot per token halves the rows.
EXPLORER_PARAMETERS = dict(M=64, C=16, E=8)
CRASH_PARAMETERS = dict(topk=1, E=4)
RUN_ALL_TIMEOUT_MS = 240_000
VISIBLE = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook on screen

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no chromium at {CHROMIUM} (apt-get install chromium)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"jupyter lab did not answer {url} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _inject_parameters(path: Path, parameters: dict) -> None:
    """Rewrite the notebook at ``path`` with ``parameters`` injected after its ``parameters`` cell."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(path))  # what papermill reads: every cell's tags filled in
    assert any("parameters" in c.metadata.tags for c in nb.cells), f"{path.name}: no parameters cell"
    nbformat.write(parameterize_notebook(nb, parameters), str(path))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A running JupyterLab on a copy of the notebooks; yields (base_url, token)."""
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    pytest.importorskip("papermill", reason="papermill is not installed")
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "notebooks"
    shutil.copytree(NOTEBOOKS_DIR, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    _inject_parameters(root / EXPLORER, EXPLORER_PARAMETERS)
    _inject_parameters(root / CRASH, CRASH_PARAMETERS)
    env = dict(os.environ)
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        env[var] = str(tmp / var.lower())
    # The lab's kernel is this interpreter: venv's python3 spec, whose argv "python" jupyter_client
    # replaces by the server's own sys.executable. Keep user-level kernelspecs out of the way.
    env.pop("JUPYTER_PATH", None)
    labconfig = Path(env["JUPYTER_CONFIG_DIR"]) / "labconfig"
    labconfig.mkdir(parents=True)
    # No news pop-up (it asks to fetch from the internet) covering the notebook.
    disabled = {"@jupyterlab/apputils-extension:announcements": True}
    (labconfig / "page_config.json").write_text(json.dumps({"disabledExtensions": disabled}))
    # Render every cell (JupyterLab 4 skips painting cells off screen, so their text is not in the
    # page's innerText): the tests read outputs anywhere in a notebook.
    env["JUPYTERLAB_SETTINGS_DIR"] = str(tmp / "lab-settings")
    tracker = Path(env["JUPYTERLAB_SETTINGS_DIR"]) / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), secrets.token_hex(16)
    jupyter = Path(sys.executable).parent / "jupyter"
    cmd = [str(jupyter), "lab"] if jupyter.exists() else [sys.executable, "-m", "jupyterlab"]
    cmd += ["--allow-root", "--no-browser", "--ip=127.0.0.1", f"--port={port}", f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0", "--LabApp.check_for_updates_class="
            "jupyterlab.NeverCheckForUpdate"]
    log = tmp / "lab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{base}/api/status?token={token}", proc, log)
        yield base, token
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its kernels
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        SHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, SHOTS / "lab.log")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _open(browser, lab, name: str):
    base, token = lab
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.set_default_timeout(60_000)
    # A workspace of its own, so the lab does not restore the other notebook's tab beside it.
    page.goto(f"{base}/lab/workspaces/{Path(name).stem[:2]}/tree/{name}?reset&token={token}")
    _wait_idle(page)
    return page


def _wait_idle(page, timeout_ms: int = 90_000) -> None:
    """The status bar names the kernel and its state: wait for 'Idle'."""
    page.locator("#jp-main-statusbar").get_by_text("Idle").first.wait_for(timeout=timeout_ms)


def _run_all(page, shot: str) -> None:
    page.locator(f"{VISIBLE} .jp-Notebook").click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        page.wait_for_function(  # every code cell ran: a number in each prompt, no "[*]" left
            """selector => {
                const cells = [...document.querySelectorAll(selector)];
                return cells.length > 0 && cells.every(p => /\\[\\d+\\]/.test(p.textContent));
            }""",
            arg=f"{VISIBLE} .jp-CodeCell .jp-InputArea-prompt",
            timeout=RUN_ALL_TIMEOUT_MS,
        )
        _wait_idle(page)
    finally:
        page.screenshot(path=str(SHOTS / shot), full_page=True)


def test_explorer_slider_redraws_the_plot(browser, lab):
    page = _open(browser, lab, EXPLORER)
    try:
        _run_all(page, "03_after_run_all.png")
        page.get_by_text("all checks passed").first.wait_for()
        plot = page.locator(".widget-output img").first
        plot.wait_for()
        before = plot.get_attribute("src")
        summary = page.locator(".widget-html").first
        c_before = int(re.search(r"C=(\d+)", summary.inner_text()).group(1))
        # The explorer starts at the injected parameters (so the smaller run is the one tested).
        assert f"M={EXPLORER_PARAMETERS['M']} tokens" in summary.inner_text()
        assert c_before == EXPLORER_PARAMETERS["C"]
        slider = page.locator(".widget-hslider", has_text="C chunk").locator(".noUi-handle")
        slider.focus()
        page.keyboard.press("ArrowLeft")  # one chunk size down: C halves
        page.wait_for_function(
            "before => { const i = document.querySelector('.widget-output img'); return i && i.src !== before; }",
            arg=before,
            timeout=60_000,
        )
        page.locator(".widget-output img").first.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "03_after_slider.png"), full_page=True)
        assert page.locator(".widget-output img").first.get_attribute("src") != before
        assert f"C={c_before // 2};" in summary.inner_text()
    finally:
        page.close()


def test_crash_notebook_shows_errors_and_checks(browser, lab):
    page = _open(browser, lab, CRASH)
    try:
        _run_all(page, "02_after_run_all.png")
        text = page.locator(f"{VISIBLE} .jp-Notebook").inner_text()
        assert all(f"{k} = {v!r}" in text for k, v in CRASH_PARAMETERS.items()), "no injected parameters cell"
        assert "all checks passed" in text, "the final check cell did not print"
        raw = "the raw torch error (as the parent commit's code raises it) is not shown"
        assert "IndexError: Dimension out of range" in text, raw
        assert "bug 1 of vLLM PR #20392" in text, "the guard's WorkspaceShapeError message is not shown"
        assert not page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']").count()
        # The bug-1 explorer reruns both loops when a slider moves: C up to M makes one chunk.
        summary = page.locator(".widget-html").first
        assert "crashed at chunk" in summary.inner_text()
        slider = page.locator(".widget-hslider", has_text="C chunk").locator(".noUi-handle")
        slider.focus()
        page.keyboard.press("PageUp")  # C jumps up past M: one chunk, DeepGEMM only
        page.wait_for_function(
            "() => !document.querySelector('.widget-html').innerText.includes('crashed')", timeout=120_000
        )
        page.screenshot(path=str(SHOTS / "02_after_slider.png"), full_page=True)
        assert "ran through" in summary.inner_text()
    finally:
        page.close()


def test_a_learner_fills_an_exercise_and_its_check_passes(browser, lab):
    """The workbook as a learner meets it: the skeleton's check fails; type the solution into the
    exercise cell, run it and its check, and the check passes."""
    from moekit import workbook

    page = _open(browser, lab, WORKBOOK)
    try:
        _run_all(page, "10_after_run_all.png")
        text = page.locator(f"{VISIBLE} .jp-Notebook").inner_text()
        assert "FAIL  3. The per-chunk recount: not written yet" in text
        cell = page.locator(f"{VISIBLE} .jp-CodeCell", has_text="def chunk_counts").first
        cell.locator(".cm-content").click()
        page.keyboard.press("Control+a")
        page.keyboard.insert_text(workbook.solution_source("recount"))  # no auto-indent: typed as one input
        page.keyboard.press("Shift+Enter")  # run the exercise cell, move to its check
        page.keyboard.press("Shift+Enter")  # run the check
        page.get_by_text("PASS  3. The per-chunk recount").first.wait_for(timeout=60_000)
        page.screenshot(path=str(SHOTS / "10_after_solution.png"), full_page=True)
    finally:
        page.close()
