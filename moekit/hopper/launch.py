"""Launch a compiled Triton kernel again without Triton's per-call argument binding.

``fn[grid](*args, **constexprs)`` binds every argument, specializes it (dtype, 16-byte
alignment, ``== 1`` and ``% 16`` of ints), builds a cache key and looks the compiled variant up,
on every call. On the lent H200's host (2026-12-01, Triton 3.6, ``benchmarks/research/gpu_launch_cost.py``)
that took 12.5 µs for the 8-argument weighted sum and 29 µs for the 53-argument grouped GEMM,
of which the compiled kernel's own launcher took 5.2 and 7.3 µs.

A :class:`LeanLauncher` keeps, per *variant key*, the compiled kernel that the first plain launch
of that key returned, and later launches it directly::

    launcher = LeanLauncher(_my_kernel)
    launcher(grid, (x, y, n), key=(x.dtype, x.data_ptr() % 16 == 0, n == 1),
             constexprs=lambda: dict(BLOCK=128, num_warps=4))

The key is the caller's promise: two launches with the same key must select the same compiled
variant (same constexprs and options, same dtypes, alignments and integer specializations of
the runtime arguments). Each kernel file builds its key next to its launch, from what it knows
varies. :func:`verifying` checks that promise: inside it, every direct launch also asks Triton's
own binder which variant it would pick and raises :class:`LaunchKeyError` if that is another one
(the GPU tests run the layer inside it).

The plain path runs instead under the interpreter, for Triton versions whose launch convention
was not read (outside 3.6-3.9), while a launch hook is installed (a profiler), and for kernels
whose compile-time parameters are not all last. Variants are kept per launcher (one per jit
function), behind a lock; they hold no tensors. :func:`kept_descriptor` keeps the TMA descriptors
such launches read, by their contents, for the same reason (in a plain dict: two threads may both
build one, and either is right).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from moekit.device import interpreting
from moekit.hopper import pdl

_VERIFY = contextvars.ContextVar("moekit_verify_launches", default=False)
_RUNTIME = triton.knobs.runtime  # launch_enter_hook: a HookChain in 3.6-3.9, empty unless a profiler listens
_MAX_KEYS = 4096  # kept variants per launcher, and kept descriptors


class LaunchKeyError(AssertionError):
    """A lean launch's key selected another compiled variant than Triton's binder would."""


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (asked once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def lean_supported() -> bool:
    """Whether direct launches are used at all here (compiled Triton of a known convention)."""
    version = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])  # "3.6.0+git1": (3, 6)
    # The calling convention of CompiledKernel.run used below reads the same in the sources of
    # Triton 3.6 (what the H200 runs, where it is tested) and 3.9 (the pin of the CPU suite).
    return not interpreting() and (3, 6) <= version <= (3, 9)


@contextlib.contextmanager
def verifying():
    """Cross-check every direct launch against Triton's binder inside this block (tests)."""
    token = _VERIFY.set(True)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def launch_stream(device: torch.device | None = None) -> tuple[int, int] | None:
    """``(device index, raw stream)`` of the current CUDA stream, or None under the interpreter.

    Query it once per forward and hand it to the launches: the query itself costs about a
    microsecond on the lent host (``torch.cuda.current_stream()`` costs 4.6).
    """
    if interpreting():
        return None
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return index, torch._C._cuda_getCurrentRawStream(index)


@dataclass(frozen=True)
class _Variant:
    compiled: object  # triton.compiler.CompiledKernel
    tail: tuple  # the compile-time arguments, in signature order
    device: int


class LeanLauncher:
    """The launches of one ``@triton.jit`` function (see the module docstring)."""

    def __init__(self, fn, *, pdl: bool = False):
        self.fn = fn
        self.pdl = pdl  # fn takes a PDL constexpr and starts with pdl_begin(PDL) (moekit.hopper.pdl)
        self._variants: dict = {}
        self._lock = threading.Lock()
        self._direct = lean_supported() and hasattr(fn, "params")  # the interpreter's functions have none
        if not self._direct:
            return
        flags = [p.is_constexpr for p in fn.params]
        first = flags.index(True) if True in flags else len(flags)
        self._tail_params = fn.params[first:]  # runtime arguments come first, compile-time ones after
        self._direct = all(flags[first:])

    def __repr__(self) -> str:
        return f"LeanLauncher({self.fn.__name__}, variants={len(self._variants)})"

    def __call__(
        self, grid: tuple, args: tuple, *, key, constexprs: Callable[[], dict], stream: tuple[int, int] | None = None
    ) -> None:
        """Launch ``fn[grid](*args, **constexprs())``; ``args`` are the runtime arguments in order, ``grid``
        has one or two dimensions."""
        if self.pdl:
            index = stream[0] if stream is not None else None if interpreting() else torch.cuda.current_device()
            on = pdl.active(index)
            key, constexprs = (key, on), _with_pdl(constexprs, on)
        variant = self._variants.get(key)
        if variant is None or _RUNTIME.launch_enter_hook.calls:  # a profiler's hook: Triton's own path
            self._plain(grid, args, key, constexprs())
            return
        device, raw = stream if stream is not None else launch_stream()
        if device != variant.device:
            self._plain(grid, args, key, constexprs())
            return
        if _VERIFY.get():
            self._verify(variant, args, constexprs())
        c = variant.compiled
        grid_y = grid[1] if len(grid) > 1 else 1
        c.run(grid[0], grid_y, 1, raw, c.function, c.packed_metadata, None, None, None, *args, *variant.tail)

    def _plain(self, grid, args, key, consts: dict) -> None:
        try:
            compiled = self.fn[grid](*args, **consts)
        except TypeError as error:  # the interpreter of Triton < 3.7 with numpy >= 2.4 (moekit.device)
            from moekit.device import INTERPRETER_ADVICE

            if INTERPRETER_ADVICE and "0-dimensional arrays" in str(error):
                from moekit.errors import BackendUnavailableError

                raise BackendUnavailableError(f"{self.fn.__name__}: {INTERPRETER_ADVICE}") from error
            raise
        if not self._direct or compiled is None or _RUNTIME.launch_enter_hook.calls:  # (a profiler's hook)
            return
        tail = tuple(consts.get(p.name, p.default) for p in self._tail_params)
        with self._lock:
            if len(self._variants) >= _MAX_KEYS:  # keys that follow M: forget them all now and then
                self._variants.clear()
            self._variants.setdefault(key, _Variant(compiled, tail, torch.cuda.current_device()))

    def _verify(self, variant: _Variant, args: tuple, consts: dict) -> None:
        from triton.runtime.driver import driver
        from triton.runtime.jit import compute_cache_key

        fn = self.fn
        kernel_cache, key_cache, _, _, binder = fn.device_caches[driver.active.get_current_device()]
        options = dict(consts)
        options["debug"] = options.get("debug", fn.debug) or triton.knobs.runtime.debug
        options["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
        _, specialization, opts = binder(*args, **options)
        chosen = kernel_cache.get(compute_cache_key(key_cache, specialization, opts))
        if chosen is not variant.compiled:
            raise LaunchKeyError(
                f"{fn.__name__}: the launch key selected a variant compiled for other arguments than these "
                f"(Triton's binder picks {'an uncompiled one' if chosen is None else 'another'}); the key must "
                "name every dtype, alignment and integer specialization that changes between launches"
            )


def _with_pdl(constexprs: Callable[[], dict], on: bool) -> Callable[[], dict]:
    return lambda: dict(constexprs(), PDL=on, launch_pdl=True) if on else dict(constexprs(), PDL=False)


def int_spec(value: int) -> int:
    """How Triton specializes an int argument: 1 for the value 1, 16 for multiples of 16, 0 else
    (plus 64 when it needs 64 bits)."""
    return (1 if value == 1 else 16 if value % 16 == 0 else 0) + (64 if not -(2**31) <= value < 2**31 else 0)


def launch_key(args: tuple, consts: dict) -> tuple:
    """The variant key of a launch whose runtime arguments are tensors, None, ints, floats or bools:
    each tensor's dtype and 16-byte alignment, each int's :func:`int_spec`, and the compile-time
    arguments (what Triton's binder specializes on, and a little more: sizes it does not specialize
    only split the kept variants further)."""
    return tuple(_arg_key(arg) for arg in args), tuple(consts.items())


def _arg_key(arg):
    kind = type(arg)
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16
    if kind is int:
        return int_spec(arg)
    return arg if arg is None or kind is bool else kind


@functools.cache  # one LeanLauncher per book kernel the wing relaunches (two threads may race: one is kept)
def _relauncher(kernel) -> LeanLauncher:
    return LeanLauncher(kernel)


def run_lean(launch, *, stream: tuple[int, int] | None = None) -> None:
    """Run a :class:`moekit.types.KernelLaunch` that a book launcher worked out, without Triton's
    per-call binding after its first launch (the same kernel, grid and arguments)."""
    consts = launch.consts
    lean = _relauncher(launch.kernel)
    lean(launch.grid, launch.args, key=launch_key(launch.args, consts), constexprs=lambda: consts, stream=stream)


class _Address(NamedTuple):
    """A TMA descriptor's base as a compiled launch reads it: an address and a dtype, no tensor."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


_DESCRIPTORS: dict = {}  # (builder, device, address, dtype, shape, strides, *box) -> descriptor


def kept_descriptor(build: Callable, t: torch.Tensor, box: list[int]):
    """``build(t, box)`` (a :mod:`moekit.kernels.tma` builder), built once per device, address, dtype,
    shape, strides and box of ``t``.

    A descriptor is a function of these alone, so a kept one is what a fresh build would give, also for
    another tensor at the same address; its base is an :class:`_Address`, which keeps no memory alive.
    Building one took 2.4-4.1 µs of host time on a CPU where the lookup takes 1.0 (two to four per chunk).
    Under the interpreter, which reads through the base tensor, every call builds afresh; so does a
    tensor TMA cannot read (None, at the cost of a few checks). One descriptor serves every launch and
    thread: Triton's launcher reads a descriptor and never writes it (read in 3.6 and 3.9).
    """
    if interpreting():
        return build(t, box)
    key = (build, t.get_device(), t.data_ptr(), t.dtype, t.shape, t.stride(), *box)
    return memo(_DESCRIPTORS, key, lambda: _addressed(build(t, box)), limit=_MAX_KEYS)


def _addressed(descriptor: TensorDescriptor | None) -> TensorDescriptor | None:
    return descriptor and replace(descriptor, base=_Address(descriptor.base.data_ptr(), descriptor.base.dtype))


def memo(cache: dict, key, make: Callable, *, limit: int = 1024):
    """``cache[key]``, made by ``make()`` where it is missing or None; the cache forgets every key once it
    holds ``limit`` (keys that follow M or addresses come and go)."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= limit:
            cache.clear()
        value = cache[key] = make()
    return value
