"""Joining a torch.distributed process group: the backend for a world size, and the group torchrun describes.

:func:`init_from_env` joins the group of a process that torchrun started (``RANK``,
``WORLD_SIZE``, ...); :func:`moekit.distributed.launch` uses the same backend check and group
start in the ranks it spawns.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import moekit  # first: sets TRITON_INTERPRET in every spawned child before any kernel import
from moekit.errors import InvalidInputError
from moekit.validate import check_positive_int

BACKENDS = ("gloo", "nccl")
NCCL_SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def default_backend(world_size: int) -> str:
    """``"nccl"`` when moekit runs on CUDA with a GPU per rank, else ``"gloo"``."""
    on_cuda = moekit.device.get_device().type == "cuda"
    return "nccl" if on_cuda and torch.cuda.device_count() >= world_size else "gloo"


MAX_TIMEOUT_S = 1e9  # about 31 years; past about 9.2e9 s c10d's nanosecond clock overflows (a raw DistNetworkError)


def check_timeout(timeout_s, *, none_means: str | None = None) -> None:
    """``timeout_s`` is a number of seconds in ``(0, MAX_TIMEOUT_S]``, or None where the caller gives
    None a meaning (``none_means``). "No timeout" is never a value: every collective moekit starts
    waits with one, so ``inf`` is refused by name rather than overflowing inside torch.

    Raises:
        InvalidInputError: anything else (a string, a bool, 0, a negative, NaN, inf, 1e20).
    """
    if timeout_s is None and none_means is not None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        also = f", or None ({none_means})" if none_means else ""
        raise InvalidInputError(
            f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:.0e}]{also}, got {timeout_s!r}; moekit "
            "waits with a timeout on every collective, so there is no 'no timeout' value"
        )


def check_backend(backend: str | None, world_size: int, timeout_s) -> str:
    check_positive_int(world_size, "world_size")
    check_timeout(timeout_s)
    backend = default_backend(world_size) if backend is None else backend
    if backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise InvalidInputError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size}, GPUs visible={torch.cuda.device_count()}"
        )
    return backend


def join_group(backend: str, rank: int, world_size: int, timeout_s: float, **kwargs) -> None:
    """Join the default process group as ``rank`` of ``world_size`` with a ``timeout_s`` on every
    collective (NCCL: this rank's GPU and the safety environment first); ``kwargs`` go to
    ``torch.distributed.init_process_group``."""
    if backend == "nccl":
        os.environ.update(NCCL_SAFETY_ENV)
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
        raise InvalidInputError(
            f"{given} is set but {missing} is not; torchrun sets both (unset {given} to run "
            "one process, or pass --world-size to spawn the ranks)"
        )
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
    if backend is None:  # a GPU per process of this node?
        backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    join_group(backend, rank, world_size, timeout_s, init_method="env://")
    return rank, world_size
