"""The workbook's exercises: checks that grade the learner's code, and hidden solutions.

Notebook ``10_workbook`` gives each exercise a task, a skeleton and a hint; this package grades::

    from moekit import workbook
    workbook.check("chunk_plan", chunk_plan, chunk_inputs)   # True, or False and one line why
    workbook.check("chunk_plan", chunk_plan, chunk_inputs, seed=1234)  # replays a printed seed
    workbook.show_solution("chunk_plan")                     # on purpose only: prints the solution
    fns = workbook.solution("chunk_plan")                    # the solution's objects, for a check

A check is a specification, not a few examples: it draws its cases from the whole space the
exercise's text allows (:mod:`moekit.workbook.cases`, freshly seeded on every run, with the
edges always included: every ids dtype and kind of expert map, empty input, whole tiles, an
expert past int16's limit, ...) and compares with :mod:`moekit.reference`. Every exercise's
contract is checked on every run: inputs are read-only, and new data of the same sizes gets a
new answer, also when it is written into the same tensor or list (a CUDA graph's static
buffer). Where the exercise is about *how*, it checks how: views, not copies (scales too); the
chunk's own rows; workspace bytes; and for the Triton kernels, that a ``@triton.jit`` kernel
did the work and what :func:`moekit.workbook.probes.watch_memory` saw each program read and
write (each id read once, one tile per program, atomics where programs meet, work per id).
A failed check raises :class:`moekit.errors.ExerciseFailed` inside, its one line ending in the
seed that replays it; :func:`check` prints that line (or re-raises with ``strict=True``).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from moekit.errors import ExerciseFailed, InvalidInputError
from moekit.validate import check_flag, check_positive_int
from moekit.workbook.cases import Sampler, fresh_seed


@dataclass(frozen=True)
class Exercise:
    """One exercise (``EXERCISES[key]``): what the learner writes (``names``), checked by
    ``check_<key>`` (in :mod:`moekit.workbook.checks` or :mod:`moekit.workbook.kernel_checks`),
    and its solution."""

    title: str
    names: tuple[str, ...]
    solution: str  # module under moekit.workbook.solutions


EXERCISES = {
    "chunk_plan": Exercise("1. The chunk plan", ("chunk_plan", "chunk_inputs"), "chunk_plan"),
    "workspace_shapes": Exercise("2. Workspace shapes of a new backend", ("MyExperts",), "workspace"),
    "recount": Exercise("3. The per-chunk recount", ("chunk_counts",), "recount"),
    "scan_kernel": Exercise("4a. The count kernel: the seed's scan", ("scan_kernel",), "count_kernels"),
    "histogram_kernel": Exercise("4b. The count kernel: one pass", ("histogram_kernel",), "count_kernels"),
    "align_kernel": Exercise("5. moe_align_block_size in Triton", ("align_kernel",), "align"),
    "row_plan": Exercise("6. A chunk plan along the sorted rows", ("row_chunk_plan",), "row_plan"),
}


def _exercise(key: str) -> Exercise:
    if key not in EXERCISES:
        raise InvalidInputError(f"no exercise {key!r}; the exercises are {list(EXERCISES)}")
    return EXERCISES[key]


def grade(key: str, *objects, seed: int | None = None) -> int:
    """Run exercise ``key``'s check on ``objects`` (the learner's, in :attr:`Exercise.names`
    order) with cases drawn from ``seed`` (None: a fresh one); returns the number of cases
    checked (:attr:`Sampler.cases <moekit.workbook.cases.Sampler>`), or raises ExerciseFailed,
    whose message ends with the seed."""
    ex = _exercise(key)
    if len(objects) != len(ex.names):
        raise InvalidInputError(f"exercise {key!r} checks {len(ex.names)} object(s) {ex.names}, got {len(objects)}")
    sampler = Sampler(fresh_seed() if seed is None else check_positive_int(seed, "seed", allow_zero=True))
    from moekit.workbook import checks, kernel_checks

    fn = getattr(checks, f"check_{key}", None) or getattr(kernel_checks, f"check_{key}")
    replay = f" [seed={sampler.seed}]"
    try:
        fn(*objects, sampler=sampler)
    except ExerciseFailed as e:
        raise ExerciseFailed(f"{e}{replay}") from e
    except NotImplementedError as e:
        raise ExerciseFailed(f"not written yet ({type(e).__name__}{': ' + str(e) if str(e) else ''})") from e
    except Exception as e:  # the learner's code crashed: that is a failed case, said in one line
        why = str(e).splitlines()[0][:240] if str(e) else ""
        raise ExerciseFailed(f"{type(e).__name__} in {sampler.case}: {why}{replay}") from e
    return sampler.cases


def check(key: str, *objects, strict: bool = False, seed: int | None = None, report=print) -> bool:
    """Grade and print one line: ``PASS`` with the number of cases and the seed, or ``FAIL``,
    why, and the seed (``seed=`` replays a run). ``report`` takes the line in ``print``'s place
    (:func:`check_button` shows it beside the button)."""
    title = _exercise(key).title
    check_flag(strict, "strict")
    seed = fresh_seed() if seed is None else seed
    try:
        cases = grade(key, *objects, seed=seed)
    except ExerciseFailed as e:
        if strict:
            raise
        report(f"FAIL  {title}: {e}")
        return False
    report(f"PASS  {title}: {cases} cases [seed={seed}]")
    return True


def solution(key: str) -> tuple:
    """The solution's objects of exercise ``key`` (what :func:`check` takes)."""
    ex = _exercise(key)
    module = importlib.import_module(f"moekit.workbook.solutions.{ex.solution}")
    return tuple(getattr(module, n) for n in ex.names)


def solution_source(key: str) -> str:
    """The source of exercise ``key``'s solution."""
    return "\n\n".join(inspect.getsource(obj) for obj in solution(key))


def show_solution(key: str) -> None:
    """Print exercise ``key``'s solution (the notebook never does unless asked)."""
    print(solution_source(key))


def check_button(key: str, objects):
    """A button that re-runs :func:`check` on ``objects()`` (a callable returning the learner's
    current objects) and shows the one-line result beside it."""
    import ipywidgets

    button = ipywidgets.Button(description=f"check {key}")
    result = ipywidgets.HTML()

    def run(_=None):
        lines = []
        colour = "green" if check(key, *objects(), report=lines.append) else "firebrick"
        result.value = f"<code style='color:{colour}'>{lines[0]}</code>"

    button.on_click(run)
    box = ipywidgets.HBox([button, result])
    box.run = run  # (what a click does, for a script or a test)
    return box


__all__ = ["EXERCISES", "Exercise", "check", "check_button", "grade", "show_solution", "solution", "solution_source"]
