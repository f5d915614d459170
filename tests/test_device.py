import os
import subprocess
import sys

import pytest

import moekit


def test_interpreter_switch_matches_device():
    dev = moekit.device.get_device()
    if dev.type == "cpu":
        assert moekit.device.interpreting()
        assert os.environ.get("TRITON_INTERPRET") == "1"
    else:
        assert not moekit.device.interpreting()


def test_switch_is_set_before_any_kernel_module_is_imported():
    code = (
        "import os, sys; import moekit; "
        "assert not any(m.startswith('moekit.kernels') for m in sys.modules), 'kernels imported eagerly'; "
        "print(os.environ.get('TRITON_INTERPRET'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    if moekit.device.get_device().type == "cpu":
        assert out.stdout.strip() == "1"


VALUES = ["1", "0", "true", "false", "TRUE", "False", "on", "off", "yes", "no", "y", "n", "", " 1", "2", "enable"]


def test_a_flag_reads_as_triton_reads_it(monkeypatch):
    # Issue 25, item 15: TRITON_INTERPRET=false was on for moekit and off for Triton.
    import triton

    for value in VALUES:  # the knob reads the environment on every access (nothing launches meanwhile)
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert moekit.device.env_flag("TRITON_INTERPRET") == triton.knobs.runtime.interpret, repr(value)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not moekit.device.env_flag("TRITON_INTERPRET") and not triton.knobs.runtime.interpret


def test_triton_interpret_false_is_off_for_moekit_too():
    code = "import moekit, triton; print(moekit.device.interpreting(), triton.knobs.runtime.interpret)"
    for value, on in (("false", False), ("0", False), ("true", True), ("1", True)):
        env = {**os.environ, "TRITON_INTERPRET": value}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.split() == [str(on), str(on)], (value, out.stdout)


def test_an_interpreter_known_to_crash_is_named():
    from moekit.errors import BackendUnavailableError
    from moekit.testing import expect_raises

    with expect_raises(BackendUnavailableError, match=r"Triton 3\.6.*numpy 2\.4.*triton >= 3\.7 or numpy < 2\.4"):
        moekit.device.check_interpreter_versions((3, 6), (2, 4))
    for fine in (((3, 6), (2, 3)), ((3, 7), (2, 4)), ((3, 9), (2, 5)), (None, (2, 4))):
        moekit.device.check_interpreter_versions(*fine)


def test_importing_moekit_with_that_interpreter_raises():
    # As if triton 3.6.0 and numpy 2.4.0 were installed (their metadata is what moekit reads).
    code = (
        "import importlib.metadata as md\n"
        "real = md.version\n"
        "md.version = lambda name: {'triton': '3.6.0', 'numpy': '2.4.0'}.get(name) or real(name)\n"
        "try:\n    import moekit\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        "else:\n    raise SystemExit('no error')\n"
    )
    env = {**os.environ, "MOEKIT_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("BackendUnavailableError") and "install triton >= 3.7 or numpy < 2.4" in out.stdout


@pytest.mark.interpreter
def test_interpreted_launches_of_any_kernel_take_turns():
    # The interpreter swaps process-wide state during a launch: without the lock, three of four
    # threads launching this (not moekit's) kernel failed with "Did you forget to add @triton.jit?".
    import threading

    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def _double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        for _ in range(tl.cdiv(n, BLOCK * 1000) + 1):  # a loop bounded at run time, as moekit's kernels have
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    call = interpreter.GridExecutor.__call__
    assert call._moekit_serialized and not getattr(call.__wrapped__, "_moekit_serialized", False)
    moekit.device._serialize_interpreted_launches()  # once only
    assert interpreter.GridExecutor.__call__ is call
    errors = []

    def work():
        try:
            for _ in range(10):
                x, y = torch.randn(1000), torch.empty(1000)
                _double_kernel[(8,)](x, y, 1000, BLOCK=128)
                assert torch.equal(y, x * 2)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
