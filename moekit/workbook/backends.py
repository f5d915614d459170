"""The experts backend of exercise 2: written in torch, all but its ``workspace_shapes``.

``apply`` uses its buffers the way a kernel backend does: workspace13 holds GEMM1's output for
every (token, slot) pair of the chunk, ``(M * topk, N)``; workspace2 the activation,
``(M * topk, N/2)``; and it writes each pair's row of the ``[M, topk, K]`` output. It views each
buffer with :func:`moekit.experts.base.carve`, so a buffer declared too small fails there, as a
kernel reading past its workspace would, and an output of the wrong rank fails where it is
indexed. The learner declares the shapes; the real :class:`moekit.ModularKernel` runs it.
"""

from __future__ import annotations

import torch

from moekit.experts.base import Experts, carve
from moekit.reference import local_expert_ids, silu_and_mul
from moekit.types import ExpertsCall


class GatedTorchExperts(Experts):
    """SiLU-gated experts in torch; subclasses declare :meth:`workspace_shapes`."""

    supports_chunking = True
    supports_expert_map = True

    def backend_for(self, problem) -> str:
        return "torch"

    def apply(self, call: ExpertsCall) -> str:
        p, w = call.problem, call.weights
        pairs, N = p.M * p.topk, p.N
        gemm1 = carve(call.workspace13, (pairs, N))  # must fit what was declared for this chunk
        act = carve(call.workspace2, (pairs, N // 2))
        local = local_expert_ids(call.topk_ids, p.num_local_experts, call.expert_map).reshape(-1)
        pair = torch.arange(pairs, device=local.device)
        token, slot = pair // p.topk, pair % p.topk
        out = call.output  # [M, topk, K]: a row per (token, slot), indexed as a kernel would
        out[token, slot, :] = 0  # a pair of another rank's expert (or an empty slot) adds nothing
        for e in local[local >= 0].unique().tolist():
            rows = (local == e).nonzero().flatten()  # expert e's pairs, each a row of the workspaces
            gemm1[rows] = (call.hidden[token[rows]].float() @ w.w1[e].float().t()).to(gemm1.dtype)
            act[rows] = silu_and_mul(gemm1[rows].float()).to(act.dtype)
            out[token[rows], slot[rows], :] = (act[rows].float() @ w.w2[e].float().t()).to(out.dtype)
        return "torch"


__all__ = ["GatedTorchExperts"]
