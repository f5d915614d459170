"""``launch``: run a function on fresh processes of one host, joined over loopback; their results or the first failure.

:mod:`moekit.distributed` says what ``launch`` opens (loopback only) and how a failing rank reaches the caller.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import pkgutil
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.distributed.collectives import to_cpu
from moekit.distributed.process_group import NCCL_SAFETY_ENV, check_backend, join_group
from moekit.errors import DistributedError, InvalidInputError

_GRACE_S = 3.0  # after one rank fails, how long to wait for the others' reports before killing them


@dataclass(frozen=True)
class _FnRef:
    """``fn`` by name, plus its file: a module that pytest (importlib mode) or a script loaded
    from a path is not importable by name in a fresh process, but can be loaded from the file."""

    module: str
    qualname: str
    file: str | None

    @classmethod
    def of(cls, fn) -> _FnRef:
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module is None or "<" in qualname:
            raise InvalidInputError(
                f"launch needs a module-level function (spawned ranks import it by name), got {fn!r}"
            )
        file = getattr(sys.modules.get(module), "__file__", None)
        if module == "__main__" and file is None:
            raise InvalidInputError(
                f"{qualname} was defined in a notebook or REPL, where spawned ranks cannot find it; "
                "define it in a module (as moekit.ep.run_rank is)"
            )
        return cls(module, qualname, file)

    def resolve(self):
        name = f"{self.module}:{self.qualname}"
        try:
            return pkgutil.resolve_name(name)
        except ImportError:
            if self.file is None:
                raise
        spec = importlib.util.spec_from_file_location(self.module, self.file)
        sys.modules[self.module] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[self.module])
        return pkgutil.resolve_name(name)


def _child(rank, world_size, port, backend, ref: _FnRef, args, timeout_s, results) -> None:
    # Results travel as plain-pickled bytes: torch's shared-memory tensor passing would break
    # when this process exits before the parent reads.
    try:
        fn = ref.resolve()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        join_group(backend, rank, world_size, timeout_s, store=store)
        value = to_cpu(fn(rank, world_size, *args))
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: B036  (the parent must hear about every failure, even SystemExit)
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any], world_size: int, *, backend: str | None = None, args: tuple = (), timeout_s: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return their results.

    Args:
        fn: an importable function (module level); its return value must pickle.
        world_size: number of ranks.
        backend: ``"gloo"``, ``"nccl"`` or None (auto, see :mod:`moekit.distributed`). With gloo on a
            machine that has a GPU, the ranks run on the CPU (``MOEKIT_DEVICE=cpu``).
        args: extra positional arguments, pickled to every rank.
        timeout_s: limit for the whole run, and for every collective inside it.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``, tensors on the CPU.

    Raises:
        InvalidInputError: bad ``world_size``, ``backend`` or ``timeout_s``; ``fn`` not importable by
            name; ``args`` not a tuple, or not picklable (then no rank was started).
        DistributedError: a rank raised (the message holds that rank's traceback; when several
            failed, the first to report leads), died, or the run exceeded ``timeout_s``.
    """
    backend = check_backend(backend, world_size, timeout_s)
    if not isinstance(args, tuple):
        raise InvalidInputError(f"args must be a tuple (fn(rank, world_size, *args)), got {type(args).__name__}")
    ref = _FnRef.of(fn)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = _loopback_store(timeout_s)  # the ranks' rendezvous, alive until launch returns
    # With gloo, GLOO_SOCKET_IFNAME: else gloo binds what the hostname resolves to.
    env = dict(NCCL_SAFETY_ENV) if backend == "nccl" else {"GLOO_SOCKET_IFNAME": _loopback_interface()}
    if backend == "gloo" and torch.cuda.is_available():
        env["MOEKIT_DEVICE"] = "cpu"
    with mock.patch.dict(os.environ, env):  # spawned children copy the environment at start
        shared = (world_size, store.port, backend, ref, args, timeout_s, results)  # _child's arguments after the rank
        procs = [ctx.Process(target=_child, daemon=True, args=(r, *shared)) for r in range(world_size)]
        for p in procs:
            _start(p)
    try:
        return _collect(procs, results, world_size, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _start(process) -> None:
    """``process.start()``; arguments that do not pickle become InvalidInputError. A spawned process
    pickles its arguments before the child exists, so a failure here started nothing."""
    try:
        process.start()
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise InvalidInputError(f"launch's args must pickle (every rank gets a copy): {type(e).__name__}: {e}") from e


def _loopback_interface() -> str:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), for GLOO_SOCKET_IFNAME."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise DistributedError(f"found no loopback interface (lo or lo0) among {names}; gloo would listen beyond it")


def _loopback_store(timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, listening on 127.0.0.1 only, on a port the OS picks (no race).

    Given a port alone, TCPStore listens on every interface; handed a socket already bound to
    the loopback address, it listens there, and owns (and finally closes) that socket."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    port = listener.getsockname()[1]
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=listener.fileno(), timeout=timeout
    )
    listener.detach()  # the store closes the descriptor now
    return store


def _collect(procs, results, world_size: int, timeout_s: float) -> list[Any]:
    done: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) + len(failures) < world_size:
        wait = deadline - time.monotonic()  # after a failure the deadline shrinks to its grace
        if wait <= 0:
            break
        try:
            rank, ok, payload = results.get(timeout=min(wait, 0.5))
        except queue_mod.Empty:
            now = time.monotonic()
            reported = set(done) | {r for r, _ in failures}
            for r, p in enumerate(procs):
                # Exited without a report (with code 0 too: os._exit(0) in fn): a failure after a second,
                # since a report put just before exiting may still be in flight.
                if r not in reported and p.exitcode is not None and now - dead_since.setdefault(r, now) > 1.0:
                    failures.append((r, f"rank {r} exited with code {p.exitcode} without reporting a result"))
        else:
            if ok:
                done[rank] = pickle.loads(payload)
            else:
                failures.append((rank, payload))
        if failures:  # the others get a bounded grace, counted from the first failure
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    if failures:
        rank, text = failures[0]
        others = sorted(r for r, _ in failures[1:])
        also = f" (ranks {others} failed after it)" if others else ""
        raise DistributedError(f"rank {rank} of {world_size} failed{also}:\n{text}")
    if len(done) < world_size:
        missing = sorted(set(range(world_size)) - set(done))
        raise DistributedError(
            f"ranks {missing} did not finish within timeout_s={timeout_s:g} s "
            "(a rank that skips a collective makes the others wait)"
        )
    return [done[r] for r in range(world_size)]
