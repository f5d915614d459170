"""What moekit runs on, as ``moekit info`` prints it: versions, the device, the interpreter, deep_gemm."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Info:
    """What ``moekit info`` prints."""

    torch: str
    triton: str
    numpy: str
    device: str
    interpreter: bool
    deep_gemm_usable: bool
    deep_gemm_reason: str

    def lines(self) -> list[str]:
        values = dict(torch=self.torch, triton=self.triton, numpy=self.numpy, device=self.device)
        values["interpreter"] = "on (TRITON_INTERPRET=1)" if self.interpreter else "off"
        values["deep_gemm"] = "usable" if self.deep_gemm_usable else f"not usable ({self.deep_gemm_reason})"
        return [f"{name:<11} {value}" for name, value in values.items()]


def collect_info() -> Info:
    """Versions, the device, the interpreter switch, and whether deep_gemm can run."""
    import numpy
    import torch
    import triton

    import moekit
    from moekit.backends import deep_gemm

    status = deep_gemm.status()
    device = moekit.device.get_device()
    if device.type == "cuda":
        name = f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    else:
        name = "cpu (Triton interpreter)"
    versions = (torch.__version__, triton.__version__, numpy.__version__)
    return Info(*versions, name, moekit.device.interpreting(), status.usable, status.reason)


def info(argv: list[str] | None = None) -> int:
    """Print what moekit runs on."""
    argparse.ArgumentParser(prog="moekit info", description=info.__doc__).parse_args(argv)
    for line in collect_info().lines():
        print(line)
    return 0
