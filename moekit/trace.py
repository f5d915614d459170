"""A record of what every chunk of one forward did: the picture the notebooks draw."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moekit.types import WorkspaceShapes


@dataclass
class ChunkRecord:
    """One chunk: its token range, the backend that ran, its buffers and its tokens per expert.

    - ``shapes``: the buffers the chunk was given; ``needed``: what its backend declared for
      its own M. They differ only under ``workspace_policy="once"`` (bug 1).
    - ``output_shape``: the chunk's slice of the whole-batch output.
    - ``counts``: the chunk's own tokens per local expert, on the compute device (no sync;
      :meth:`Trace.counts_matrix` copies), or None when not recorded.
    - ``start``/``end``: tokens of the batch (``chunk_by="tokens"``) or rows of the expert-sorted
      layout (``chunk_by="rows"``), then ``M`` counts rows.
    - ``completed``: False when ``apply`` raised on this chunk (the record is kept, so a trace
      of a failed forward shows how far it got and what the failing chunk was handed).
    """

    index: int
    start: int
    end: int
    backend: str
    shapes: WorkspaceShapes
    output_shape: tuple[int, ...]
    counts: torch.Tensor | None = None
    needed: WorkspaceShapes | None = None
    completed: bool = True
    note: str = ""  # why the backend ran, when it was a fallback (Experts.why)
    expert_bytes: int = 0  # bytes of one expert's weights (w1 + w2 and scales), for weight_bytes

    def __post_init__(self):
        if self.needed is None:
            self.needed = self.shapes

    def finish(self, backend: str, note: str = "") -> None:
        """The chunk ran: the backend that ran it and why (when it was a fallback)."""
        self.backend, self.note, self.completed = backend, note, True

    @property
    def M(self) -> int:
        return self.end - self.start

    @property
    def workspace_bytes(self) -> int:
        return self.shapes.workspace_bytes

    @property
    def experts_touched(self) -> int | None:
        """Local experts with at least one row in this chunk (None without recorded counts; syncs)."""
        return None if self.counts is None else int((self.counts > 0).sum())

    @property
    def expert_span(self) -> tuple[int, int] | None:
        """The first and last local expert with rows in this chunk (None without counts or rows; syncs)."""
        if self.counts is None:
            return None
        touched = (self.counts > 0).nonzero().flatten().tolist()
        return (touched[0], touched[-1]) if touched else None

    @property
    def weight_bytes(self) -> int | None:
        """Weight bytes this chunk's GEMMs read at least once: experts touched x bytes per expert."""
        touched = self.experts_touched
        return None if touched is None else touched * self.expert_bytes

    def row(self) -> dict:
        return {
            "chunk": self.index,
            "tokens": f"[{self.start}, {self.end})",
            "M": self.M,
            "backend": self.backend if self.completed else f"{self.backend} (failed)",
            "workspace13": self.shapes.workspace13,
            "workspace2": self.shapes.workspace2,
            "output": self.output_shape,
            "bytes": self.workspace_bytes,
        }


@dataclass
class Trace:
    """All chunks of one ``ModularKernel.forward`` (``M`` is the caller's token count)."""

    M: int
    chunk_size: int | None
    experts: str
    workspace_policy: str
    metadata_policy: str
    chunk_by: str = "tokens"
    chunks: list[ChunkRecord] = field(default_factory=list)
    peak_workspace_bytes: int = 0
    # Rows the experts saw: M without dispatch; the received rows after an all-to-all (their
    # chunks cover [0, expert_rows)); max tokens per expert in the batched format.
    expert_rows: int = 0

    def __len__(self) -> int:
        return len(self.chunks)

    def add(
        self,
        chunk,
        backend: str,
        given: WorkspaceShapes,
        needed: WorkspaceShapes,
        output: torch.Tensor,
        counts: torch.Tensor | None,
        expert_bytes: int,
    ) -> ChunkRecord:
        """Record a chunk before its experts run (not ``completed`` until :meth:`ChunkRecord.finish`)."""
        state = dict(counts=counts, needed=needed, completed=False, expert_bytes=expert_bytes)
        record = ChunkRecord(chunk.index, chunk.start, chunk.end, backend, given, tuple(output.shape), **state)
        self.chunks.append(record)
        return record

    def __iter__(self):
        return iter(self.chunks)

    @property
    def backends(self) -> list[str]:
        return [c.backend for c in self.chunks]

    def rows(self) -> list[dict]:
        return [c.row() for c in self.chunks]

    @property
    def weight_bytes(self) -> int | None:
        """Weight bytes all chunks read (an expert touched by k chunks counts k times); syncs."""
        per_chunk = [c.weight_bytes for c in self.chunks]
        return None if not per_chunk or None in per_chunk else sum(per_chunk)

    def reads(self) -> list[dict]:
        """One row per chunk: its rows, the experts it touches (first and last, and how many), the
        weight bytes it reads and its workspace bytes (syncs once per chunk for the counts)."""
        return [
            {
                "chunk": c.index,
                "range": f"[{c.start}, {c.end})",
                "rows": c.M,
                "experts": "-" if c.expert_span is None else "{}..{}".format(*c.expert_span),
                "touched": c.experts_touched,
                "weight_bytes": c.weight_bytes,
                "workspace_bytes": c.workspace_bytes,
            }
            for c in self.chunks
        ]

    def handed_vs_needed(self) -> list[dict]:
        """One row per chunk: the buffers and output slice it was handed beside what its own
        backend declared for its M (they differ under ``workspace_policy="once"``: bug 1)."""
        return [
            {
                "chunk": c.index,
                "M": c.M,
                "backend": c.backend if c.completed else f"{c.backend} (failed)",
                "workspace13 handed": c.shapes.workspace13,
                "workspace13 needed": c.needed.workspace13,
                "workspace2 handed": c.shapes.workspace2,
                "workspace2 needed": c.needed.workspace2,
                "output handed": c.output_shape,
                "output needed": c.needed.output,
            }
            for c in self.chunks
        ]

    def table(self) -> str:
        """A plain-text table, one line per chunk."""
        head = ("chunk", "tokens", "M", "backend", "workspace13", "workspace2", "output", "bytes")
        body = [tuple(str(r[h]) for h in head) for r in self.rows()]
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([fmt.format(*head)] + [fmt.format(*b) for b in body])

    def counts_matrix(self) -> torch.Tensor:
        """int64 ``[num_chunks, E_local]`` tokens per (chunk, expert) on the CPU (syncs once)."""
        rows = [c.counts for c in self.chunks if c.counts is not None]
        if not rows:
            return torch.zeros(0, 0, dtype=torch.int64)
        return torch.stack([r.to("cpu", torch.int64) for r in rows])
