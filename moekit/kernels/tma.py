"""Host-side TMA descriptors (Hopper's tensor-memory accelerator) for the GEMM kernels.

A descriptor is built on the host (``triton.tools.tensor_descriptor.TensorDescriptor``), so no
device-side allocator (``triton.set_allocator``) is needed. TMA reads a 2-D tensor in boxes; it
needs a unit last stride, rows of a multiple of 16 bytes and a 16-byte aligned base. Reads past
the tensor's edge come back as zeros.
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def tma_descriptor(t: torch.Tensor, box: list[int]) -> TensorDescriptor | None:
    """A descriptor of the 2-D ``t`` read in ``box`` tiles, or None where TMA cannot read it."""
    if t.dim() != 2 or t.numel() == 0 or t.stride(1) != 1:
        return None
    if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], box)


def weight_descriptor(w: torch.Tensor, box: list[int]) -> TensorDescriptor | None:
    """``w [E, N, K]`` as ``[E * N, K]`` (each expert's rows follow the last's), or None."""
    if not w.is_contiguous() or w.dim() != 3:
        return None
    E, N, K = w.shape
    return tma_descriptor(w.view(E * N, K), box)


def gate_up_descriptor(w: torch.Tensor, box: list[int]) -> TensorDescriptor | None:
    """``w [E, 2N, K]`` (gate rows, then up rows) as ``[E, N, 2, K]``: a box's rows alternate gate, up."""
    if not w.is_contiguous() or w.dim() != 3 or w.numel() == 0:
        return None
    E, N2, K = w.shape
    if (K * w.element_size()) % 16 or w.data_ptr() % 16:
        return None
    return TensorDescriptor(w, [E, N2 // 2, 2, K], [N2 * K, K, N2 // 2 * K, 1], box)
