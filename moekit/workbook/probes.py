"""Ways for a check to see *how* code ran, not only what it returned.

- :func:`watch_memory`: every memory operation that interpreted Triton kernels make, per program
  and per watched tensor (loads, stores, atomics, and lanes that touch no watched tensor at
  all), the element operations each program computes (its work), every ``tl.histogram``
  value outside its bins, and each program's ``tl.debug_barrier()`` calls. Triton's interpreter
  runs the programs of a grid one after another, and each op of a program on all its lanes at
  once, so a race between two programs, or between two threads of one program, can never show
  up in the results; it shows up in the addresses and their order.
- :func:`is_triton_kernel`: whether an object is a ``@triton.jit`` function at all.
- :func:`watch_inputs`: which of a call's inputs the call changed.
- :func:`shares_memory` and :func:`is_view_of`: whether a chunk is a view of the batch.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import torch

from moekit.device import interpreting

_LOCK = threading.Lock()
READ, WRITE, ATOMIC = "read", "write", "atomic"  # an atomic reads and writes, as one indivisible step


@dataclass(frozen=True)
class Race:
    """A non-atomic write to one element that another program also touched."""

    tensor: str
    index: int  # element index inside the watched tensor
    programs: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.tensor}[{self.index}] (programs {', '.join(map(str, self.programs))})"


@dataclass
class MemoryOps:
    """What interpreted kernels did inside a :func:`watch_memory` block.

    ``lanes[(tensor, kind)]`` lists ``(program, element indices, step, phase)`` of each
    operation's live lanes (``kind`` is READ, WRITE or ATOMIC; ``step`` orders all operations;
    ``phase`` counts the program's barriers before it); ``outside[kind]`` counts live lanes whose address lies
    in no watched tensor; ``work[program]`` counts the elements that arithmetic, comparisons,
    selects, casts, dots and histograms produced; ``histogram_misses`` holds values given to
    ``tl.histogram`` outside ``[0, bins)`` (a GPU keeps only their low bits); ``launches``
    names each interpreted kernel launched (a host function that does the work launches none).
    """

    lanes: dict = field(default_factory=lambda: defaultdict(list))
    outside: dict = field(default_factory=lambda: defaultdict(int))
    work: dict = field(default_factory=lambda: defaultdict(int))
    programs: set = field(default_factory=set)
    barriers: dict = field(default_factory=lambda: defaultdict(int))
    histogram_misses: list = field(default_factory=list)
    launches: list = field(default_factory=list)

    def _indices(self, name: str, kinds, program=None) -> np.ndarray:
        parts = [indices for k in kinds for p, indices, *_ in self.lanes[(name, k)] if program in (None, p)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def reads(self, name: str, program=None) -> int:
        """Elements of ``name`` read (loads and atomics: ``tl.atomic_add(p, 0)`` is a read too)."""
        return int(self._indices(name, (READ, ATOMIC), program).size)

    def writes(self, name: str, program=None) -> int:
        """Elements of ``name`` written (stores and atomics)."""
        return int(self._indices(name, (WRITE, ATOMIC), program).size)

    def read_set(self, name: str, program=None) -> set[int]:
        return set(self._indices(name, (READ, ATOMIC), program).tolist())

    def written(self, name: str, program=None) -> np.ndarray:
        """The distinct element indices of ``name`` written (by ``program``, or by any)."""
        return np.unique(self._indices(name, (WRITE, ATOMIC), program))

    def races(self, name: str) -> list[Race]:
        """Elements of ``name`` that one program wrote without an atomic while another program
        read, wrote or atomically updated them: on a GPU the programs run at once."""
        touched = defaultdict(set)  # element -> the programs that touched it
        for kind in (READ, WRITE, ATOMIC):
            for p, indices, *_ in self.lanes[(name, kind)]:
                for i in np.unique(indices).tolist():
                    touched[i].add(p)
        plain = np.unique(self._indices(name, (WRITE,))).tolist()
        return [Race(name, i, tuple(sorted(touched[i]))) for i in plain if len(touched[i]) > 1]

    def unordered(self) -> tuple[str, int, int] | None:
        """The first ``(tensor, program, element)`` that a program read after writing it, or
        wrote after reading it (loads, stores and atomics; atomics alone are ordered, and two
        stores are not compared), with no ``tl.debug_barrier()`` between; None when there is none."""
        seen = defaultdict(set)  # (tensor, program, barriers before, kind) -> elements
        for _, name, kind, p, indices, phase in sorted(
            (s, n, k, p, i, b) for (n, k), v in self.lanes.items() for p, i, s, b in v
        ):
            now = set(indices.tolist())
            clash = now & set().union(*(seen[(name, p, phase, k)] for k in (READ, WRITE, ATOMIC) if k != kind))
            if clash:
                return name, p, min(clash)
            seen[(name, p, phase, kind)] |= now
        return None

    @property
    def total_work(self) -> int:
        return sum(self.work.values())


def _program(builder) -> int:
    x, y, z = builder.grid_idx
    return x + builder.grid_dim[0] * (y + builder.grid_dim[1] * z)


@contextlib.contextmanager
def watch_memory(**tensors: torch.Tensor | None):
    """Record what interpreted Triton kernels do inside the block (None entries are skipped)::

        with watch_memory(ids=topk_ids, out=counts) as ops:
            kernel[grid](topk_ids, counts, ...)
        ops.reads("ids"), ops.races("out"), ops.outside, ops.work

    A lane outside every watched tensor is counted in ``ops.outside`` and not run (a stray
    store corrupts nothing; a stray load reads its ``other``), unless it is an atomic
    compare-and-swap. Only under Triton's interpreter (the CPU); on a GPU nothing can be seen,
    and the block raises RuntimeError. The patch is process-wide, so one block runs at a time.
    """
    if not interpreting():
        raise RuntimeError("watch_memory needs Triton's interpreter (a CPU run of moekit)")
    from triton.runtime import interpreter

    watched = {n: (t.data_ptr(), t.numel(), t.element_size()) for n, t in tensors.items() if t is not None}
    ops, steps = MemoryOps(), itertools.count()
    builder = interpreter.InterpreterBuilder
    state = threading.local()

    def record(self, kind, ptrs, mask):
        """Record one operation's live lanes; returns its mask without the stray lanes."""
        if getattr(state, "atomic", 0) and kind == WRITE:
            kind = ATOMIC  # an atomic store reaches the plain store underneath
        p = _program(self)
        ops.programs.add(p)
        addr = np.asarray(ptrs.data).astype(np.uint64).ravel()
        live = np.broadcast_to(True if mask is None else np.asarray(mask.data, bool), np.shape(ptrs.data)).ravel()
        inside, step = np.zeros(addr.shape, bool), next(steps)
        for name, (lo, numel, size) in watched.items():
            hit = live & (addr >= lo) & (addr < lo + numel * size)
            if hit.any():
                ops.lanes[(name, kind)].append((p, ((addr[hit] - lo) // size).astype(np.int64), step, ops.barriers[p]))
            inside |= hit
        stray = int(live.sum() - inside.sum())
        ops.outside[kind] += stray
        if mask is None or not stray:
            return mask
        return interpreter.TensorHandle(inside.reshape(np.shape(ptrs.data)), mask.dtype)  # stray lanes: not run

    def launch(self, *args, **kwargs):
        ops.launches.append((self.fn.__name__, self.grid))
        return launch_original(self, *args, **kwargs)

    def counting(fn):
        def wrapped(self, *args, **kwargs):
            result = fn(self, *args, **kwargs)
            ops.work[_program(self)] += int(np.size(getattr(result, "data", 0)))
            return result

        return wrapped

    def histogram(self, data, bins, mask=None):
        live = np.ones(np.shape(data.data), bool) if mask is None else np.asarray(mask.data, bool)
        values = np.asarray(data.data)[live]
        for v in values[(values < 0) | (values >= bins)][:4].tolist():
            ops.histogram_misses.append((_program(self), int(v), int(bins)))
        return originals["create_histogram"](self, data, bins, mask)

    def barrier(self):
        ops.barriers[_program(self)] += 1
        return originals["create_barrier"](self)

    def atomic_store(self, ptr, val, mask, sem, scope):
        state.atomic = getattr(state, "atomic", 0) + 1
        try:
            return originals["create_atomic_store"](self, ptr, val, mask, sem, scope)
        finally:
            state.atomic -= 1

    def memory(name, kind, ptr_at, mask_at):
        def wrapped(self, *args):
            mask = record(self, kind, args[ptr_at], None if mask_at is None else args[mask_at])
            if mask_at is not None:
                args = (*args[:mask_at], mask, *args[mask_at + 1 :])
            return originals[name](self, *args)

        return wrapped

    patches = {  # the argument positions of the interpreter's builder methods (Triton 3.6 to 3.9)
        "create_masked_load": memory("create_masked_load", READ, 0, 1),  # (ptrs, mask, other, ...)
        "create_masked_store": memory("create_masked_store", WRITE, 0, 2),  # (ptrs, value, mask, ...)
        "create_atomic_rmw": memory("create_atomic_rmw", ATOMIC, 1, 3),  # (op, ptr, val, mask, ...)
        "create_atomic_cas": memory("create_atomic_cas", ATOMIC, 0, None),  # (ptr, cmp, val, ...)
        "create_atomic_store": atomic_store,  # Triton 3.7 on: 3.6's interpreter has no atomic store
        "create_histogram": histogram,
        "create_barrier": barrier,
    }
    patches = {name: fn for name, fn in patches.items() if hasattr(builder, name)}
    for name in ("binary_op", "ternary_op", "unary_op", "cast_impl", "create_dot"):
        patches[name] = counting(getattr(builder, name))
    with _LOCK, contextlib.ExitStack() as patched:  # every patch is undone when the block ends
        originals = {name: getattr(builder, name) for name in patches}
        launch_original = interpreter.GridExecutor.__call__
        patched.enter_context(mock.patch.object(interpreter.GridExecutor, "__call__", launch))
        for name, fn in patches.items():
            patched.enter_context(mock.patch.object(builder, name, fn))
        yield ops


def is_triton_kernel(obj) -> bool:
    """True for a ``@triton.jit`` function: an interpreted one under the interpreter, else a
    :class:`triton.runtime.jit.JITFunction` (an object whose ``kernel[grid]`` runs host code is not)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return isinstance(obj, InterpretedFunction if interpreting() else JITFunction)


def _snapshot(value):
    if isinstance(value, torch.Tensor):  # bytes, so that fp8 and NaN compare too
        return value.dtype, tuple(value.shape), value.detach().flatten().view(torch.uint8).cpu().numpy().tobytes()
    return copy.deepcopy(value)


@contextlib.contextmanager
def watch_inputs(**inputs):
    """Yields a list that, after the block, names each of ``inputs`` (tensors, lists) whose
    values, shape or dtype the block changed::

        with watch_inputs(topk_ids=ids) as changed:
            fn(ids)
        assert not changed, f"fn wrote {changed}"
    """
    before = {name: _snapshot(v) for name, v in inputs.items()}
    changed: list[str] = []
    yield changed
    changed += [name for name, v in inputs.items() if _snapshot(v) != before[name]]


def shares_memory(view: torch.Tensor, base: torch.Tensor) -> bool:
    """True when ``view`` lives inside ``base``'s storage (a slice, not a copy)."""
    if view.numel() == 0 or base.numel() == 0:
        return True  # an empty chunk allocates nothing either way
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def is_view_of(view: torch.Tensor, base: torch.Tensor, start: int, end: int) -> bool:
    """True when ``view`` is rows ``[start, end)`` of ``base`` in place: same storage, offset,
    strides and dtype (an upcast, a ``.contiguous()`` of a strided slice or a clone is a copy)."""
    want = base[start:end]
    if (view.dtype, view.shape) != (base.dtype, want.shape):
        return False
    return view.numel() == 0 or (
        shares_memory(view, base) and (view.data_ptr(), view.stride()) == (want.data_ptr(), want.stride())
    )


__all__ = ["MemoryOps", "Race", "is_triton_kernel", "is_view_of", "shares_memory", "watch_inputs", "watch_memory"]
