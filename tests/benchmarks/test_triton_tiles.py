"""The sweep's tile specs and its compile-only mode."""

from __future__ import annotations

import pytest

from benchmarks import triton_tiles
from moekit.hopper.configs import KernelConfig


def test_a_spec_reads_as_its_config():
    assert triton_tiles.C("128x256x64 g8 w8 s3 t tail32") == KernelConfig(
        128, 256, 64, GROUP_M=8, num_warps=8, num_stages=3, TAIL_M=32, tma=True
    )


class _Fake:
    __name__ = "fake_kernel"

    def __init__(self):
        self.warmed, self.launched = [], []

    def warmup(self, *args, grid, **kwargs):
        self.warmed.append((grid, args, kwargs))
        return object()  # what a launcher must not keep

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(grid)


def test_compile_only_swaps_the_launchers_functions_and_restores_them():
    launchers = triton_tiles._launchers()
    before = [launcher.fn for launcher in launchers]
    with triton_tiles.compile_only(2):
        assert all(isinstance(launcher.fn, triton_tiles._WarmupOnly) for launcher in launchers)
        assert [launcher.fn.fn for launcher in launchers] == before
    assert [launcher.fn for launcher in launchers] == before


def test_inside_a_launch_only_compiles():
    fake = _Fake()
    result = triton_tiles._WarmupOnly(fake)[(4, 1)](1, 2, BLOCK_M=16)
    assert result is None and fake.launched == [] and fake.warmed == [((4, 1), (1, 2), {"BLOCK_M": 16})]


def test_an_error_inside_restores_them_too():
    launchers = triton_tiles._launchers()
    before = [launcher.fn for launcher in launchers]
    with pytest.raises(RuntimeError), triton_tiles.compile_only(2):
        raise RuntimeError("a failed compile")
    assert [launcher.fn for launcher in launchers] == before
