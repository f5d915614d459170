"""Host-side launch maths: the same integers as Triton's constexpr helpers."""

from __future__ import annotations

import triton
from hypothesis import given
from hypothesis import strategies as st

from moekit.kernels.host_math import cdiv, next_power_of_2


@given(st.integers(min_value=0, max_value=2**40), st.integers(min_value=1, max_value=2**20))
def test_cdiv_is_tritons(a, b):
    assert cdiv(a, b) == triton.cdiv(a, b)


@given(st.integers(min_value=0, max_value=2**40))
def test_next_power_of_2_is_tritons(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)
