"""moekit.hopper.launch: the lean launch path. On a CPU (the interpreter) it is off and every launch is
Triton's plain one; its bookkeeping is tested here with a stand-in jit function, and on a GPU every
test runs with :func:`verifying` on (tests/conftest.py), which checks each key against Triton's binder."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton

import moekit
from moekit.hopper import launch as L


class FakeCompiled:
    def __init__(self, log):
        self.function, self.packed_metadata, self.log = "fn", "meta", log
        self.run = lambda *a: log.append(("direct", a))


class FakeJit:
    """Three runtime parameters then two compile-time ones, as the kernels lay them out."""

    arg_names = ["x", "y", "n", "BLOCK", "FLAG"]
    params = [SimpleNamespace(name=n, is_constexpr=c, default=d)
              for n, c, d in (("x", False, None), ("y", False, None), ("n", False, None), ("BLOCK", True, None),
                              ("FLAG", True, 7))]  # fmt: skip
    __name__ = "fake"

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def plain(*args, **consts):
            self.log.append(("plain", grid, args, consts))
            return FakeCompiled(self.log)

        return plain


@pytest.fixture
def lean(monkeypatch):
    monkeypatch.setattr(L, "lean_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    token = L._VERIFY.set(False)  # on a GPU the suite verifies every launch; these stand-ins cannot be
    yield
    L._VERIFY.reset(token)


def test_off_under_the_interpreter_and_for_unread_versions(monkeypatch):
    if moekit.device.interpreting():
        assert not L.lean_supported()
    monkeypatch.setattr(L, "interpreting", lambda: False)
    for version, ok in (("3.5.1", False), ("3.6.0", True), ("3.9.0", True), ("3.10.0", False), ("3.6.0+git1", True)):
        monkeypatch.setattr(triton, "__version__", version)
        assert L.lean_supported() is ok, version


def test_the_first_launch_of_a_key_binds_later_ones_go_direct(lean):
    fn = FakeJit()
    launcher = L.LeanLauncher(fn)
    for _ in range(3):
        launcher((4,), ("a", "b", 5), key=("k",), constexprs=lambda: dict(BLOCK=16, num_warps=4), stream=(0, 99))
    kinds = [entry[0] for entry in fn.log]
    assert kinds == ["plain", "direct", "direct"]
    _, args = fn.log[1]
    # grid padded to 3-D, the stream, the handles, no metadata or hooks, runtime args, then the
    # compile-time ones in signature order (a default where none was given)
    assert args == (4, 1, 1, 99, "fn", "meta", None, None, None, "a", "b", 5, 16, 7)


def test_a_new_key_binds_again_and_keys_are_bounded(lean, monkeypatch):
    fn = FakeJit()
    launcher = L.LeanLauncher(fn)
    monkeypatch.setattr(L, "_MAX_KEYS", 2)
    for key in ("a", "b", "c", "a"):
        launcher((1,), (1, 2, 3), key=key, constexprs=lambda: dict(BLOCK=16), stream=(0, 1))
    assert [e[0] for e in fn.log] == ["plain", "plain", "plain", "plain"]  # "a" was forgotten at the bound
    launcher((1,), (1, 2, 3), key="a", constexprs=lambda: dict(BLOCK=16), stream=(0, 1))
    assert fn.log[-1][0] == "direct"


def test_another_device_or_a_launch_hook_takes_the_plain_path(lean, monkeypatch):
    fn = FakeJit()
    launcher = L.LeanLauncher(fn)
    launcher((1,), (1, 2, 3), key="k", constexprs=lambda: dict(BLOCK=16), stream=(0, 1))
    launcher((1,), (1, 2, 3), key="k", constexprs=lambda: dict(BLOCK=16), stream=(1, 5))  # kept for device 0
    chain = triton.knobs.runtime.launch_enter_hook
    monkeypatch.setattr(chain, "calls", [lambda *a: None])  # a profiler listens
    launcher((1,), (1, 2, 3), key="k", constexprs=lambda: dict(BLOCK=16), stream=(0, 1))
    assert [e[0] for e in fn.log] == ["plain", "plain", "plain"]


def test_kernels_whose_compile_time_parameters_are_not_last_stay_plain(lean):
    fn = FakeJit()
    fn.params = [fn.params[3], *fn.params[:3], fn.params[4]]  # a constexpr first
    launcher = L.LeanLauncher(fn)
    for _ in range(2):
        launcher((1,), (1, 2, 3), key="k", constexprs=lambda: dict(BLOCK=16), stream=(0, 1))
    assert [e[0] for e in fn.log] == ["plain", "plain"]


def test_verifying_catches_a_key_that_misses_a_specialization(lean, monkeypatch):
    fn = FakeJit()
    launcher = L.LeanLauncher(fn)
    launcher((1,), (1, 2, 3), key="k", constexprs=lambda: dict(BLOCK=16), stream=(0, 1))
    other = object()
    # Triton's binder would pick another compiled variant for these arguments.
    fn.debug = False
    fn.device_caches = {0: ({"the-key": other}, {}, None, None, lambda *a, **k: (None, ["spec"], {}))}
    import sys

    monkeypatch.setattr("triton.runtime.jit.compute_cache_key", lambda cache, spec, opts: "the-key")
    monkeypatch.setattr(sys.modules["triton.runtime.driver"], "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: 0)))  # fmt: skip
    with L.verifying(), pytest.raises(L.LaunchKeyError, match="fake: the launch key selected a variant"):
        launcher((1,), (1, 2, 3), key="k", constexprs=lambda: dict(BLOCK=16), stream=(0, 1))
    launcher((1,), (1, 2, 3), key="k", constexprs=lambda: dict(BLOCK=16), stream=(0, 1))  # not verifying: trusted
    assert fn.log[-1][0] == "direct"


def test_int_spec_follows_tritons_classes():
    assert [L.int_spec(v) for v in (1, 16, 32, 7, 0, 2**31, -(2**31) - 1)] == [1, 16, 16, 0, 16, 80, 64]


def test_a_book_launch_runs_lean_with_the_same_result(device):
    """run_lean launches what a book launcher worked out (here the count kernel's launch) and gives
    what the book's own plain launch gives; its key tells apart what Triton specializes on."""
    from moekit.kernels.count import count_launch

    ids = torch.randint(-1, 9, (37, 4), device=device, dtype=torch.int32)
    for _ in range(2):  # the second run takes the kept variant (on a GPU)
        lean_out, launch = count_launch(ids, 8)
        L.run_lean(launch)
        book_out, book_launch = count_launch(ids, 8)
        book_launch.run()
        assert torch.equal(lean_out, book_out) and int(book_out.sum()) == int(((ids >= 0) & (ids < 8)).sum())
    t = torch.zeros(4, dtype=torch.float32)
    base = L.launch_key((t, None, 16, 3), {"B": 1})
    assert base != L.launch_key((t.half(), None, 16, 3), {"B": 1})  # dtype
    assert base != L.launch_key((torch.zeros(8)[1:5], None, 16, 3), {"B": 1})  # alignment
    assert base != L.launch_key((t, t, 16, 3), {"B": 1})  # None against a tensor
    assert base != L.launch_key((t, None, 1, 3), {"B": 1})  # an int's class
    assert base == L.launch_key((t, None, 32, 5), {"B": 1}) and base != L.launch_key((t, None, 16, 3), {"B": 2})


def _builders():
    from moekit.kernels.tma import gate_up_descriptor, tma_descriptor, weight_descriptor

    w = torch.randn(3, 64, 32, dtype=torch.bfloat16)
    return [(weight_descriptor, w, [16, 32]), (gate_up_descriptor, w, [1, 16, 2, 32]),
            (tma_descriptor, torch.randn(40, 32), [8, 32])]  # fmt: skip


def test_a_kept_descriptor_is_a_fresh_one_without_its_tensor(monkeypatch):
    """kept_descriptor: what the builder gives, once per contents (device, address, dtype, shape,
    strides, box), with a base that keeps no tensor alive."""
    import weakref

    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "_DESCRIPTORS", {})
    for build, t, box in _builders():
        fresh, kept = build(t, box), L.kept_descriptor(build, t, box)
        assert (kept.shape, kept.strides, kept.block_shape, kept.padding) == (
            fresh.shape, fresh.strides, fresh.block_shape, fresh.padding)  # fmt: skip
        assert type(kept.base) is L._Address and (kept.base.data_ptr(), kept.base.dtype) == (t.data_ptr(), t.dtype)
        assert L.kept_descriptor(build, t.detach(), box) is kept  # another tensor, the same contents
        assert L.kept_descriptor(build, t, [b * 2 if b > 2 else b for b in box]) is not kept  # another box
        other = t.clone()
        assert L.kept_descriptor(build, other, box).base.data_ptr() == other.data_ptr()  # another address
    w = torch.randn(3, 64, 32, dtype=torch.bfloat16)
    alive = weakref.ref(w)
    from moekit.kernels.tma import weight_descriptor

    assert L.kept_descriptor(weight_descriptor, w[:, :, :16], [16, 16]) is None  # not TMA-readable
    L.kept_descriptor(weight_descriptor, w, [16, 32])
    del w
    assert alive() is None  # the kept descriptors hold no tensor
    monkeypatch.setattr(L, "_MAX_KEYS", len(L._DESCRIPTORS))
    L.kept_descriptor(weight_descriptor, torch.randn(2, 16, 32), [16, 32])
    assert len(L._DESCRIPTORS) == 1  # bounded: full, forgotten, then the new one


def test_tritons_launcher_reads_a_kept_descriptor_as_a_fresh_one(monkeypatch):
    """What a compiled launch does with a descriptor argument (Triton's NVIDIA driver, the installed
    version: specialize it, then encode a tensor map from base.data_ptr(), shape and strides) gives
    the same for a kept descriptor as for a fresh one (the encoding itself is stood in for)."""
    import inspect

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.backends.nvidia import driver as nvidia
    from triton.runtime import driver

    encoded = []
    utils = SimpleNamespace(fill_tma_descriptor_tiled=lambda *a: encoded.append(a) or len(encoded))
    utils.fill_tma_descriptor = utils.fill_tma_descriptor_tiled  # (the name in Triton 3.6)
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "_DESCRIPTORS", {})
    extra = [None] * (len(inspect.signature(nvidia.make_tensordesc_arg).parameters) - 2)
    monkeypatch.setattr(driver, "_active", SimpleNamespace(utils=utils))  # (restored after the test)
    for build, t, box in _builders():
        fresh, kept = build(t, box), L.kept_descriptor(build, t, box)
        spec = [native_specialize_impl(BaseBackend, d, False, True, True) for d in (fresh, kept)]
        assert spec[0] == spec[1] and spec[0][0].startswith("tensordesc<")
        meta = dict(swizzle=128, elem_size=t.element_size(), elem_type=1, block_size=box, fp4_padded=False)
        args = [nvidia.make_tensordesc_arg(d, meta, *extra) for d in (fresh, kept)]
        assert args[0][1:] == args[1][1:] and encoded[-2] == encoded[-1] and encoded[-1][0] == t.data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["weights", "gate_up", "rows"])
def test_kept_descriptors_read_what_is_at_their_address_now(device, mode):
    """On a GPU each TMA descriptor the GEMM takes (the weights; gate and up interleaved; a row chunk's
    activations read by position, one buffer per chunk) gives bit for bit what descriptors built on the
    tensors give, also after the tensors at the kept addresses were overwritten."""
    from moekit.hopper import grouped_gemm as G
    from moekit.hopper.configs import KernelConfig
    from moekit.hopper.gemm_args import GatedOutput, RowWindow
    from moekit.kernels.align import moe_align_block_size

    M, K, N, E, topk = 37, 128, 192, 4, 2
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, tma=True, interleave=mode == "gate_up")
    ids = torch.randint(0, E, (M, topk), device=device)
    blocks = moe_align_block_size(ids, 16, E, keep_empty=True)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, **bf16)
    if mode == "rows":  # GEMM2 of 16-row chunks, each reading its own [16, K] buffer by position
        chunks = [RowWindow(s, s + 16, read="position") for s in range(0, blocks.sorted_token_ids.numel(), 16)]
        inputs = [torch.randn(16, K, **bf16) for _ in chunks]
    else:
        chunks, inputs = [None], [torch.randn(M, K, **bf16)]
    width, ppr = (N // 2 if mode == "gate_up" else N), (1 if mode == "rows" else topk)

    def run():
        out = torch.zeros(M, topk, width, **bf16)
        for chunk, a in zip(chunks, inputs, strict=True):
            gated = GatedOutput() if mode == "gate_up" else None
            G.fused_moe_gemm(a, w, out, blocks, pairs_per_row=ppr, config=cfg, gated=gated, chunk=chunk)
        return out

    for _ in range(2):
        kept = run()
        with pytest.MonkeyPatch.context() as patch:  # descriptors built afresh, on the tensors
            patch.setattr(G, "kept_descriptor", lambda build, t, box: build(t, box))
            fresh = run()
        assert torch.equal(kept, fresh) and kept.abs().sum() > 0
        for t in (w, *inputs):  # the same addresses, new contents
            t.copy_(torch.randn_like(t))
