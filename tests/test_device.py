import os
import subprocess
import sys

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
