"""The workbook's checks in both directions: the solutions pass; the notebook's skeletons and
known-wrong solutions (at least two per exercise) fail, each with a one-line reason. Every run
draws fresh cases (a failure names its seed: ``workbook.grade(..., seed=...)`` replays it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from moekit import workbook
from moekit.device import interpreting
from moekit.errors import ExerciseFailed, InvalidInputError
from moekit.workbook.cases import fresh_seed

_path = Path(__file__).with_name("wrong_solutions.py")
_spec = importlib.util.spec_from_file_location("workbook_wrong_solutions", _path)
_wrong = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_wrong)
WRONG = _wrong.WRONG

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "10_workbook.ipynb"


@pytest.mark.parametrize("key", list(workbook.EXERCISES))
def test_the_solution_passes(key):
    assert workbook.grade(key, *workbook.solution(key)) > 0


def _skeletons(folder: Path) -> dict:
    """The notebook's import cell and every cell tagged 'exercise', written to a module and
    imported (a GPU build of Triton reads a kernel's source from its file); its names."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    parts = ["".join(code[1]["source"])]  # the imports (code[0] is the parameters cell)
    parts += ["".join(c["source"]) for c in code if "exercise" in c["metadata"].get("tags", [])]
    path = folder / "workbook_skeletons.py"
    path.write_text("\n\n\n".join(parts) + "\n")
    spec = importlib.util.spec_from_file_location("workbook_skeletons", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


@pytest.mark.parametrize("key", list(workbook.EXERCISES))
def test_the_notebooks_skeleton_fails(key, tmp_path):
    scope = _skeletons(tmp_path)
    objects = [scope[n] for n in workbook.EXERCISES[key].names]
    with pytest.raises(ExerciseFailed):
        workbook.grade(key, *objects)


CASES = [(key, wrong[0], wrong[1], wrong[2:] == ("interpreter",)) for key, wrongs in WRONG.items() for wrong in wrongs]


def _name(obj) -> str:
    return obj.fn.__name__ if hasattr(obj, "fn") else getattr(obj, "__name__", type(obj).__name__)


@pytest.mark.parametrize("key, fns, why, needs_interpreter", CASES,
                         ids=[f"{k}-{'-'.join(_name(x) for x in f)}" for k, f, _, _ in CASES])  # fmt: skip
def test_a_known_wrong_solution_fails_for_its_reason(key, fns, why, needs_interpreter):
    if needs_interpreter and not interpreting():
        pytest.skip("it gives right answers; how it ran is watched under the interpreter only")
    for name, memo in vars(_wrong).items():  # _SEEN, _COUNTED, ...: the memoising solutions' caches
        if name.startswith("_") and not name.startswith("__") and isinstance(memo, dict):
            memo.clear()  # they start empty: an earlier test's answers are not this test's reason
    seed = fresh_seed()
    with pytest.raises(ExerciseFailed, match=why) as caught:
        cases = workbook.grade(key, *fns, seed=seed)
        pytest.fail(f"passed {cases} cases [seed={seed}]")
    assert "\n" not in str(caught.value), "a failed check says why in one line"
    assert str(caught.value).endswith(f"[seed={seed}]"), "a failed check names the seed that replays it"


def test_every_exercise_has_two_wrong_solutions():
    assert set(WRONG) == set(workbook.EXERCISES) and all(len(w) >= 2 for w in WRONG.values())


def test_check_prints_one_line_and_strict_raises(capsys):
    assert workbook.check("recount", *workbook.solution("recount")) is True
    assert capsys.readouterr().out.startswith("PASS  3. The per-chunk recount")
    wrong = WRONG["recount"][0][0]
    assert workbook.check("recount", *wrong) is False
    assert capsys.readouterr().out.startswith("FAIL  3. The per-chunk recount: chunk_counts(")
    with pytest.raises(ExerciseFailed):
        workbook.check("recount", *wrong, strict=True)


def test_a_printed_seed_replays_the_failure(capsys):
    wrong = WRONG["recount"][1][0]
    assert workbook.check("recount", *wrong) is False
    line = capsys.readouterr().out.strip()
    seed = int(line.rsplit("[seed=", 1)[1].rstrip("]"))
    assert workbook.check("recount", *wrong, seed=seed) is False
    assert capsys.readouterr().out.strip() == line
    assert workbook.check("recount", *workbook.solution("recount"), seed=seed)
    assert capsys.readouterr().out.strip().endswith(f"cases [seed={seed}]")


def test_bad_arguments_are_named():
    with pytest.raises(InvalidInputError, match="no exercise 'nope'"):
        workbook.grade("nope", len)
    with pytest.raises(InvalidInputError, match="checks 2 object"):
        workbook.grade("chunk_plan", len)
    with pytest.raises(InvalidInputError, match="seed must be a non-negative int"):
        workbook.grade("recount", len, seed=-1)


def test_show_solution_prints_the_source(capsys):
    workbook.show_solution("row_plan")
    assert "def row_chunk_plan" in capsys.readouterr().out


def test_the_button_reruns_the_check():
    pytest.importorskip("ipywidgets")
    box = workbook.check_button("recount", lambda: workbook.solution("recount"))
    box.run()
    assert "PASS" in box.children[1].value
