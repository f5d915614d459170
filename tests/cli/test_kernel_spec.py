"""moekit.cli.kernel_spec: the ``moekit-python`` kernelspec runs this interpreter, from a private folder."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moekit.cli import kernel_spec


def test_kernel_spec_runs_this_interpreter(monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", "/elsewhere")
    assert kernel_spec.use_moekit_kernel() == kernel_spec.KERNEL_NAME
    first = os.environ["JUPYTER_PATH"].split(os.pathsep)
    assert first[1:] == ["/elsewhere"]
    spec = json.loads((Path(first[0]) / "kernels" / kernel_spec.KERNEL_NAME / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    kernel_spec.use_moekit_kernel()  # a second call does not add the folder again
    assert os.environ["JUPYTER_PATH"].split(os.pathsep) == first


def test_kernel_spec_is_private_and_never_a_planted_folder(tmp_path, monkeypatch):
    # Before: a predictable folder under the shared temp dir, accepted as found (mode 0777, another
    # user's) and written through symlinks, then put first on JUPYTER_PATH.
    import hashlib
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(kernel_spec, "_SPEC_ROOT", None)
    monkeypatch.setattr(kernel_spec, "_MADE", set())
    monkeypatch.setenv("JUPYTER_PATH", "")
    planted = tmp_path / f"moekit-kernels-{hashlib.sha1(sys.executable.encode()).hexdigest()[:10]}"
    (planted / "kernels").mkdir(parents=True)
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    (planted / "kernels" / kernel_spec.KERNEL_NAME).symlink_to(elsewhere)
    for d in (planted, planted / "kernels", elsewhere):
        d.chmod(0o777)
    os.chown(planted, 65534, 65534) if os.geteuid() == 0 else None  # another user's, where we can
    root = kernel_spec.kernel_spec_dir()
    assert root != planted and not list(elsewhere.iterdir()), "used the planted folder"
    assert _private_dir(root)
    spec = root / "kernels" / kernel_spec.KERNEL_NAME / "kernel.json"
    assert not spec.is_symlink() and json.loads(spec.read_text())["argv"][0] == sys.executable
    assert kernel_spec.kernel_spec_dir() == root  # reused while it stays private
    # Someone swaps our spec folder for a symlink (or opens it up): a fresh private folder is made.
    spec_dir = spec.parent
    spec.unlink()
    spec_dir.rmdir()
    spec_dir.symlink_to(elsewhere)
    kernel_spec.use_moekit_kernel()
    other = Path(os.environ["JUPYTER_PATH"].split(os.pathsep)[0])
    assert other != root and _private_dir(other) and not list(elsewhere.iterdir())
    other.chmod(0o755)
    kernel_spec.use_moekit_kernel()  # a fresh folder, and the opened one leaves JUPYTER_PATH
    third = os.environ["JUPYTER_PATH"].split(os.pathsep)
    assert third[0] != str(other) and str(other) not in third and _private_dir(Path(third[0]))


def _private_dir(path: Path) -> bool:
    import stat

    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
