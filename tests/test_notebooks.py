"""Execute every notebook with papermill, as `make walkthrough` does, at small CPU parameters.

A failing cell fails the test with papermill's message (cell, error, traceback). Executed copies
are kept under build/test-notebooks/ as artifacts. The kernel is this interpreter (a kernelspec
written by ``moekit.cli.kernel_spec.use_moekit_kernel``), so it imports this checkout's moekit, and
``moekit.device`` picks the Triton interpreter on a CPU machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moekit.cli import kernel_spec

pm = pytest.importorskip("papermill")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ARTIFACTS = ROOT / "build" / "test-notebooks"
BUDGET_S = 120  # each notebook targets <= 60 s on 2 cores; fail loudly well before the global timeout

# Parameters that keep CI small where a notebook's defaults are larger than a test needs.
SMALL: dict[str, dict] = {}
# Notebooks that compute every check from their plan must hold away from their defaults too: at
# three other sets each, one with C above 512 (02's explorer once clamped its sliders there; its
# checks now fail if a slider does not hold the notebook's M and C), one where nothing crosses the
# switch, one with every chunk under it. Sizes stay small (K, N, E) because the interpreter is slow:
# 02 at M=530 took 190 s on a loaded 2-core machine, so its large-C set keeps M at 300.
OTHER_PARAMETERS = {
    "02_workspace_shape_crash": [dict(M=300, C=600), dict(M=127, C=128), dict(M=257, C=64), dict(M=1, C=1),
                                 dict(E=1, topk=1)],
    # 03: one token a chunk (the hot expert is read only by the chunks of its tokens; long rows fold),
    # one expert (it is the hot one), one token, one chunk
    "03_per_chunk_expert_assignment": [dict(M=64, C=1), dict(E=1, topk=1), dict(M=1), dict(C=512)],
    # 05: one expert (stale counts move no row to another group: the answer is right), one token
    "05_stale_token_counts": [dict(M=530, C=520, E=2), dict(M=127, C=128), dict(M=257, C=64),
                              dict(M=64, C=16, E=1, topk=1), dict(M=1, C=1)],
    # 09: M and C above 512; M=1 (the row plan declares more workspace than one chunk); a uniform router
    "09_row_chunks": [dict(M=530, C=520, R=1152, E=4, K=64, N=128), dict(M=1, C=1, R=128, E=4, K=64, N=128),
                      dict(M=300, C=32, R=256, E=8, K=64, N=128, skew=0.0), dict(M=32, C=1, E=1, topk=1)],
    # 11: C and R above 512 (one token chunk; the counted reservation overflows); one token; topk=3 with
    # token chunks of 9, where the profile run's routing already needs the most (nothing overflows); one
    # expert. (M = 0 is section 1's subject: it builds that rank itself, whatever M is.)
    "11_life_of_chunking": [dict(M=40, C=600, R=640), dict(M=1, C=1, R=128, E=4), dict(M=12, C=9, E=4, topk=3, seed=1),
                            dict(E=1, topk=1)],
    # The workbook with the kit's solutions in place of the skeletons: every check must pass.
    "10_workbook": [dict(use_solutions=True)],
}
# Parameters a notebook does not take: its first cells say so by name, before anything runs.
REFUSED_PARAMETERS = {"02_workspace_shape_crash": dict(M=0), "05_stale_token_counts": dict(M=0, C=1),
                      "03_per_chunk_expert_assignment": dict(topk=3, E=2), "11_life_of_chunking": dict(M=0)}

pytestmark = pytest.mark.notebooks


@pytest.fixture(scope="module")
def kernel_name():
    return kernel_spec.use_moekit_kernel()


def test_found_notebooks():
    assert len(NOTEBOOKS) >= 6, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    pm.execute_notebook(
        str(path),
        str(ARTIFACTS / path.name),
        parameters=SMALL.get(path.stem, {}),
        kernel_name=kernel_name,
        cwd=str(path.parent),
        progress_bar=False,
        execution_timeout=BUDGET_S,
    )
    seconds = time.perf_counter() - start
    assert seconds < BUDGET_S, f"{path.name} took {seconds:.0f} s (budget {BUDGET_S} s)"


@pytest.mark.parametrize(
    "stem, params",
    [(stem, params) for stem, sets in OTHER_PARAMETERS.items() for params in sets],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_notebooks_hold_at_other_parameters(stem, params, kernel_name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ROOT / "notebooks" / f"{stem}.ipynb"
    pm.execute_notebook(str(path), str(ARTIFACTS / f"{stem}-{'-'.join(map(str, params.values()))}.ipynb"),
                        parameters=params, kernel_name=kernel_name, cwd=str(path.parent), progress_bar=False,
                        execution_timeout=BUDGET_S)  # fmt: skip


@pytest.mark.parametrize("stem", list(REFUSED_PARAMETERS))
def test_parameters_outside_a_notebooks_domain_are_named(stem, kernel_name):
    path, params = ROOT / "notebooks" / f"{stem}.ipynb", REFUSED_PARAMETERS[stem]
    with pytest.raises(pm.PapermillExecutionError, match=r"M >= 1 and 1 <= topk <= E, got") as failed:
        pm.execute_notebook(str(path), str(ARTIFACTS / f"{stem}-refused.ipynb"), parameters=params,
                            kernel_name=kernel_name, cwd=str(path.parent), progress_bar=False,
                            execution_timeout=BUDGET_S)  # fmt: skip
    assert failed.value.exec_count <= 3, "refused in the cell after the imports, before any demonstration"
