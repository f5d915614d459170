"""moekit.workbook.probes: loads counted per watched tensor; views told from copies."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.workbook.probes import count_loads, shares_memory


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
    with count_loads(x=x, y=y, out=out) as loads:
        _twice[(1,)](x, y, out, 10, BLOCK=16)
    assert (loads["x"], loads["y"], loads["out"]) == (20, 16, 0)


def test_views_and_copies():
    base = torch.arange(12).view(4, 3)
    assert shares_memory(base[1:3], base) and not shares_memory(base[1:3].clone(), base)
    assert shares_memory(base[:0].clone(), base)  # empty: allocates nothing either way
