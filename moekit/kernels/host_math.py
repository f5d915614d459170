"""Integer helpers for launch shapes on the host, in plain Python.

Triton 3.5+ makes ``triton.cdiv`` and ``triton.next_power_of_2`` constexpr functions: called on
the host each goes through a wrapper that unwraps its arguments, about 2 µs a call, and a forward
computes a dozen launch shapes. These are the same integer maths without the wrapper. Inside a
``@triton.jit`` kernel keep using ``tl.cdiv``.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, as ``triton.cdiv``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` for ``n >= 1``, and 0 for 0, as ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()
