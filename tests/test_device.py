import os
import re
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
    advice = moekit.device.interpreter_advice((3, 6), (2, 4))
    assert re.search(r"Triton 3\.6.*numpy 2\.4.*triton >= 3\.7 or numpy < 2\.4", advice)
    for fine in (((3, 6), (2, 3)), ((3, 7), (2, 4)), ((3, 9), (2, 5)), ((3, 10), (2, 4))):
        assert moekit.device.interpreter_advice(*fine) is None


def test_importing_moekit_with_that_interpreter_warns():
    # As if triton 3.6.0 and numpy 2.4.0 were installed (their metadata is what moekit reads): a
    # warning at import (kernels without a run-time loop still run), not an error.
    code = (
        "import importlib.metadata as md, warnings\n"
        "real = md.version\n"
        "md.version = lambda name: {'triton': '3.6.0', 'numpy': '2.4.0'}.get(name) or real(name)\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    import moekit\n"
        "print([str(w.message) for w in seen if 'numpy < 2.4' in str(w.message)])\n"
    )
    env = {**os.environ, "MOEKIT_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "install triton >= 3.7 or numpy < 2.4" in out.stdout


def test_a_launch_that_meets_the_crash_names_it(monkeypatch):
    from moekit.errors import BackendUnavailableError
    from moekit.hopper import launch
    from moekit.testing import expect_raises

    def crashing(grid):
        def run(*args, **kwargs):
            raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

        return run

    fake = type("K", (), {"__getitem__": lambda self, grid: crashing(grid), "__name__": "_k"})()
    monkeypatch.setattr(moekit.device, "INTERPRETER_ADVICE", "install triton >= 3.7 or numpy < 2.4")
    with expect_raises(BackendUnavailableError, match="_k: install triton >= 3.7"):
        launch.LeanLauncher(fake)((1,), (), key="k", constexprs=dict)
    monkeypatch.setattr(moekit.device, "INTERPRETER_ADVICE", None)
    with expect_raises(TypeError, match="0-dimensional"):  # without the known pair, the error is Triton's own
        launch.LeanLauncher(fake)((1,), (), key="k", constexprs=dict)


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


def test_has_tma_follows_the_device():
    import torch

    from moekit.device import has_tma, interpreting

    if interpreting():
        assert has_tma() is False  # the interpreter reads descriptors, but no kernel picks TMA by default there
    else:
        assert has_tma() == (torch.cuda.get_device_capability()[0] >= 9)


@pytest.mark.interpreter
def test_interpreted_launches_skip_the_overflow_check_that_cannot_fire(monkeypatch):
    # With debug off (Triton's default) the interpreter computed an overflow check for every int32
    # add and dropped its assert; moekit's launch wrapper turns the check off for such launches only.
    import dataclasses

    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def _offset_kernel(x_ptr, base, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, offs + base)  # int32 + int32: an op the sanitizer checks

    builder, semantic = interpreter.interpreter_builder, interpreter.interpreter_semantic
    seen, real = [], semantic.binary_op_sanitize_overflow_impl

    def spy(lhs, rhs, op):
        seen.append(builder.options.sanitize_overflow)
        return real(lhs, rhs, op)

    monkeypatch.setattr(semantic, "binary_op_sanitize_overflow_impl", spy)
    x = torch.empty(16, dtype=torch.int32)
    _offset_kernel[(1,)](x, 5, BLOCK=16)
    assert torch.equal(x, torch.arange(16, dtype=torch.int32) + 5)
    assert seen and not any(seen), "the check ran during the launch"
    assert builder.options.sanitize_overflow is True and builder.options.debug is False  # restored after
    # With debug on, the check can fire, so it stays: an int32 overflow is reported as before.
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    with pytest.raises(Exception, match="overflow detected"):
        _offset_kernel[(1,)](x, 2**31 - 8, BLOCK=16)


@pytest.mark.interpreter
def test_interpreted_helpers_do_not_patch_the_language_again(monkeypatch):
    # Each @triton.jit helper call re-patched triton.language (a walk of its modules that swaps
    # nothing new); inside moekit's launch wrapper only the launch itself patches it.
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    global _add_one  # a helper is looked up in the kernel's module globals

    @triton.jit
    def _add_one(x):
        return x + 1

    @triton.jit
    def _count_up_kernel(x_ptr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        for _ in tl.static_range(STEPS):
            x = _add_one(x)
        tl.store(x_ptr + offs, x)

    walks, real = [], interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (walks.append(a[0]), real(*a))[1])
    load, patch_lang = tl.load, interpreter._patch_lang
    counts = {}
    for steps in (1, 12):
        walks.clear()
        x = torch.arange(16, dtype=torch.float32)
        _count_up_kernel[(1,)](x, STEPS=steps, BLOCK=16)
        assert torch.equal(x, torch.arange(16, dtype=torch.float32) + steps)
        counts[steps] = len(walks)
    assert counts[1] == counts[12] > 0, counts  # the launch's own patch only, however many helper calls
    assert tl.load is load and interpreter._patch_lang is patch_lang  # restored after the launch
