"""moekit.workbook.probes: memory operations watched per program and tensor; views told from copies."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.workbook.probes import (
    is_triton_kernel,
    is_view_of,
    shares_memory,
    watch_inputs,
    watch_memory,
)


@triton.jit
def _twice(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(x_ptr + offs, mask=m)
    b = tl.load(x_ptr + offs, mask=m)
    c = tl.load(y_ptr + offs)  # unmasked: every lane counts
    tl.store(out_ptr + offs, a + b + c, mask=m)


@pytest.mark.skipif(not interpreting(), reason="loads are counted under the interpreter only")
def test_loads_are_counted_per_tensor_and_mask():
    x, y, out = torch.ones(10), torch.ones(16), torch.empty(16)
    with watch_memory(x=x, y=y, out=out) as ops:
        _twice[(1,)](x, y, out, 10, BLOCK=16)
    assert (ops.reads("x"), ops.reads("y"), ops.reads("out"), ops.writes("out")) == (20, 16, 0, 10)


def test_views_and_copies():
    base = torch.arange(12).view(4, 3)
    assert shares_memory(base[1:3], base) and not shares_memory(base[1:3].clone(), base)
    assert shares_memory(base[:0].clone(), base)  # empty: allocates nothing either way


@triton.jit
def _racy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.atomic_add(x_ptr + offs, 0, mask=offs < n)  # a read (and a write) through an atomic
    tl.store(out_ptr, tl.load(out_ptr) + tl.sum(x, axis=0))  # load-add-store: programs race on out[0]
    tl.atomic_add(out_ptr + 1, 1)  # atomics may meet
    tl.store(out_ptr + 2 + tl.program_id(0), 1)  # each program its own element
    tl.histogram(x, 4)


@pytest.mark.skipif(not interpreting(), reason="memory is watched under the interpreter only")
def test_every_memory_operation_is_watched_per_program():
    buf = torch.zeros(24, dtype=torch.int32)
    x, out = buf[:10], buf[12:18]  # buf[10:12] lies in no watched tensor
    x.copy_(torch.arange(10, dtype=torch.int32))
    with watch_memory(x=x, out=out) as ops:
        _racy[(2,)](x, out, 12, BLOCK=8)  # n=12 > 10: two lanes stray past x
    assert ops.programs == {0, 1} and ops.launches == [("_racy", (2,))]
    assert (ops.reads("x"), ops.writes("x"), ops.outside["atomic"]) == (10, 10, 2)
    assert ops.reads("x", 0) == 8 and ops.read_set("x", 1) == {8, 9}
    assert [r.index for r in ops.races("out")] == [0] and ops.races("x") == []
    assert ops.written("out", 1).tolist() == [0, 1, 3]
    assert {v for _, v, _ in ops.histogram_misses} >= {4, 5, 6, 7} and ops.work[0] > 0 and ops.total_work > ops.work[0]


def test_a_view_is_told_from_a_copy_and_a_cast():
    base = torch.randn(6, 4).to(torch.bfloat16)
    assert is_view_of(base[2:5], base, 2, 5)
    assert not is_view_of(base[2:5].float(), base, 2, 5) and not is_view_of(base[2:5].clone(), base, 2, 5)
    assert not is_view_of(base[1:4], base, 2, 5), "the right number of rows from the wrong place"
    assert is_view_of(base[6:6].clone(), base, 6, 6) and not is_view_of(base[6:6].float(), base, 6, 6)


@triton.jit
def _stray(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, BLOCK), 1)  # unmasked: half the lanes land past out


@pytest.mark.skipif(not interpreting(), reason="memory is watched under the interpreter only")
def test_a_stray_lane_is_counted_and_not_run():
    buf = torch.zeros(8, dtype=torch.int32)
    with watch_memory(out=buf[:4]) as ops:
        _stray[(1,)](buf[:4], BLOCK=8)
    assert ops.outside["write"] == 4 and buf.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


class _HostKernel:
    def __getitem__(self, grid):
        return lambda *args: None


def test_a_triton_kernel_is_told_from_a_host_function():
    assert is_triton_kernel(_twice) and is_triton_kernel(_stray)
    assert not is_triton_kernel(_HostKernel()) and not is_triton_kernel(len) and not is_triton_kernel(None)


def test_inputs_a_call_changed_are_named():
    ids, counts, scale = torch.arange(6).view(2, 3), [1, 2], torch.ones(3).to(torch.float8_e4m3fn)
    with watch_inputs(ids=ids, counts=counts, scale=scale, none=None) as changed:
        ids[1:].t()[0] = 7  # through a strided view
        counts.append(3)
    assert changed == ["ids", "counts"]
    with watch_inputs(ids=ids) as changed:
        ids.view(-1)  # a view reads, it does not write
    assert changed == []
