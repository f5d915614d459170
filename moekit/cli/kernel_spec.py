"""The ``moekit-python`` kernelspec: this interpreter, written into a private folder put on JUPYTER_PATH.

The walkthrough and ``tests/test_notebooks.py`` run every notebook in it (:func:`use_moekit_kernel`).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

KERNEL_NAME = "moekit-python"

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
