"""Ways for a check to see *how* code ran, not only what it returned.

- :func:`count_loads`: how many elements Triton kernels loaded from a given tensor, counted
  inside Triton's interpreter (every ``tl.load`` lane whose mask is true and whose address lies
  in the tensor). A one-pass count reads each id once; a per-expert scan reads it E times.
- :func:`shares_memory`: whether a chunk is a view of the batch (slicing allocates nothing).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from moekit.device import interpreting

_LOCK = threading.Lock()


@dataclass
class LoadCount:
    """Elements loaded from each watched tensor (by the name it was watched under)."""

    loaded: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> int:
        return self.loaded[name]


@contextlib.contextmanager
def count_loads(**tensors: torch.Tensor | None):
    """Count the elements that interpreted Triton kernels load from each of ``tensors`` inside
    the block (None entries are skipped)::

        with count_loads(ids=topk_ids) as loads:
            kernel[grid](topk_ids, ...)
        loads["ids"]           # lanes that read an id

    Only under Triton's interpreter (the CPU); on a GPU the loads cannot be seen, and the block
    raises RuntimeError.
    """
    if not interpreting():
        raise RuntimeError("count_loads needs Triton's interpreter (a CPU run of moekit)")
    from triton.runtime import interpreter

    watched = {n: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size())
               for n, t in tensors.items() if t is not None and t.numel()}  # fmt: skip
    result = LoadCount({n: 0 for n in tensors})
    builder = interpreter.InterpreterBuilder

    def tally(ptrs, mask) -> None:
        addr = np.asarray(ptrs.data).astype(np.uint64).ravel()
        live = np.broadcast_to(np.asarray(mask.data).astype(bool), np.shape(ptrs.data)).ravel()
        for name, (lo, hi, _) in watched.items():
            result.loaded[name] += int((live & (addr >= lo) & (addr < hi)).sum())

    masked = builder.create_masked_load  # (the interpreter's unmasked load calls it with an all-true mask)

    def counted(self, ptrs, mask, other, cache_policy, is_volatile):
        tally(ptrs, mask)
        return masked(self, ptrs, mask, other, cache_policy, is_volatile)

    with _LOCK:  # one counter at a time: the patch is process-wide
        builder.create_masked_load = counted
        try:
            yield result
        finally:
            builder.create_masked_load = masked


def shares_memory(view: torch.Tensor, base: torch.Tensor) -> bool:
    """True when ``view`` lives inside ``base``'s storage (a slice, not a copy)."""
    if view.numel() == 0 or base.numel() == 0:
        return True  # an empty chunk allocates nothing either way
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


__all__ = ["LoadCount", "count_loads", "shares_memory"]
