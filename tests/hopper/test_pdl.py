"""moekit.hopper.pdl: programmatic dependent launch. On the CPU it is off and the launchers pass
PDL=False; the rule that makes it safe (nothing before the wait) is checked on every kernel's source;
on a Hopper GPU the layer gives the same bits with and without it, eager and as a CUDA graph."""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import SimpleNamespace

import pytest
import torch

import moekit
from moekit.hopper import align, pdl
from moekit.hopper import grouped_gemm as fused_moe
from moekit.hopper import launch as L

# The wing's own kernels carry PDL; the book's kernels (count, scan, scatter, activation, reduce)
# launch as the tutorials do, without it.
PDL_LAUNCHERS = {"align": align._ONE_LAUNCH, "gemm": fused_moe._GEMM}


MEMORY_OPS = {"load", "store", "atomic_add", "atomic_max", "atomic_min", "atomic_cas", "atomic_xchg", "gather"}


def _calls(node) -> list[str]:
    return [c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "?")
            for c in ast.walk(node) if isinstance(c, ast.Call)]  # fmt: skip


@pytest.mark.parametrize("name", sorted(PDL_LAUNCHERS))
def test_every_pdl_kernel_waits_before_it_touches_memory(name):
    """The first statement is ``pdl_begin(PDL)``: no load, store or descriptor access comes before it."""
    launcher = PDL_LAUNCHERS[name]
    assert launcher.pdl
    fn = getattr(launcher.fn, "fn", launcher.fn)  # the Python function under the jit wrapper
    func = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert func.args.args[-1].arg == "PDL", f"{name}: PDL must be the last compile-time parameter"
    begin = [i for i, st in enumerate(func.body) if "pdl_begin" in _calls(st)]
    assert begin, f"{name}: no pdl_begin(PDL) at the top level"
    for st in func.body[: begin[0]]:  # none today; index arithmetic would be harmless
        assert isinstance(st, ast.Assign), f"{name}: only assignments before the wait, found {ast.unparse(st)!r}"
        touched = MEMORY_OPS & set(_calls(st))
        assert not touched and "desc" not in ast.unparse(st), f"{name}: {ast.unparse(st)!r} before the wait"


def test_the_persistent_gemm_is_launched_without_it(monkeypatch, device):
    """It ran 7-11% slower with it on the H200 (moekit.hopper.pdl); kernels after it still may carry it.
    Where PDL is on, the one-program-per-tile launch passes it and the persistent walk does not."""
    from moekit.hopper.configs import KernelConfig
    from moekit.kernels.align import moe_align_block_size

    assert not fused_moe._PERSISTENT.pdl and fused_moe._GEMM.pdl
    monkeypatch.setattr(pdl, "active", lambda index: True)  # as on a Hopper GPU
    seen = []
    monkeypatch.setattr(L.LeanLauncher, "_plain", lambda self, grid, args, key, consts: seen.append(consts))
    a, w = torch.randn(8, 128, device=device), torch.randn(2, 64, 128, device=device)
    blocks = moe_align_block_size(torch.randint(0, 2, (8, 1), dtype=torch.int32, device=device), 16, 2)
    for persistent in (False, True):  # nothing runs: the launches are only recorded
        cfg = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, persistent=persistent)
        fused_moe.fused_moe_gemm(a, w, torch.empty(8, 1, 64, device=device), blocks, pairs_per_row=1, config=cfg)
    one, walk = seen
    assert one["PDL"] and one["launch_pdl"] and one["META"].NUM_SMS == 0
    assert "PDL" not in walk and "launch_pdl" not in walk and walk["META"].NUM_SMS > 0


@pytest.mark.parametrize("rows, on", [(pdl.MAX_ROWS, True), (pdl.MAX_ROWS + 1, False)])
def test_triton_experts_launch_large_chunks_without_it(monkeypatch, rows, on):
    from moekit.experts.triton import TritonExperts as Book
    from moekit.hopper.experts import HopperTritonExperts

    seen = []
    monkeypatch.setattr(HopperTritonExperts, "_apply", lambda self, call: seen.append(not pdl._OFF.get()) or "triton")
    monkeypatch.setattr(Book, "apply_rows", lambda self, call: seen.append(not pdl._OFF.get()) or "t")  # the book's
    experts = HopperTritonExperts()
    experts.apply(SimpleNamespace(problem=SimpleNamespace(M=rows, topk=1)))
    experts.apply_rows(SimpleNamespace(chunk=SimpleNamespace(size=rows)))
    assert seen == [on, on] and not pdl._OFF.get()


def test_off_on_the_cpu_and_when_disabled(monkeypatch):
    assert not pdl.active(None)
    if moekit.device.interpreting():
        assert not pdl.supported(0)
    monkeypatch.setattr(pdl, "supported", lambda index: True)
    assert pdl.active(0)
    with pdl.disabled():
        assert not pdl.active(0)
    assert pdl.active(0)


class _Fake:
    arg_names = ["x", "BLOCK", "PDL"]
    params = [SimpleNamespace(name="x", is_constexpr=False, default=None),
              SimpleNamespace(name="BLOCK", is_constexpr=True, default=None),
              SimpleNamespace(name="PDL", is_constexpr=True, default=False)]  # fmt: skip
    __name__ = "fake"

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def plain(*args, **consts):
            self.log.append(consts)
            return SimpleNamespace(function="f", packed_metadata="m", run=lambda *a: self.log.append(("direct", a)))

        return plain


def test_the_launcher_passes_the_flag_and_option_and_keys_by_them(monkeypatch):
    monkeypatch.setattr(L, "lean_supported", lambda: True)
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pdl, "supported", lambda index: True)
    token = L._VERIFY.set(False)
    try:
        fake = _Fake()
        launcher = L.LeanLauncher(fake, pdl=True)
        launcher((1,), (3,), key="k", constexprs=lambda: dict(BLOCK=4), stream=(0, 0))
        assert fake.log[-1] == dict(BLOCK=4, PDL=True, launch_pdl=True)
        launcher((1,), (3,), key="k", constexprs=lambda: dict(BLOCK=4), stream=(0, 0))
        assert fake.log[-1][0] == "direct" and fake.log[-1][1][-1] is True  # the PDL constexpr in the tail
        with pdl.disabled():  # another variant: bound again, without the option
            launcher((1,), (3,), key="k", constexprs=lambda: dict(BLOCK=4), stream=(0, 0))
        assert fake.log[-1] == dict(BLOCK=4, PDL=False)
        plain = L.LeanLauncher(_Fake())  # not a PDL launcher: nothing added
        plain((1,), (3,), key="k", constexprs=lambda: dict(BLOCK=4), stream=(0, 0))
        assert plain.fn.log[-1] == dict(BLOCK=4)
    finally:
        L._VERIFY.reset(token)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_the_layer_gives_the_same_bits_with_and_without_it(quant):
    from moekit.hopper.experts import HopperTritonExperts as TritonExperts
    from moekit.hopper.graphed import GraphedKernel
    from moekit.modular_kernel import ModularKernel
    from moekit.prepare_finalize import NoEPPrepareFinalize
    from moekit.testing import assert_close, make_problem
    from moekit.types import QuantScheme

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    assert pdl.supported(torch.cuda.current_device())
    scheme = QuantScheme.FP8_BLOCK if quant == "fp8" else QuantScheme.NONE
    for M in (1, 100, 2000):  # decode (one-program align), the three-kernel align, persistent GEMM tiles
        p = make_problem(M, E=16, topk=4, K=256, N=512, device="cuda", quant=scheme, seed=M)
        for fuse in (False, True):
            kernel = ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=scheme, fuse_activation=fuse),
                                   trace_counts=False)  # fmt: skip
            on = kernel(*p.inputs(), **p.options()).clone()
            with pdl.disabled():
                off = kernel(*p.inputs(), **p.options())
            torch.testing.assert_close(on, off, rtol=0, atol=0)
            assert_close(on, p.reference(), dtype=p.dtype)
    p = make_problem(8, E=16, topk=4, K=256, N=512, device="cuda", quant=scheme)
    make = lambda: ModularKernel(NoEPPrepareFinalize(), TritonExperts(quant=scheme, fuse_activation=True),
                                 trace_counts=False)  # fmt: skip
    with pdl.disabled():
        eager = make()(*p.inputs(), **p.options())
    graphed = GraphedKernel(make())
    for _ in range(3):  # captured with the programmatic edges, then replayed
        torch.testing.assert_close(graphed(*p.inputs(), **p.options()), eager, rtol=0, atol=0)
    assert graphed.last_mode == "replayed"
