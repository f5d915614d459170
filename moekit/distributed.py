"""Run a function on several torch.distributed ranks: from a notebook, a test, or torchrun.

One host, no torchrun (tests, notebooks, a laptop)::

    from moekit.distributed import launch
    results = launch(moekit.ep.run_rank, world_size=2, args=(config,))   # one result per rank

``launch`` spawns ``world_size`` processes, joins them through a TCP store that listens on a
free loopback port only (127.0.0.1, never every interface), calls ``fn(rank, world_size, *args)``
in each, and returns their return values in rank order (tensors come back on the CPU). With
gloo, the ranks' own data listeners are bound to the loopback interface too
(``GLOO_SOCKET_IFNAME=lo`` in the children), not to the address the hostname resolves to (a LAN
address on most hosts), so no socket that ``launch`` opens is reachable from the network; a test
checks every listener of a launch whose hostname resolves elsewhere. With NCCL, NCCL's own
bootstrap picks its interface (``NCCL_SOCKET_IFNAME``); that is not covered. When a rank fails
(raises, or exits without reporting a result, with any exit code), the others get a short grace
to report, then are stopped, and the caller sees the first failure's traceback. ``fn`` must be
importable (defined in a module, not in a notebook cell), because spawned processes find it by name.

Several hosts (or one host with torchrun), e.g. 2 nodes with 8 GPUs each; run on every node,
with ``--node-rank 0`` on ``host0`` and ``--node-rank 1`` on the other::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 \\
             --master-addr host0 --master-port 29500 \\
             -m moekit.ep --M 256 --E 64 --topk 8 --chunk-size 64

Under torchrun, torch's own rendezvous applies: rank 0 hosts a TCPStore on ``--master-port`` that
the other hosts must reach, so it listens beyond loopback; keep that port inside your cluster.

Inside such a process call :func:`init_from_env` (``moekit.ep`` does) to join the group that
torchrun describes in ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``.

Backends: ``"gloo"`` on CPU tensors (the Triton interpreter runs the kernels), ``"nccl"`` on
GPUs (one GPU per rank). ``None`` picks NCCL when moekit runs on CUDA and there is a GPU for
every rank, else gloo. For NCCL the NVLink-multicast features stay off
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), which some shared machines
require.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import importlib.util
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moekit  # first: sets TRITON_INTERPRET in every spawned child before any kernel import
from moekit.errors import DistributedError, InvalidInputError

BACKENDS = ("gloo", "nccl")
_NCCL_SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_GRACE_S = 3.0  # after one rank fails, how long to wait for the others' reports before killing them


def default_backend(world_size: int) -> str:
    """``"nccl"`` when moekit runs on CUDA with a GPU per rank, else ``"gloo"``."""
    on_cuda = moekit.device.get_device().type == "cuda"
    return "nccl" if on_cuda and torch.cuda.device_count() >= world_size else "gloo"


def _check_backend(backend: str | None, world_size: int, timeout_s) -> str:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise InvalidInputError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise InvalidInputError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    backend = default_backend(world_size) if backend is None else backend
    if backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise InvalidInputError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size}, "
            f"GPUs visible={torch.cuda.device_count()}"
        )
    return backend


def _init(backend: str, rank: int, world_size: int, timeout_s: float, **kwargs) -> None:
    if backend == "nccl":
        os.environ.update(_NCCL_SAFETY_ENV)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
    )


def torchrun_env() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` from the environment, as torchrun sets them; None when neither is set.

    Raises:
        InvalidInputError: only one of the two is set, or they are not ints with 0 <= RANK < WORLD_SIZE.
    """
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None and world is None:
        return None
    if rank is None or world is None:
        given, missing = ("RANK", "WORLD_SIZE") if world is None else ("WORLD_SIZE", "RANK")
        raise InvalidInputError(f"{given} is set but {missing} is not; torchrun sets both (unset {given} to run "
                                "one process, or pass --world-size to spawn the ranks)")  # fmt: skip
    try:
        r, w = int(rank), int(world)
    except ValueError:
        raise InvalidInputError(f"RANK and WORLD_SIZE must be ints, got RANK={rank!r}, WORLD_SIZE={world!r}") from None
    if not (w > 0 and 0 <= r < w):
        raise InvalidInputError(f"need WORLD_SIZE > 0 and 0 <= RANK < WORLD_SIZE, got RANK={r}, WORLD_SIZE={w}")
    return r, w


def init_from_env(*, backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group that torchrun (or a launcher like it) describes; return (rank, world_size).

    Reads ``RANK`` and ``WORLD_SIZE`` (and ``MASTER_ADDR``/``MASTER_PORT`` through torch's
    ``env://`` rendezvous); the GPU is ``LOCAL_RANK``. Without those variables it returns
    ``(0, 1)`` and starts no group, so the same script runs as one process. Safe to call twice.
    Malformed variables raise InvalidInputError (see :func:`torchrun_env`).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    found = torchrun_env()
    if found is None:
        return 0, 1
    rank, world_size = found
    if backend is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend = default_backend(local)
    _init(backend, rank, world_size, timeout_s, init_method="env://")
    return rank, world_size


def to_cpu(obj: Any) -> Any:
    """Tensors to the CPU, recursively through lists, tuples, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        return dataclasses.replace(obj, **{name: to_cpu(getattr(obj, name)) for name in fields})
    return obj


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
        try:
            obj = importlib.import_module(self.module)
        except ImportError:
            if self.file is None:
                raise
            spec = importlib.util.spec_from_file_location(self.module, self.file)
            obj = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = obj
            spec.loader.exec_module(obj)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


def _child(rank, world_size, port, backend, ref: _FnRef, args, timeout_s, results) -> None:
    # Results travel as plain-pickled bytes: torch's shared-memory tensor passing would break
    # when this process exits before the parent reads.
    try:
        fn = ref.resolve()
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        _init(backend, rank, world_size, timeout_s, store=store)
        value = to_cpu(fn(rank, world_size, *args))
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: B036  (the parent must hear about every failure, even SystemExit)
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str | None = None,
    args: tuple = (),
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return their results.

    Args:
        fn: an importable function (module level); its return value must pickle.
        world_size: number of ranks.
        backend: ``"gloo"``, ``"nccl"`` or None (auto, see the module docstring). With gloo on a
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
    backend = _check_backend(backend, world_size, timeout_s)
    if not isinstance(args, tuple):
        raise InvalidInputError(f"args must be a tuple (fn(rank, world_size, *args)), got {type(args).__name__}")
    ref = _FnRef.of(fn)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = _loopback_store(timeout_s)
    env = dict(_NCCL_SAFETY_ENV) if backend == "nccl" else {}
    if backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = _loopback_interface()  # else gloo binds what the hostname resolves to
    if backend == "gloo" and torch.cuda.is_available():
        env["MOEKIT_DEVICE"] = "cpu"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned children copy the environment at start
    try:
        procs = [
            ctx.Process(target=_child, daemon=True,
                        args=(r, world_size, store.port, backend, ref, args, timeout_s, results))
            for r in range(world_size)
        ]
        for p in procs:
            _start(p)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        return _collect(procs, results, world_size, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        del store


def _start(process) -> None:
    """``process.start()``; arguments that do not pickle become InvalidInputError. A spawned process
    pickles its arguments before the child exists, so a failure here started nothing."""
    try:
        process.start()
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise InvalidInputError(
            f"launch's args must pickle (every rank gets a copy): {type(e).__name__}: {e}"
        ) from e


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
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.fileno(), timeout=timeout)  # fmt: skip
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
                if r not in reported and p.exitcode is not None:  # exit code 0 too (os._exit(0) in fn)
                    # a report put just before exiting may still be in flight: give it a second
                    if now - dead_since.setdefault(r, now) > 1.0:
                        failures.append((r, f"rank {r} exited with code {p.exitcode} without reporting a result"))
                        deadline = min(deadline, now + _GRACE_S)
            continue
        if ok:
            done[rank] = pickle.loads(payload)
        else:
            failures.append((rank, payload))
        if failures and deadline > time.monotonic() + _GRACE_S:  # the others get a bounded grace, once
            deadline = time.monotonic() + _GRACE_S
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


def gather_objects(obj: Any, *, group=None, timeout_s: float | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), on every rank, in rank order: ``all_gather_object`` with a timeout.

    Two exchanges (the sizes, then the padded bytes), each waiting at most ``timeout_s`` seconds
    (None: the group's own timeout), then DistributedError. A collective: every rank must call it.
    """
    from moekit.prepare_finalize.agreement import wait

    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    world = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(pickle.dumps(to_cpu(obj))), dtype=torch.uint8).to(device)

    def gather(t: torch.Tensor, what: str) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(world)]
        work = dist.all_gather(out, t, group=group, async_op=True)
        wait(work, timeout_s=timeout_s, what=f"all_gather of {what}", group=group)
        return out

    sizes = [int(n) for n in gather(torch.tensor([data.numel()], dtype=torch.int64, device=device), "object sizes")]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    return [pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(gather(padded, "objects"), sizes, strict=True)]


def gather_traces(trace, *, group=None, timeout_s: float | None = None) -> list[torch.Tensor]:
    """Every rank's per-chunk tokens-per-expert matrix, gathered to every rank.

    Args:
        trace: this rank's :class:`moekit.trace.Trace` (``ModularKernel.last_trace``).
        group: the process group (default: the world).
        timeout_s: the longest wait of each exchange (None: the group's own timeout).

    Returns:
        ``[counts of rank 0, counts of rank 1, ...]``, each int64 ``[num_chunks, E_local]`` on the
        CPU (``num_chunks`` differs between ranks: it follows the rows each rank received). A
        collective: every rank must call it.
    """
    return gather_objects(trace.counts_matrix(), group=group, timeout_s=timeout_s)
