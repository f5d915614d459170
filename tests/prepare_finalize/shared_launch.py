"""What the rank functions of a shared launch (the ``launched`` fixture of conftest.py) call: :func:`in_step`."""

from __future__ import annotations


def in_step(rank: int, name: str, part, *args):
    """``part(rank, *args)`` after a barrier (each part of a shared launch starts with the ranks in
    step, as in a fresh one); a failure names the rank and the part."""
    import torch.distributed as dist

    dist.barrier()
    try:
        return part(rank, *args)
    except Exception as e:
        e.add_note(f"(rank {rank}, {name})")
        raise
