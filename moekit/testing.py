"""Helpers shared by the tests and the notebooks.

- :func:`assert_close` compares with a tolerance chosen by dtype (one table for the project).
- :func:`expect_raises` is the notebook-friendly ``pytest.raises``: it fails when nothing is
  raised, so a demonstration of a crash cannot silently stop crashing.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

# (atol, rtol) against the fp32 reference; atol is relative to the largest |expected|.
# fp8 is compared on dequantized inputs. e4m3 keeps 3 mantissa bits (2**-4 relative rounding),
# and the fp8 layer quantizes twice (activations, then the intermediate), so one element may be
# off by a few percent of the maximum; fp8 results must also be within NORM_TOLERANCE in norm.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float8_e4m3fn: (6e-2, 6e-2),
}
NORM_TOLERANCE = {torch.float8_e4m3fn: 4e-2}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for results computed in ``dtype``."""
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype, scale: float | None = None):
    """``torch.testing.assert_close`` with the project's per-dtype tolerance.

    ``atol`` is relative to ``scale`` (default: the largest magnitude in ``expected``), so a
    layer whose outputs are around 0.01 and one whose outputs are around 10 are held to the same
    relative standard.
    """
    atol, rtol = tolerance(dtype)
    ref = expected.float().cpu()
    if scale is None:
        scale = float(ref.abs().max()) if ref.numel() else 1.0
    got = actual.float().cpu()
    torch.testing.assert_close(got, ref, atol=atol * max(scale, 1e-6), rtol=rtol)
    if dtype in NORM_TOLERANCE and ref.numel():
        rel = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
        assert rel <= NORM_TOLERANCE[dtype], f"relative error in norm {rel:.3g} > {NORM_TOLERANCE[dtype]} ({dtype})"


@dataclass
class Raised:
    """What :func:`expect_raises` caught (``.error`` is the exception)."""

    error: BaseException | None = None

    @property
    def message(self) -> str:
        return str(self.error)


@contextlib.contextmanager
def expect_raises(kind: type[BaseException] | tuple[type[BaseException], ...], match: str | None = None):
    """Assert that the block raises ``kind`` (and that its message matches ``match``).

    Example::

        with expect_raises(moekit.errors.WorkspaceShapeError, match="bug 1") as caught:
            kernel(hidden, w1, w2, weights, ids)
        print(caught.message)
    """
    caught = Raised()
    try:
        yield caught
    except kind as e:  # noqa: B902
        caught.error = e
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"raised {type(e).__name__}, but {match!r} is not in: {e}") from e
        return
    names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    raise AssertionError(f"expected {names} to be raised, but the block finished normally")
