"""A ModularKernel whose calls replay a CUDA graph: the eager call without the host's cost.

An eager forward spends most of its time on the host at small M: moekit's checks and plan,
then five or six Triton launches of about 20 µs each (Triton 3.6's launcher), so a forward that
takes 30 µs on the GPU costs 430-810 µs of host time on the lent H200 machines. A CUDA graph
replays the same launches for a few µs. :class:`GraphedKernel` captures one graph per input
signature (shapes, dtypes, strides, device, the weights' addresses and the options) on the first
call with it, and replays it afterwards::

    kernel = GraphedKernel(moekit.ModularKernel(NoEPPrepareFinalize(), HopperTritonExperts()))
    out = kernel(hidden, w1, w2, topk_weights, topk_ids)    # first call: warm up, capture, replay
    out = kernel(hidden2, w1, w2, topk_weights2, topk_ids2)  # same signature: copy in, replay

Per replay: the three per-token inputs are copied into the graph's own buffers, the graph runs,
and its output is cloned (so a result stays valid after the next call). Everything else is
baked into the graph by address: the weights (and scales, map, a2_scale) must stay where they
are; changing their values in place is fine, a new tensor is a new signature. The first call
with a signature is checked in full by ``ModularKernel``; a later call with the same signature
skips the checks of shapes, dtypes and strides (already accepted), but reads the values of an
``expert_map`` and an ``a2_scale`` again (a small read-back each; not for a map passed as
``moekit.owned_placement`` or a scale made by ``moekit.owned_scale``): the caller may have
written them since, and a replay runs no check of its own (ids are not range-checked on the GPU
in either path).

Use it where the host is the limit (decode-sized M). Once the GPU is the limit it only adds the
input and output copies (at M=16384 one H200 run even measured it slower than the plain call).

Falls back to the plain forward, with the reason in ``last_mode``: under the interpreter (no
CUDA graphs), for collective prepare/finalize stages (they talk to other ranks), inside a CUDA
graph capture of the caller's (the plain forward is then captured into it), and for a signature
whose capture failed (kept, so it is not retried). Calls take turns on a lock and on
the stream: a call waits for the previous replay's output copy, so two threads or streams never
share the graph's buffers at once.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from moekit.device import interpreting
from moekit.errors import InvalidInputError
from moekit.modular_kernel import ModularKernel
from moekit.validate import check_map_values, check_positive_int, check_scale_values
from moekit.workspace import WorkspacePool

_OPTIONS = ("expert_map", "global_num_experts", "w1_scale", "w2_scale", "a2_scale")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # hidden, topk_weights, topk_ids
    output: torch.Tensor
    runner: ModularKernel  # a copy of the kernel with its own workspace pool, which the graph
    # reads and writes by address: a shared pool could free or regrow it under the graph


def _tensor_key(t: torch.Tensor | None, *, by_address: bool):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return ("value", t)
    key = (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
    return key + (t.data_ptr(),) if by_address else key


class GraphedKernel:
    """Replay a CUDA graph of ``kernel``'s forward per input signature (see the module docstring).

    Args:
        kernel: the :class:`ModularKernel` to capture (its own checks run on every first call).
        max_graphs: signatures kept; the least recently used graph is dropped past this.

    Attributes:
        last_mode: what the last call did: ``"captured"``, ``"replayed"`` or ``"eager: <why>"``.
    """

    def __init__(self, kernel: ModularKernel, *, max_graphs: int = 8):
        if not isinstance(kernel, ModularKernel):
            raise InvalidInputError(f"GraphedKernel wraps a moekit.ModularKernel, got {type(kernel).__name__}")
        self.kernel = kernel
        self.max_graphs = check_positive_int(max_graphs, "max_graphs")
        self.last_mode = "none"
        self._graphs: OrderedDict = OrderedDict()
        self._failed: dict = {}
        self._lock = threading.Lock()
        self._done: torch.cuda.Event | None = None

    def __repr__(self) -> str:
        return f"GraphedKernel({self.kernel!r}, graphs={len(self._graphs)}, max_graphs={self.max_graphs})"

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (and the memory its buffers hold)."""
        with self._lock:
            self._graphs.clear()
            self._failed.clear()

    def forward(self, hidden, w1, w2, topk_weights, topk_ids, **options) -> torch.Tensor:
        """As :meth:`ModularKernel.forward` (same arguments, same result), replayed from a graph."""
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise InvalidInputError(f"unknown options {sorted(unknown)}; ModularKernel.forward takes {list(_OPTIONS)}")
        why = self._eager_reason(hidden)
        if why is not None:
            self.last_mode = f"eager: {why}"
            return self.kernel.forward(hidden, w1, w2, topk_weights, topk_ids, **options)
        key = (
            tuple(_tensor_key(t, by_address=False) for t in (hidden, topk_weights, topk_ids)),
            tuple(_tensor_key(t, by_address=True) for t in (w1, w2)),
            tuple((name, _tensor_key(options.get(name), by_address=True)) for name in _OPTIONS),
        )
        with self._lock:
            if key in self._failed:
                self.last_mode = f"eager: capture failed before ({self._failed[key]})"
                return self.kernel.forward(hidden, w1, w2, topk_weights, topk_ids, **options)
            stream = torch.cuda.current_stream(hidden.device)
            if self._done is not None:
                stream.wait_event(self._done)  # the previous call's output copy has read the buffers
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._capture(key, hidden, w1, w2, topk_weights, topk_ids, options)
                if entry is None:
                    return self.kernel.forward(hidden, w1, w2, topk_weights, topk_ids, **options)
                self.last_mode = "captured"
            else:
                self._graphs.move_to_end(key)
                self.last_mode = "replayed"
            if isinstance(options.get("expert_map"), torch.Tensor):  # read by address: read the values again
                check_map_values(options["expert_map"], w1.shape[0])  # (an owned placement's were checked once)
            if options.get("a2_scale") is not None:
                check_scale_values(options["a2_scale"], "a2_scale")
            for static, given in zip(entry.inputs, (hidden, topk_weights, topk_ids), strict=True):
                static.copy_(given)
            entry.graph.replay()
            out = entry.output.clone()
            self._done = torch.cuda.Event()
            self._done.record(stream)
            return out

    __call__ = forward

    def _eager_reason(self, hidden) -> str | None:
        if interpreting() or not isinstance(hidden, torch.Tensor) or hidden.device.type != "cuda":
            return "no CUDA device (CUDA graphs need one)"
        if self.kernel.prepare_finalize.collective:
            return "a collective prepare/finalize exchanges with other ranks"
        if torch.cuda.is_current_stream_capturing():
            return "inside a CUDA graph capture (the plain forward is captured into it)"
        return None

    def _capture(self, key, hidden, w1, w2, topk_weights, topk_ids, options) -> _Graph | None:
        # Full checks, Triton compiles and workspace growth happen in these eager runs, outside
        # the capture; a bad argument raises here, with nothing cached.
        inputs = tuple(t.clone() for t in (hidden, topk_weights, topk_ids))
        runner = copy.copy(self.kernel)
        runner.pool = WorkspacePool(hidden.device)
        side = torch.cuda.Stream(hidden.device)
        side.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                runner.forward(inputs[0], w1, w2, inputs[1], inputs[2], **options)
        torch.cuda.current_stream(hidden.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                output = runner.forward(inputs[0], w1, w2, inputs[1], inputs[2], **options)
        except Exception as exc:  # a capture that breaks (a host sync, say) leaves the plain path
            torch.cuda.synchronize(hidden.device)
            self._failed[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
            self.last_mode = f"eager: capture failed ({self._failed[key]})"
            return None
        entry = _Graph(graph, inputs, output, runner)
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry
