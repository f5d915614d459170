"""The install story: pins, environment.yml and pyproject.toml agree; the CI script calls make test."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements() -> dict[str, Requirement]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(data["dependencies"])
    for extra in data["optional-dependencies"].values():
        reqs += extra
    return {Requirement(r).name.lower(): Requirement(r) for r in reqs}


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*(?:-\s+)?([A-Za-z0-9_.\-]+)==([^\s#]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_environment_yml_lists_exactly_the_pyproject_packages():
    env = _pins(ROOT / "environment.yml")
    assert set(env) == set(_pyproject_requirements())


def test_pins_satisfy_pyproject_ranges_and_agree_with_environment_yml():
    reqs = _pyproject_requirements()
    pins = _pins(ROOT / "requirements" / "pins.txt")
    env = _pins(ROOT / "environment.yml")
    pins.setdefault("torch", re.search(r'TORCH \?= torch==(\S+)', (ROOT / "Makefile").read_text()).group(1))
    assert set(pins) == set(reqs)
    for name, version in pins.items():
        assert reqs[name].specifier.contains(version, prereleases=True), (name, version, reqs[name])
        assert env[name] == version, (name, env[name], version)


def test_interpreter_safe_triton_numpy_pair():
    # Seen: triton 3.6 + numpy 2.4 crash the interpreter; 3.9 + 2.4 work.
    pins = _pins(ROOT / "requirements" / "pins.txt")
    triton = tuple(int(x) for x in pins["triton"].split(".")[:2])
    numpy = tuple(int(x) for x in pins["numpy"].split(".")[:2])
    assert not (triton < (3, 9) and numpy >= (2, 4))


def test_ci_script_runs_make_test():
    text = (ROOT / ".ci" / "run").read_text()
    assert "make test" in text and "set -euo pipefail" in text
