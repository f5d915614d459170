"""``gather_objects``, ``gather_traces``: collectives with a timeout (every rank's value, on every rank); ``to_cpu``."""

from __future__ import annotations

import dataclasses
import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

from moekit.distributed.process_group import check_timeout
from moekit.errors import DistributedError


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


def group_device(group=None) -> torch.device:
    """Where this group's tensors live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wait(work, *, timeout_s: float | None, what: str, group) -> None:
    """Wait for an async collective, at most ``timeout_s`` seconds (None: the group's own timeout)."""
    limit = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    try:
        work.wait(**limit)
    except RuntimeError as e:
        raise DistributedError(
            f"{what} failed or timed out on rank {dist.get_rank(group)} (timeout_s={timeout_s}): {e}. Every rank "
            "must call forward, including ranks with no tokens. After a timeout the group's collectives are out "
            "of step (with NCCL the communicator is unusable): destroy the process group and start a new one."
        ) from e


def all_gather(t: torch.Tensor, *, what: str, group=None, timeout_s: float | None = None) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype on all), in rank order; waits as :func:`wait` does."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(out, t.contiguous(), group=group, async_op=True)
    wait(work, timeout_s=timeout_s, what=f"all_gather of {what}", group=group)
    return out


def gather_objects(obj: Any, *, group=None, timeout_s: float | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), on every rank, in rank order: ``all_gather_object`` with a timeout.

    Two exchanges (the sizes, then the padded bytes), each waiting at most ``timeout_s`` seconds
    (None: the group's own timeout), then DistributedError. A collective: every rank must call it.
    """
    check_timeout(timeout_s, none_means="the group's own timeout")  # on every rank, before any exchange
    device = group_device(group)
    data = torch.frombuffer(bytearray(pickle.dumps(to_cpu(obj))), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [int(n) for n in all_gather(size, what="object sizes", group=group, timeout_s=timeout_s)]
    padded = torch.nn.functional.pad(data, (0, max(sizes) - data.numel()))
    gathered = all_gather(padded, what="objects", group=group, timeout_s=timeout_s)
    return [pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(gathered, sizes, strict=True)]


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
