"""The chunk loop itself, with a torch test double for the experts (the real experts classes are
tested in tests/experts/). The double declares different workspaces above and below a switch M,
like TritonOrDeepGemmExperts, so the loop's policies can be checked without any GEMM kernel."""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.errors import (
    ChunkSizeError,
    FormatMismatchError,
    InvalidIdsError,
    InvalidInputError,
    MoekitError,
    WorkspaceShapeError,
)
from moekit.experts import TritonExperts
from moekit.experts.base import Experts, carve
from moekit.modular_kernel import ModularKernel
from moekit.prepare_finalize import NoEPPrepareFinalize
from moekit.reference import count_reference, local_expert_ids, moe_reference
from moekit.testing import assert_close, make_problem
from moekit.types import ActivationFormat, WorkspaceShapes
from moekit.workspace import WorkspacePool


class SwitchingTorchExperts(Experts):
    """Declares 'big' shapes at M >= switch and 'small' below; computes with torch."""

    def __init__(self, *, switch: int | None = None, legacy_output: bool = False, chunking: bool = True):
        super().__init__()
        self.switch, self.legacy_output = switch, legacy_output
        self.supports_chunking = chunking
        self.calls = []

    def check(self, problem, weights, *, a2_scale=None):
        weights.check(self.quant)  # a double: it takes any a2_scale, to see how chunks slice it

    def backend_for(self, problem):
        return "big" if self.switch is not None and problem.M >= self.switch else "small"

    def workspace_shapes(self, problem, *, act_dtype, tokens_meta=None):
        M, N, K, topk = problem.M, problem.N, problem.K, problem.topk
        if self.backend_for(problem) == "big":
            rows = M * topk + 7
            out = (M * topk, K) if self.legacy_output else (M, topk, K)
            return WorkspaceShapes((rows, max(N, K)), (rows, N // 2), out, act_dtype)
        return WorkspaceShapes((M, topk, N), (M * topk, N // 2), (M, topk, K), act_dtype)

    def apply(self, call):
        w1, (M, K, topk) = call.weights.w1, (call.problem.M, call.problem.K, call.problem.topk)
        ws13 = carve(call.workspace13, call.shapes.workspace13)
        ws2 = carve(call.workspace2, call.shapes.workspace2)
        self.calls.append(dict(M=M, meta=call.tokens_meta, a2=call.a2_scale, nan=bool(ws13.isnan().any())))
        ws2.zero_()
        if self.backend_for(call.problem) == "small":
            call.output.stride(2)  # as a kernel launcher addressing (token, slot, column) would
        per_slot = moe_reference(call.hidden, w1, call.weights.w2, torch.ones(M, topk), call.topk_ids,
                                 expert_map=call.expert_map, apply_weights=False)
        call.output.view(M, topk, K).copy_(per_slot)
        return self.backend_for(call.problem)


class BatchedDouble(SwitchingTorchExperts):
    activation_format = ActivationFormat.BATCHED


def problem(M=37, E=6, topk=2, K=16, N=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w1 = torch.randn(E, N, K, generator=g) / 4
    w2 = torch.randn(E, K, N // 2, generator=g) / 4
    weights, ids = moekit.routing.uniform_router(M, E, topk, seed=seed, device="cpu")
    return x, w1, w2, weights, ids


@pytest.mark.interpreter
@pytest.mark.parametrize("C", [None, 1, 5, 16, 37, 64])
def test_chunked_equals_unchunked_equals_reference(C):
    x, w1, w2, tw, ti = problem()
    kernel = ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(switch=8), chunk_size=C)
    out = kernel(x, w1, w2, tw, ti)
    assert_close(out, moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)
    expected_chunks = 1 if C is None else -(-37 // C)
    assert len(kernel.last_trace) == expected_chunks
    assert sum(r.M for r in kernel.last_trace) == 37


@pytest.mark.interpreter
def test_trace_records_backend_per_chunk_and_counts():
    x, w1, w2, tw, ti = problem(M=13)
    kernel = ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(switch=8), chunk_size=8)
    kernel(x, w1, w2, tw, ti)
    trace = kernel.last_trace
    assert trace.backends == ["big", "small"]
    assert [(r.start, r.end) for r in trace] == [(0, 8), (8, 13)]
    counts = trace.counts_matrix()
    assert counts.shape == (2, 6)
    assert torch.equal(counts[1], count_reference(ti[8:], 6).long())
    assert torch.equal(counts.sum(0), count_reference(ti, 6).long())
    assert "backend" in trace.table() and trace.peak_workspace_bytes > 0


@pytest.mark.interpreter
def test_zero_tokens_returns_empty_without_calling_experts():
    x, w1, w2, tw, ti = problem(M=0)
    experts = SwitchingTorchExperts()
    out = ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=4)(x, w1, w2, tw, ti)
    assert out.shape == (0, 16) and experts.calls == []


@pytest.mark.interpreter
def test_experts_without_chunking_get_one_call_with_metadata_unchanged():
    x, w1, w2, tw, ti = problem(M=20)
    experts = SwitchingTorchExperts(chunking=False)
    kernel = ModularKernel(NoEPPrepareFinalize(return_counts=True), experts, chunk_size=4)
    out = kernel(x, w1, w2, tw, ti)
    assert len(experts.calls) == 1 and experts.calls[0]["M"] == 20
    assert torch.equal(experts.calls[0]["meta"].expert_num_tokens, count_reference(ti, 6))
    assert_close(out, moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)


@pytest.mark.interpreter
def test_per_chunk_metadata_is_recounted_and_whole_batch_is_stale():
    x, w1, w2, tw, ti = problem(M=20)
    for policy in ("per_chunk", "whole_batch"):
        experts = SwitchingTorchExperts()
        kernel = ModularKernel(NoEPPrepareFinalize(return_counts=True), experts, chunk_size=8, metadata_policy=policy)
        kernel(x, w1, w2, tw, ti)
        metas = [c["meta"] for c in experts.calls]
        assert all(m.expert_num_tokens_cpu is not None for m in metas)
        if policy == "per_chunk":
            for (s, e), m in zip([(0, 8), (8, 16), (16, 20)], metas, strict=True):
                assert torch.equal(m.expert_num_tokens, count_reference(ti[s:e], 6))
                assert torch.equal(m.expert_num_tokens_cpu, m.expert_num_tokens.cpu())
        else:
            assert all(torch.equal(m.expert_num_tokens, count_reference(ti, 6)) for m in metas)


@pytest.mark.interpreter
def test_once_policy_guard_names_the_mismatch():
    x, w1, w2, tw, ti = problem(M=10)
    kernel = ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(switch=8), chunk_size=8,
                           workspace_policy="once")
    with pytest.raises(WorkspaceShapeError, match=r"(?s)SwitchingTorchExperts.*Chunk 1.*'small'.*bug 1"):
        kernel(x, w1, w2, tw, ti)


@pytest.mark.interpreter
def test_once_policy_without_guard_runs_small_chunks_in_the_big_buffers():
    # The parent commit's prefix views: the small backend's caches fit inside the big ones.
    x, w1, w2, tw, ti = problem(M=10)
    kernel = ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(switch=8), chunk_size=8,
                           workspace_policy="once", guard=False)
    assert_close(kernel(x, w1, w2, tw, ti), moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)
    first, second = kernel.last_trace.chunks
    assert second.shapes == first.shapes != second.needed  # given the big buffers, needed its own


@pytest.mark.interpreter
def test_once_policy_without_guard_fails_raw_like_upstream():
    # With the big backend's 2-D output declared for the whole batch, the small chunk gets a 2-D
    # slice and indexes its third dimension: torch's IndexError, as upstream (41060c6e0).
    x, w1, w2, tw, ti = problem(M=10)
    experts = SwitchingTorchExperts(switch=8, legacy_output=True)
    kernel = ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=8, workspace_policy="once", guard=False)
    with pytest.raises(IndexError, match="Dimension out of range") as info:
        kernel(x, w1, w2, tw, ti)
    assert not isinstance(info.value, MoekitError)
    assert [(c.backend, c.completed, c.output_shape) for c in kernel.last_trace] == [
        ("big", True, (16, 16)), ("small", False, (4, 16))]


@pytest.mark.interpreter
@pytest.mark.parametrize("M", [16, 13])
def test_once_policy_is_harmless_when_no_chunk_switches(M):
    # A shorter last chunk of the same backend takes the leading rows of the buffers.
    x, w1, w2, tw, ti = problem(M=M)
    kernel = ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(switch=100), chunk_size=8,
                           workspace_policy="once")
    assert_close(kernel(x, w1, w2, tw, ti), moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)


@pytest.mark.interpreter
def test_output_layout_that_disagrees_between_backends_is_named():
    # Pre-fix upstream: the big backend declared (M*topk, K), the small one (M, topk, K).
    x, w1, w2, tw, ti = problem(M=10)
    kernel = ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(switch=8, legacy_output=True), chunk_size=4)
    with pytest.raises(WorkspaceShapeError, match=r"(?s)declared output \(4, 2, 16\).*\(20, 16\)"):
        kernel(x, w1, w2, tw, ti)


@pytest.mark.interpreter
def test_per_token_a2_scale_is_sliced_per_chunk():  # upstream #28728 sliced (e, e)
    x, w1, w2, tw, ti = problem(M=10)
    experts = SwitchingTorchExperts()
    a2 = torch.arange(1.0, 11.0).view(10, 1)
    ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=4)(x, w1, w2, tw, ti, a2_scale=a2)
    assert [c["a2"].flatten().tolist() for c in experts.calls] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    per_tensor = torch.tensor([0.5])
    experts.calls.clear()
    ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=4)(x, w1, w2, tw, ti, a2_scale=per_tensor)
    assert all(c["a2"] is per_tensor for c in experts.calls)


@pytest.mark.interpreter
def test_pool_does_not_grow_after_the_first_chunk_and_poison_never_leaks():
    x, w1, w2, tw, ti = problem(M=40)
    pool = WorkspacePool("cpu")
    poisoned = pool.take(WorkspaceShapes((4096,), (4096,), (1,), torch.float32))
    poisoned.workspace13.fill_(float("nan"))
    poisoned.workspace2.fill_(float("nan"))
    experts = SwitchingTorchExperts()
    kernel = ModularKernel(NoEPPrepareFinalize(), experts, chunk_size=8, pool=pool)
    grows = pool.grows
    out = kernel(x, w1, w2, tw, ti)
    assert pool.grows == grows, "chunks allocated new workspace memory"
    assert experts.calls[0]["nan"], "the canary did not reach the experts"
    assert not out.isnan().any()


@pytest.mark.interpreter
def test_expert_map_splits_sum_to_reference():
    x, w1, w2, tw, ti = problem(M=21, E=8)
    ref = moe_reference(x, w1, w2, tw, ti)
    for ep in (2, 4):
        total = torch.zeros_like(ref)
        for rank in range(ep):
            emap = moekit.routing.contiguous_expert_map(8, ep, rank)
            lo, hi = rank * 8 // ep, (rank + 1) * 8 // ep
            kernel = ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(), chunk_size=5)
            total += kernel(x, w1[lo:hi], w2[lo:hi], tw, ti, expert_map=emap, global_num_experts=8)
        assert_close(total, ref, dtype=torch.float32)


@pytest.mark.interpreter
def test_negative_ids_contribute_nothing():
    x, w1, w2, tw, ti = problem(M=9)
    ti = ti.clone()
    ti[::2, 0] = -1
    out = ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(), chunk_size=4)(x, w1, w2, tw, ti)
    assert (local_expert_ids(ti, 6) == -1).any()
    assert_close(out, moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)


@pytest.mark.parametrize("bad", [0, -1, 2.0, "64"])
def test_bad_chunk_size(bad):
    with pytest.raises(ChunkSizeError):
        ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(), chunk_size=bad)


def test_format_mismatch_and_bad_policies():
    with pytest.raises(FormatMismatchError, match="batched"):
        ModularKernel(NoEPPrepareFinalize(), BatchedDouble())
    with pytest.raises(InvalidInputError):
        ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(), workspace_policy="sometimes")
    with pytest.raises(InvalidInputError):
        ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(), metadata_policy="never")


def test_bad_inputs_are_named_before_anything_runs():
    x, w1, w2, tw, ti = problem(M=6)
    experts = SwitchingTorchExperts()
    kernel = ModularKernel(NoEPPrepareFinalize(), experts)
    with pytest.raises(InvalidIdsError, match="unsigned"):
        kernel(x, w1, w2, tw, ti.to(torch.uint8))
    with pytest.raises(InvalidIdsError, match="non-integer"):
        kernel(x, w1, w2, tw, ti.float())
    with pytest.raises(InvalidIdsError, match="contiguous"):
        kernel(x, w1, w2, tw, ti.t().contiguous().t())
    with pytest.raises(InvalidInputError, match="w2"):
        kernel(x, w1, w2[:, :, :-1], tw, ti)
    with pytest.raises(InvalidInputError, match="topk_ids"):
        kernel(x, w1, w2, tw[:-1], ti[:-1])
    with pytest.raises(InvalidInputError, match="expert_map"):
        kernel(x, w1, w2, tw, ti, expert_map=torch.arange(6, dtype=torch.int32), global_num_experts=8)
    assert experts.calls == []


def test_zero_tokens_are_validated_like_any_other_call():
    # With M=0 a dtype mismatch, or fp8 with K=64, used to return an empty output silently.
    x, w1, w2, tw, ti = problem(M=0)
    kernel = ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts())
    with pytest.raises(InvalidInputError, match="hidden's dtype"):
        kernel(x.double(), w1, w2, tw, ti)
    from moekit.experts import TritonExperts

    fp8 = moekit.testing.make_problem(0, E=4, K=64, N=256, quant=moekit.QuantScheme.FP8_BLOCK)
    with pytest.raises(moekit.errors.QuantizationError, match="multiples of 128"):
        ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=moekit.QuantScheme.FP8_BLOCK))(
            *fp8.inputs(), **fp8.options())  # fmt: skip


def test_bad_constructor_arguments_are_named_at_construction():
    with pytest.raises(InvalidInputError, match="pool"):
        ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(), pool="x")
    with pytest.raises(InvalidInputError, match="guard"):
        ModularKernel(NoEPPrepareFinalize(), SwitchingTorchExperts(), guard="no")


def test_ids_beyond_global_experts_are_named_before_anything_runs():
    x, w1, w2, tw, ti = problem(M=6)
    experts = SwitchingTorchExperts()
    with pytest.raises(InvalidIdsError, match="global_num_experts=6"):
        ModularKernel(NoEPPrepareFinalize(), experts)(x, w1, w2, tw, ti + 6)
    bad = ti.clone()
    bad[0, 0] = -2
    with pytest.raises(InvalidIdsError, match="-1"):
        ModularKernel(NoEPPrepareFinalize(), experts)(x, w1, w2, tw, bad)
    assert experts.calls == []


def test_a_per_token_a2_scale_cannot_follow_dispatched_rows():
    from moekit.prepare_finalize import BatchedPrepareFinalize

    x, w1, w2, tw, ti = problem(M=6)
    kernel = ModularKernel(BatchedPrepareFinalize(max_tokens=12), BatchedDouble())
    with pytest.raises(moekit.errors.QuantizationError, match="per-token a2_scale"):
        kernel(x, w1, w2, tw, ti, a2_scale=torch.ones(6))


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_a_nan_token_stays_nan_through_the_fp8_layer():
    # The fp8 quantization kernel used to drop a NaN from its group's scale: the token's output
    # came out finite. The torch spec and the unquantized path propagate it.
    from moekit.experts import TritonExperts

    p = moekit.testing.make_problem(6, E=4, K=128, N=256, quant=moekit.QuantScheme.FP8_BLOCK, seed=3)
    p.hidden[2, 7] = float("nan")
    out = ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=moekit.QuantScheme.FP8_BLOCK))(
        *p.inputs(), **p.options())  # fmt: skip
    assert out[2].isnan().all() and not out[[0, 1, 3, 4, 5]].isnan().any()


def test_the_per_chunk_recount_uses_the_expert_map():
    # One process, EP rank 1 of 2: a consumer of the counts (GroupedMMExperts groups rows by
    # them) is right only if every chunk's recount maps global ids to this rank's local ids.
    from moekit.experts import GroupedMMExperts

    full = moekit.testing.make_problem(30, E=8, topk=2, K=32, N=64, dtype=torch.float32, seed=5)
    rank1 = full.shard(1, 2)
    kernel = ModularKernel(NoEPPrepareFinalize(return_counts=True), GroupedMMExperts(), chunk_size=8)
    out = kernel(*rank1.inputs(), **rank1.options())
    assert_close(out, rank1.reference(), dtype=torch.float32)
    local = moekit.reference.count_reference(rank1.topk_ids, 4, rank1.expert_map)
    assert torch.equal(kernel.last_trace.counts_matrix().sum(0), local.long().cpu())  # the trace is on the CPU


@pytest.mark.interpreter
def test_two_threads_sharing_one_kernel_take_turns():
    # They share one workspace pool: the Triton experts compute through it (GEMM1 -> workspace13
    # -> activation -> workspace2 -> GEMM2). Without the pool's lock, results were corrupted.
    import threading

    from moekit.experts import TritonExperts

    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=4)
    cases = [problem(M=17, K=32, N=64, seed=s) for s in (1, 2, 3)]
    outs = [None] * 3

    def work(i):
        for _ in range(4):
            outs[i] = kernel(*cases[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (x, w1, w2, tw, ti), out in zip(cases, outs, strict=True):
        assert_close(out, moe_reference(x, w1, w2, tw, ti), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# validation once, at the door


def _checks_made(fn) -> dict[str, int]:
    """Calls into moekit's argument checks while ``fn()`` runs: every function of validate.py, the
    GEMM argument checks, the kernel launchers' ``_check*`` helpers and ProblemSize's validation.

    Host code only: inside an interpreted kernel launch (Triton's interpreter running the kernel's
    programs: no check of moekit's runs there) the profiler pauses, which leaves most of the forward
    unprofiled (profiled, it took three times as long)."""
    import collections
    import contextlib
    import sys

    made = collections.Counter()

    def is_check(code) -> bool:
        path, name = code.co_filename.replace("\\", "/"), code.co_name
        if "/moekit/" not in path:
            return False
        if path.endswith("/moekit/validate.py") and not name.startswith("<"):
            return True
        if path.endswith("/moekit/hopper/gemm_args.py") and name.startswith("check"):
            return True
        if "/moekit/kernels/" in path and name.startswith("_check"):
            return True
        # WorkspaceShapes checks what the experts declare, per chunk (bug 1's fix): not an argument check
        return path.endswith("/moekit/types.py") and name == "__post_init__" and code.co_qualname != (
            "WorkspaceShapes.__post_init__")

    def profile(frame, event, arg):
        if event == "call" and is_check(frame.f_code):
            made[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1

    with contextlib.ExitStack() as stack:
        if moekit.device.interpreting():
            from triton.runtime.interpreter import GridExecutor

            launch = GridExecutor.__call__

            def unprofiled(self, *args, **kwargs):
                sys.setprofile(None)
                try:
                    return launch(self, *args, **kwargs)
                finally:
                    sys.setprofile(profile)

            GridExecutor.__call__ = unprofiled
            stack.callback(setattr, GridExecutor, "__call__", launch)
        sys.setprofile(profile)
        stack.callback(sys.setprofile, None)
        fn()
    return dict(made)


@pytest.mark.interpreter
@pytest.mark.parametrize("experts", ["triton", "grouped_mm", "deep_gemm"])
def test_the_checks_do_not_grow_with_the_chunks(experts):
    """One forward checks its arguments at the door; four chunks check nothing more than one."""
    from moekit.api import experts_class
    from moekit.testing import make_problem
    from moekit.types import QuantScheme

    quant = QuantScheme.FP8_BLOCK if experts == "deep_gemm" else QuantScheme.NONE
    dtype = torch.bfloat16 if quant is QuantScheme.FP8_BLOCK else torch.float32
    p = make_problem(64, E=8, topk=2, K=128, N=256, dtype=dtype, quant=quant).shard(1, 2)  # an expert_map
    made = {}
    for C in (None, 16):
        kernel = ModularKernel(NoEPPrepareFinalize(), experts_class(experts)(quant=quant), chunk_size=C)
        run = lambda k=kernel: k(*p.inputs(), **p.options())
        run()  # the first call compiles and fills the caches
        made[C] = _checks_made(run)
        assert len(kernel.last_trace) == (1 if C is None else 4)
    assert made[16] == made[None], f"one chunk: {made[None]}; four chunks: {made[16]}"
    assert sum(made[None].values()) > 0  # the door did check


# ---------------------------------------------------------------------------------------------
# copies and threads (issue 25, items 12 and 13)


def _save_and_load(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_kernel_copies_after_a_forward(how):
    # The pool's RLock (and the per-thread trace) made a used kernel uncopyable.
    import copy
    import pickle

    from moekit.experts import TritonExperts

    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=5)
    case = problem(M=17, K=32, N=64, seed=4)
    expected = kernel(*case)
    copy_of = {"deepcopy": copy.deepcopy, "pickle": lambda k: pickle.loads(pickle.dumps(k)),
               "torch.save": _save_and_load}[how](kernel)  # fmt: skip
    assert copy_of.last_trace is None  # a trace stays with the thread (and process) that made it
    assert torch.equal(copy_of(*case), expected)
    assert len(copy_of.last_trace) == 4 and len(kernel.last_trace) == 4
    assert copy_of.pool is not kernel.pool and copy_of.pool.lock is not kernel.pool.lock


@pytest.mark.interpreter
def test_twelve_concurrent_calls_each_read_their_own_trace():
    # last_trace was one attribute, set before the pool's lock: 10 of 12 threads read another call's.
    import threading

    from moekit.experts import TritonExperts

    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=3)
    cases = [problem(M=4 + i, K=32, N=64, seed=i) for i in range(12)]
    start, seen, errors = threading.Barrier(12), [None] * 12, []

    def work(i):
        try:
            start.wait()
            out = kernel(*cases[i])
            seen[i] = (kernel.last_trace.M, len(kernel.last_trace), out.shape[0])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen == [(4 + i, -(-(4 + i) // 3), 4 + i) for i in range(12)]


@pytest.mark.parametrize("shared", [True, False])
def test_a_forward_inside_a_forward_on_the_same_pool_gets_its_own_buffers(device, shared):
    """An experts class (or a hook) that runs moekit inside ``apply``, on the pool the outer forward
    holds (the process's shared pool, or one pool handed to both kernels), must not be handed the
    outer forward's output and workspaces: both results stay right."""
    from moekit.experts import TritonExperts
    from moekit.testing import make_problem
    from moekit.workspace import shared_pool

    pool = shared_pool(device) if shared else WorkspacePool(device)
    outer_p = make_problem(24, E=4, topk=2, K=64, N=128, seed=1, device=device)
    inner_p = make_problem(24, E=4, topk=2, K=64, N=128, seed=2, device=device)  # same shapes: same views
    inner = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), pool=pool)
    inner_outs = []

    class Nested(TritonExperts):
        def apply(self, call):
            inner_outs.append(inner(*inner_p.inputs()))
            return super().apply(call)

    out = ModularKernel(NoEPPrepareFinalize(), Nested(), chunk_size=8, pool=pool)(*outer_p.inputs())
    assert len(inner_outs) == 3
    assert_close(out, outer_p.reference(), dtype=outer_p.hidden.dtype)
    for got in inner_outs:
        assert_close(got, inner_p.reference(), dtype=inner_p.hidden.dtype)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_an_activation_dtype_an_experts_class_cannot_compute_is_refused_by_name(device, chunk_size):
    """fp64 activations: a named error at the door, before any buffer is taken, for every class that
    computes in fp32/fp16/bf16 (the Triton GEMMs gave inf, silently; torch's grouped GEMM a raw
    RuntimeError); the torch-loop reference class computes them."""
    from moekit.experts import BatchedTritonExperts, GroupedMMExperts, NaiveBatchedExperts, TritonExperts
    from moekit.hopper.experts import HopperTritonExperts
    from moekit.prepare_finalize import BatchedPrepareFinalize
    from moekit.testing import expect_raises, make_problem

    p = make_problem(8, E=4, topk=2, K=128, N=256, dtype=torch.float64, seed=3, device=device)
    standard = [TritonExperts(), HopperTritonExperts(), GroupedMMExperts()]
    for experts in [*standard, BatchedTritonExperts()]:
        stage = NoEPPrepareFinalize() if experts in standard else BatchedPrepareFinalize(max_tokens=8)
        pool = WorkspacePool(device)
        kernel = ModularKernel(stage, experts, chunk_size=chunk_size if experts in standard else None, pool=pool)
        with expect_raises(InvalidInputError, match=f"{experts.name} computes in float32, float16, bfloat16"):
            kernel(*p.inputs())
        assert pool.requests == 0
    out = ModularKernel(BatchedPrepareFinalize(max_tokens=8), NaiveBatchedExperts())(*p.inputs())
    assert_close(out, p.reference(), dtype=torch.float32)


def test_meta_tensors_get_the_device_error_first():
    """With every tensor on the meta device and an expert map, the named device error comes before
    anything reads the map's values (that raised torch's raw 'Tensor.item() cannot be called')."""
    from moekit.experts import TritonExperts
    from moekit.testing import expect_raises

    m = torch.device("meta")
    args = (torch.empty(4, 64, device=m), torch.empty(4, 128, 64, device=m), torch.empty(4, 64, 64, device=m),
            torch.empty(4, 2, device=m), torch.zeros(4, 2, dtype=torch.int32, device=m))  # fmt: skip
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts())
    for kw in ({}, {"expert_map": torch.arange(4, dtype=torch.int32, device=m)}):
        with expect_raises(InvalidInputError, match="hidden is on meta"):
            kernel(*args, **kw)


# Values the caller owns are read on every call (issue 37, item 1): a write that no version counter
# sees, after a first good call, is refused by name, as a fresh kernel refuses it.

UNSEEN_WRITES = {  # writes to entry 0 of a CPU tensor that leave its version counter alone
    "numpy view": lambda t, v: t.numpy().__setitem__(0, v),
    ".data": lambda t, v: t.data.__setitem__(0, v),
    "dlpack alias": lambda t, v: torch.from_dlpack(t).__setitem__(0, v),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("write", list(UNSEEN_WRITES))
def test_a_map_written_after_a_good_call_is_checked_again(write):
    p = make_problem(6, E=8, topk=2, K=32, N=64, dtype=torch.float32, seed=21, device="cpu").shard(0, 2)
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=4)
    p.check(kernel(*p.inputs(), **p.options()))
    version = p.expert_map._version
    UNSEEN_WRITES[write](p.expert_map, 4)  # == E_local: that expert's tokens would be dropped silently
    assert p.expert_map._version == version, "the write must be one that no version counter sees"
    with pytest.raises(moekit.errors.InvalidIdsError, match=r"got \[4\] at global ids \[0\]"):
        kernel(*p.inputs(), **p.options())


@pytest.mark.interpreter
@pytest.mark.parametrize("write", list(UNSEEN_WRITES))
@pytest.mark.parametrize("value", [0.0, float("nan")])
def test_an_a2_scale_written_after_a_good_call_is_checked_again(write, value):
    p = make_problem(5, E=4, topk=2, K=128, N=256, quant=moekit.QuantScheme.FP8_BLOCK, seed=22, device="cpu")
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=moekit.QuantScheme.FP8_BLOCK))
    a2 = torch.full((1,), 0.02)
    kernel(*p.inputs(), **p.options(), a2_scale=a2)
    UNSEEN_WRITES[write](a2, value)
    with pytest.raises(moekit.errors.QuantizationError, match="a2_scale values must be finite and > 0"):
        kernel(*p.inputs(), **p.options(), a2_scale=a2)


@pytest.mark.interpreter
def test_an_owned_scale_is_checked_once_and_follows_no_later_write(monkeypatch):
    p = make_problem(5, E=4, topk=2, K=128, N=256, quant=moekit.QuantScheme.FP8_BLOCK, seed=28, device="cpu")
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=moekit.QuantScheme.FP8_BLOCK))
    a2 = torch.full((1,), 0.02)
    owned = moekit.owned_scale(a2)
    want = kernel(*p.inputs(), **p.options(), a2_scale=a2)
    reads, isfinite = [], torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: reads.append(t) or isfinite(t))
    a2.numpy()[:] = 0.0  # the caller's tensor changes (no version bump); the owned copy does not
    assert torch.equal(kernel(*p.inputs(), **p.options(), a2_scale=owned), want)
    assert reads == [], "an owned scale's values are not read again"
    with pytest.raises(moekit.errors.QuantizationError, match=r"a2_scale values must be finite and > 0, got \[0.0\]"):
        kernel(*p.inputs(), **p.options(), a2_scale=a2)  # a caller's tensor is read on every call
    assert len(reads) == 1
    per_token = torch.rand(5) + 0.01  # many elements: an owned scale is found by identity, never by ==
    with torch.inference_mode():
        inference = moekit.owned_scale(torch.full((1,), 0.02))
    scales = (moekit.owned_scale(per_token), inference)
    reads.clear()  # (owned_scale reads its copy once)
    for scale in scales:
        owned = kernel(*p.inputs(), **p.options(), a2_scale=scale)
        assert torch.equal(owned, kernel(*p.inputs(), **p.options(), a2_scale=scale.clone()))
    assert len(reads) == 2, "only the plain clones were read"
    with pytest.raises(moekit.errors.QuantizationError, match=r"got \[nan\]"):
        moekit.owned_scale(torch.tensor([float("nan")]))
    with pytest.raises(moekit.errors.QuantizationError, match="floating-point tensor, got list"):
        moekit.owned_scale([0.5])


@pytest.mark.interpreter
def test_inference_mode_tensors_work_in_and_out_of_inference_mode():
    # Inference tensors have no version counter: a cache keyed on it raised a raw RuntimeError.
    with torch.inference_mode():
        p = make_problem(7, E=8, topk=2, K=32, N=64, dtype=torch.float32, seed=23, device="cpu").shard(1, 2)
        kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=4)
        p.check(kernel(*p.inputs(), **p.options()))  # the pool grows here, under inference mode
        p.check(kernel(*p.inputs(), **p.options()))
    p.check(kernel(*p.inputs(), **p.options()))  # then outside it: the same pool, inference tensors in
    fresh = make_problem(7, E=8, topk=2, K=32, N=64, dtype=torch.float32, seed=24, device="cpu").shard(1, 2)
    fresh.check(kernel(*fresh.inputs(), **fresh.options()))  # ordinary tensors into that pool
    with torch.inference_mode():
        fresh.check(kernel(*fresh.inputs(), **fresh.options()))


@pytest.mark.interpreter
def test_a_layer_at_the_documented_maximum_of_experts_matches_the_reference():
    from moekit.validate import MAX_EXPERTS

    p = make_problem(48, E=MAX_EXPERTS, topk=2, K=16, N=32, dtype=torch.float32, seed=25, device="cpu").shard(1, 2)
    p.check(ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=16)(*p.inputs(), **p.options()))
    with pytest.raises(InvalidInputError, match=f"global_num_experts must be at most {MAX_EXPERTS}"):
        ModularKernel(NoEPPrepareFinalize(), TritonExperts())(*p.inputs(), global_num_experts=MAX_EXPERTS + 1)


@pytest.mark.interpreter
def test_an_owned_placement_is_checked_once_and_follows_no_later_write(monkeypatch):
    import moekit.validate as validate

    p = make_problem(9, E=8, topk=2, K=32, N=64, dtype=torch.float32, seed=26, device="cpu").shard(1, 2)
    placement = moekit.owned_placement(p.expert_map, 4)
    reads = []
    monkeypatch.setattr(validate, "check_map_values", lambda *a: reads.append(a))
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(), chunk_size=4)
    want = kernel(*p.inputs(), **p.options())
    assert len(reads) == 1, "a tensor's values are read on every call"
    p.expert_map.numpy()[:] = 0  # the caller's tensor changes; the owned copy does not
    assert torch.equal(kernel(*p.inputs(), expert_map=placement, global_num_experts=8), want)
    assert len(reads) == 1, "an owned placement's values are not read again"


def test_an_owned_placement_is_refused_where_it_does_not_fit():
    emap = torch.tensor([-1, 0, 1, -1], dtype=torch.int32)
    with pytest.raises(InvalidIdsError, match=r"got \[2\] at global ids \[3\]"):
        moekit.owned_placement(torch.tensor([-1, 0, 1, 2], dtype=torch.int32), 2)
    p = make_problem(3, E=4, topk=1, K=32, N=64, dtype=torch.float32, seed=27, device="cpu").shard(0, 2)
    kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts())
    with pytest.raises(InvalidInputError, match="must come from moekit.owned_placement"):
        kernel(*p.inputs(), expert_map=moekit.ExpertPlacement(4, 2, emap))
    with pytest.raises(InvalidInputError, match="holds 3 of 4 experts, but w1 holds 2"):
        kernel(*p.inputs(), expert_map=moekit.owned_placement(torch.tensor([0, 1, 2, -1]), 3))
