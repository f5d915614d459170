"""A ModularKernel whose calls replay a CUDA graph: the eager call without the host's cost.

An eager forward spends most of its time on the host at small M: moekit's checks and plan,
then five or six Triton launches of about 20 µs each (Triton 3.6's launcher), so a forward that
takes 30 µs on the GPU costs 430-810 µs of host time on the lent H200 machines. A CUDA graph
replays the same launches for a few µs. :class:`GraphedKernel` captures one graph per input
signature (shapes, dtypes, strides, device, the weights' addresses and the options) on the first
call with it, and replays it afterwards::

    kernel = GraphedKernel(moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts()))
    out = kernel(hidden, w1, w2, topk_weights, topk_ids)    # first call: plain forward, then capture
    out = kernel(hidden2, w1, w2, topk_weights2, topk_ids2)  # same signature: copy in, replay

Per replay: the three per-token inputs are copied into the graph's own buffers (one Triton launch,
which also marks the rows past M empty), the graph runs, and its output is cloned (so a result
stays valid after the next call). Everything else is baked into the graph by address: the weights
(and scales, map, a2_scale) must stay where they are; changing their values in place is fine, a new
tensor is a new signature. The first call with a signature runs the plain forward, checked in full
by ``ModularKernel``; a later call with the same signature skips the checks of shapes, dtypes and
strides (already accepted), but reads the values of an ``expert_map`` and an ``a2_scale`` again (a
small read-back each; not for a map passed as ``moekit.owned_placement`` or a scale made by
``moekit.owned_scale``): the caller may have written them since, and a replay runs no check of its
own (ids are not range-checked on the GPU in either path).

With ``max_tokens`` set (``moekit.fused_moe`` sets 128), a call of M tokens replays the graph of
the next power of two, at most ``max_tokens``: its rows past M hold empty slots (id -1), which no
kernel computes, so M=5, 6, 7 and 8 share one graph and a decode loop whose batch shrinks never
recaptures; M past ``max_tokens`` runs the plain forward (the GPU is the limit there, and one H200
run measured a graph slower than the plain call at M=16384). A graph at 8 rows picks the tiles of
8 rows: results match the plain call within the dtype's tolerance, bit for bit when M is a power
of two.

Memory: the graphs of one device share one workspace pool and one CUDA graph memory pool (calls
take turns, so no two replays overlap); each adds its own input and output buffers. When a new
capture grows the workspace, the graphs made before it are dropped (they read the old buffers) and
recaptured on their next call. Once ``max_graphs`` graphs are kept a new signature runs the plain
forward rather than pushing one out: a model whose layers take turns would otherwise capture on
every call. :meth:`clear` drops them all.

Falls back to the plain forward, with the reason in ``last_mode``: under the interpreter (no
CUDA graphs), for collective prepare/finalize stages (they talk to other ranks), inside a CUDA
graph capture of the caller's (the plain forward is then captured into it), for a signature
whose capture failed (kept, so it is not retried), and as above. Calls take turns on a lock and
on the stream: a call on another stream waits for all the last stream had queued (the previous
replay and its output copy), so two threads or streams never share the graph's buffers at once.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from moekit.device import interpreting
from moekit.errors import InvalidInputError
from moekit.hopper.launch import LeanLauncher, launch_key
from moekit.kernels.host_math import next_power_of_2
from moekit.modular_kernel import ModularKernel
from moekit.validate import check_map_values, check_positive_int, check_scale_values
from moekit.workspace import WorkspacePool, pool_device

_OPTIONS = ("expert_map", "global_num_experts", "w1_scale", "w2_scale", "a2_scale")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # hidden, topk_weights, topk_ids
    output: torch.Tensor
    runner: ModularKernel  # the kernel on the device's shared workspace pool
    outputs: dict = field(default_factory=dict)  # M -> the output's first M rows


def _tensor_key(t: torch.Tensor | None, *, by_address: bool):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return ("value", t)
    key = (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
    return key + (t.data_ptr(),) if by_address else key


@triton.jit
def _copy_row(to, source, stride, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(to + cols, tl.load(source + cols * stride, mask=cols < n), mask=cols < n)


@triton.jit
def _copy_in_kernel(sources, targets, M, K, TOPK, strides, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """Row ``r`` of the graph's inputs: the caller's row r for r < M, an empty slot (ids -1) past it."""
    hidden, weights, ids = sources  # any strides
    hidden_to, weights_to, ids_to = targets  # contiguous
    hs0, hs1, ws0, ws1, is0, is1 = strides
    r = tl.program_id(0).to(tl.int64)
    if r < M:
        _copy_row(weights_to + r * TOPK, weights + r * ws0, ws1, TOPK, BLOCK_T)
        _copy_row(ids_to + r * TOPK, ids + r * is0, is1, TOPK, BLOCK_T)
        for k0 in range(0, K, BLOCK_K):
            _copy_row(hidden_to + r * K + k0, hidden + r * hs0 + k0 * hs1, hs1, K - k0, BLOCK_K)
    else:
        slots = tl.arange(0, BLOCK_T)
        tl.store(ids_to + r * TOPK + slots, tl.full([BLOCK_T], -1, ids_to.dtype.element_ty), mask=slots < TOPK)


_COPY_IN = LeanLauncher(_copy_in_kernel)


def _copy_in(inputs: tuple, hidden, topk_weights, topk_ids, *, stream: tuple[int, int] | None = None) -> None:
    """Copy the caller's ``hidden``, ``topk_weights`` and ``topk_ids`` (M rows, any strides) into a graph's
    contiguous ``inputs`` (its rows, >= M), and mark the rows past M empty (ids -1), in one launch. Unchecked:
    a replay's signature holds the sizes and dtypes (the plain forward checked them)."""
    (M, K), topk = hidden.shape, topk_ids.shape[1]
    sources, strides = (hidden, topk_weights, topk_ids), (*hidden.stride(), *topk_weights.stride(), *topk_ids.stride())
    consts = dict(BLOCK_K=min(next_power_of_2(K), 2048), BLOCK_T=next_power_of_2(topk), num_warps=4)
    key = launch_key((*sources, *inputs, M, K, topk, *strides), consts)
    grid = (inputs[0].shape[0],)  # the graph's rows
    _COPY_IN(grid, (sources, inputs, M, K, topk, strides), key=key, constexprs=lambda: consts, stream=stream)


def graph_rows(M: int, max_tokens: int | None) -> int | None:
    """The rows of the graph that serves M tokens: M itself without ``max_tokens``, else the
    next power of two up to ``max_tokens``; None past it (and for M=0): the plain forward.

    >>> [graph_rows(m, 128) for m in (1, 5, 8, 100, 129)]
    [1, 8, 8, 128, None]
    """
    if M == 0 or (max_tokens is not None and M > max_tokens):
        return None
    return M if max_tokens is None else min(1 << (M - 1).bit_length(), max_tokens)


class GraphedKernel:
    """Replay a CUDA graph of ``kernel``'s forward per input signature (see the module docstring).

    Args:
        kernel: the :class:`ModularKernel` to capture (its own checks run on every first call).
        max_graphs: graphs kept; a new signature past this runs the plain forward.
        max_tokens: None: one graph per M. An int: M rounds up to a power of two (at most this),
            and a larger M runs the plain forward.

    Attributes:
        last_mode: what the last call did: ``"captured"``, ``"replayed"`` or ``"eager: <why>"``.
    """

    def __init__(self, kernel: ModularKernel, *, max_graphs: int = 8, max_tokens: int | None = None):
        if not isinstance(kernel, ModularKernel):
            raise InvalidInputError(f"GraphedKernel wraps a moekit.ModularKernel, got {type(kernel).__name__}")
        self.kernel = kernel
        self.max_graphs = check_positive_int(max_graphs, "max_graphs")
        self.max_tokens = None if max_tokens is None else check_positive_int(max_tokens, "max_tokens")
        self.last_mode = "none"
        self._graphs: dict = {}  # the bucketed signature -> _Graph
        self._accepted: dict = {}  # a call's exact signature, once checked -> its _Graph
        self._failed: dict = {}
        # Per device, a copy of the kernel on its own workspace pool, which its graphs read by address
        # (the caller's pool could be freed or regrown under them); one CUDA graph memory pool for all.
        self._runners: dict = {}
        self._graph_pool = None
        self._lock = threading.Lock()
        self._raw = self._last = None  # the CUDA stream of the last replay, and its raw handle

    def __repr__(self) -> str:
        return f"GraphedKernel({self.kernel!r}, graphs={len(self._graphs)}, max_tokens={self.max_tokens})"

    def __getstate__(self) -> dict:  # graphs and their buffers are this process's: a copy starts without
        return {"kernel": self.kernel, "max_graphs": self.max_graphs, "max_tokens": self.max_tokens}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (and the memory its buffers hold)."""
        with self._lock:
            self._graphs.clear()
            self._accepted.clear()
            self._failed.clear()
            self._runners.clear()
            self._graph_pool = None  # its memory goes once no graph uses it

    def forward(self, hidden, w1, w2, topk_weights, topk_ids, **options) -> torch.Tensor:
        """As :meth:`ModularKernel.forward` (same arguments, same result), replayed from a graph."""
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise InvalidInputError(f"unknown options {sorted(unknown)}; ModularKernel.forward takes {list(_OPTIONS)}")
        signature = (
            tuple(_tensor_key(t, by_address=False) for t in (hidden, topk_weights, topk_ids)),
            tuple(_tensor_key(t, by_address=True) for t in (w1, w2)),
            tuple(_tensor_key(options.get(name), by_address=True) for name in _OPTIONS),
        )
        with self._lock:
            try:
                entry = self._accepted.get(signature)
            except TypeError:  # an unhashable argument: the plain forward names the mistake
                entry = None
            if entry is None or torch.cuda.is_current_stream_capturing():  # a caller's capture: the plain kernels
                return self._plain_then_capture(signature, hidden, w1, w2, topk_weights, topk_ids, options)
            self.last_mode = "replayed"
            if isinstance(options.get("expert_map"), torch.Tensor):  # read by address: read the values again
                check_map_values(options["expert_map"], w1.shape[0])  # (an owned placement's were checked once)
            if options.get("a2_scale") is not None:
                check_scale_values(options["a2_scale"], "a2_scale")
            return self._replay(entry, hidden, topk_weights, topk_ids)

    __call__ = forward

    def _replay(self, entry: _Graph, hidden, topk_weights, topk_ids) -> torch.Tensor:
        M = hidden.shape[0]
        output = entry.outputs.get(M)
        if output is None:
            output = entry.outputs[M] = entry.output[:M]
        device = entry.output.device.index
        raw = torch._C._cuda_getCurrentRawStream(device)  # 1 us; a Stream object costs 4
        if raw != self._raw:  # on one stream its order is the wait (an event recorded per call cost 10 us)
            current = torch.cuda.current_stream(hidden.device)
            if self._last is not None:  # another stream waits for the last one's replay and output copy
                current.wait_stream(self._last)
            self._raw, self._last = raw, current
        _copy_in(entry.inputs, hidden, topk_weights, topk_ids, stream=(device, raw))  # (three copy_ took 21 us)
        entry.graph.replay()
        return output.clone()

    def _eager_reason(self, hidden, rows) -> str | None:
        if interpreting() or not isinstance(hidden, torch.Tensor) or hidden.device.type != "cuda":
            return "no CUDA device (CUDA graphs need one)"
        if self.kernel.prepare_finalize.collective:
            return "a collective prepare/finalize exchanges with other ranks"
        if torch.cuda.is_current_stream_capturing():
            return "inside a CUDA graph capture (the plain forward is captured into it)"
        if rows is None:
            return "no tokens" if hidden.shape[0] == 0 else f"M={hidden.shape[0]} > max_tokens={self.max_tokens}"
        return None

    def _plain_then_capture(self, signature, hidden, w1, w2, topk_weights, topk_ids, options):
        """A signature seen first: the plain forward (every check, the result), then the graph it
        shares with its rows, captured now unless there is a reason not to. Returns the plain output."""
        out = self.kernel.forward(hidden, w1, w2, topk_weights, topk_ids, **options)
        rows = graph_rows(hidden.shape[0], self.max_tokens)
        why = self._eager_reason(hidden, rows)
        if why is None:
            per_token = tuple((tuple(t.shape[1:]), t.dtype) for t in (hidden, topk_weights, topk_ids))
            key = (rows, pool_device(hidden.device), per_token) + signature[1:]  # strides do not matter: copied in
            if key in self._failed:
                why = f"capture failed before ({self._failed[key]})"
            elif key not in self._graphs and len(self._graphs) >= self.max_graphs:
                why = f"max_graphs={self.max_graphs} graphs kept (clear() drops them)"
        self.last_mode = f"eager: {why or 'checked, the next call replays'}"
        if why is None:
            entry = self._graphs.get(key) or self._capture(key, rows, (hidden, w1, w2, topk_weights, topk_ids), options)
            if entry is not None:
                if len(self._accepted) > 64 * self.max_graphs:
                    self._accepted.clear()
                self._accepted[signature] = entry
        return out

    def _capture(self, key, rows, args, options) -> _Graph | None:
        # Triton compiles and workspace growth happen in these eager runs, outside the capture.
        hidden, w1, w2, topk_weights, topk_ids = args
        device = pool_device(hidden.device)
        runner = self._runners.get(device)
        if runner is None:
            runner = self._runners[device] = copy.copy(self.kernel)
            runner.pool = WorkspacePool(device)
            self._graph_pool = self._graph_pool or torch.cuda.graph_pool_handle()
        inputs = tuple(
            torch.full((rows, *t.shape[1:]), -1 if t is topk_ids else 0, dtype=t.dtype, device=device)
            for t in (hidden, topk_weights, topk_ids)
        )
        for static, given in zip(inputs, (hidden, topk_weights, topk_ids), strict=True):
            static[: given.shape[0]].copy_(given)
        held, side = runner.pool.held_bytes, torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        if self._last is not None:  # a replay on another stream may still use the shared workspace
            side.wait_stream(self._last)
        with torch.cuda.stream(side):
            for _ in range(2):
                runner.forward(inputs[0], w1, w2, inputs[1], inputs[2], **options)
        torch.cuda.current_stream(device).wait_stream(side)
        if runner.pool.held_bytes != held:  # the workspace grew: the graphs before read the old one
            self._graphs = {k: g for k, g in self._graphs.items() if g.runner is not runner}
            self._accepted = {s: g for s, g in self._accepted.items() if g.runner is not runner}
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool):
                output = runner.forward(inputs[0], w1, w2, inputs[1], inputs[2], **options)
        except Exception as exc:  # a capture that breaks (a host sync, say) leaves the plain path
            torch.cuda.synchronize(device)
            self._failed[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
            self.last_mode = f"eager: capture failed ({self._failed[key]})"
            return None
        self.last_mode = "captured"
        entry = self._graphs[key] = _Graph(graph, inputs, output, runner)
        return entry
