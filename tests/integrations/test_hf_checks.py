"""moekit.integrations.hf_checks: which transformers experts modules moekit runs, and why not the others.

Each test builds a tiny experts class with transformers' own ``@use_experts_implementation``
(8 experts, H=64, I=32) and changes one thing about it.
"""

from __future__ import annotations

import types

import pytest
import torch

# moekit first: on a CPU it turns Triton's interpreter on before transformers imports Triton.
import moekit  # noqa: F401
from moekit.errors import UnsupportedModelError
from moekit.integrations.hf_checks import check_module, is_experts
from moekit.quant import FP8
from moekit.testing import expect_raises

pytest.importorskip("transformers")

from transformers.integrations.moe import use_experts_implementation

pytestmark = pytest.mark.hf

E, H, I = 8, 64, 32
CONFIG = types.SimpleNamespace(_experts_implementation="eager")
SILU = torch.nn.SiLU()


class _Experts(torch.nn.Module):
    def __init__(self, config, *, act=SILU, dtype=torch.float32, w1_shape=(E, 2 * I, H)):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(w1_shape).to(dtype))
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, I).to(dtype))
        self.act_fn = act

    def forward(self, hidden, ids, weights):
        return hidden


GatedSiLU = use_experts_implementation(type("GatedSiLU", (_Experts,), {}))
Biased = use_experts_implementation(type("Biased", (_Experts,), {}), has_bias=True)
Interleaved = use_experts_implementation(type("Interleaved", (_Experts,), {}), is_concatenated=False)
Transposed = use_experts_implementation(type("Transposed", (_Experts,), {}), is_transposed=True)
Ungated = use_experts_implementation(type("Ungated", (_Experts,), {}), has_gate=False)
OwnGate = use_experts_implementation(type("OwnGate", (_Experts,), {"_apply_gate": lambda self, x: x}))


def test_gated_silu_experts_pass():
    module = GatedSiLU(CONFIG)
    assert is_experts(module)
    check_module(module)  # raises on any problem
    check_module(GatedSiLU(CONFIG, act=torch.nn.functional.silu, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "cls, reason",
    [
        (Biased, "add biases to gate_up_proj/down_proj"),
        (Interleaved, r"interleaves gate and up rows \(g0, u0"),
        (Transposed, r"stored transposed \(gate_up_proj \[E, H, 2I\]\)"),
        (Ungated, r"not gated \(up_proj, then SiLU"),
        (OwnGate, r"its own gating \(OwnGate._apply_gate"),
    ],
)
def test_each_layout_moekit_cannot_run_is_named(cls, reason):
    with expect_raises(UnsupportedModelError, match=reason) as caught:
        check_module(cls(CONFIG))
    assert "experts_implementation='eager' or 'grouped_mm'" in caught.message


def test_a_bias_parameter_is_refused_even_without_the_flag():
    module = GatedSiLU(CONFIG)
    module.down_proj_bias = torch.nn.Parameter(torch.randn(E, H))
    with expect_raises(UnsupportedModelError, match="biases"):
        check_module(module)


@pytest.mark.parametrize("act, name", [(torch.nn.GELU(), "GELU"), (torch.tanh, "tanh"), (None, "None")])
def test_an_activation_other_than_silu_is_named(act, name):
    with expect_raises(UnsupportedModelError, match=f"its activation is {name}, not SiLU"):
        check_module(GatedSiLU(CONFIG, act=act))


def test_an_activation_is_judged_by_what_it_computes():
    check_module(GatedSiLU(CONFIG, act=lambda x: x * torch.sigmoid(x)))
    with expect_raises(UnsupportedModelError, match="its activation is <lambda>, not SiLU"):
        check_module(GatedSiLU(CONFIG, act=lambda x: 2 * x * torch.sigmoid(x)))


def test_quantized_or_misshapen_weights_are_refused():
    with expect_raises(UnsupportedModelError, match="expected unquantized 3-D float tensors"):
        check_module(GatedSiLU(CONFIG, dtype=FP8))
    with expect_raises(UnsupportedModelError, match=r"gate_up_proj \(8, 63, 64\).*not \[E, 2I, H\]"):
        check_module(GatedSiLU(CONFIG, w1_shape=(E, 2 * I - 1, H)))
    with expect_raises(UnsupportedModelError, match=r"gate_up_proj \(8, 66, 64\), down_proj \(8, 64, 32\)"):
        check_module(GatedSiLU(CONFIG, w1_shape=(E, 2 * I + 2, H)))


def test_every_reason_is_given_and_the_layer_is_named():
    both = use_experts_implementation(type("Both", (_Experts,), {}), has_bias=True, is_transposed=True)(CONFIG)
    with expect_raises(UnsupportedModelError, match=r"^layers.3.experts \(Both\) cannot run.*biases.*; .*transposed"):
        check_module(both, name="layers.3.experts")


def test_is_experts_needs_what_the_decorator_sets():
    assert is_experts(GatedSiLU(CONFIG)) and is_experts(Ungated(CONFIG))
    assert not is_experts(_Experts(CONFIG)) and not is_experts(torch.nn.Linear(4, 4))
