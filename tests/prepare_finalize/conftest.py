"""What the distributed tests of this folder share: one launch whose results several tests read.

Spawning a rank costs about 3 s of CPU (each imports torch and moekit afresh), more than most of
these tests' cases do, so tests whose cases can run in one process group share one launch.
Their rank functions import :func:`shared_launch.in_step` by name from this folder, which pytest's
importlib mode does not put on sys.path; the spawned ranks inherit the parent's sys.path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moekit.errors import DistributedError

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.append(HERE)

_LAUNCHED: dict = {}


@pytest.fixture(scope="session")
def launched():
    """``launched(key, run)``: what ``run()`` returned, ``run`` called once per ``key`` and session.

    A launch that failed (DistributedError) fails every test that reads it, with its message, and
    does not run again.
    """

    def get(key, run):
        if key not in _LAUNCHED:
            try:
                _LAUNCHED[key] = run()
            except DistributedError as e:
                _LAUNCHED[key] = e
        if isinstance(_LAUNCHED[key], DistributedError):
            raise _LAUNCHED[key]
        return _LAUNCHED[key]

    return get

