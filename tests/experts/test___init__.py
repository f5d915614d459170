"""moekit.experts: the classes by name (lazily imported), and the one registry of short names."""

from __future__ import annotations

import pytest

import moekit
import moekit.experts as experts
from moekit.errors import InvalidInputError
from moekit.experts import BY_NAME, Experts, experts_class


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_every_short_name_builds_its_class(name):
    cls = experts_class(name)
    wing = name == "triton" and moekit.device.is_hopper()  # "triton" is the wing's class on a Hopper GPU
    assert issubclass(cls, Experts) and cls.__name__ == ("HopperTritonExperts" if wing else BY_NAME[name])
    if wing:
        return
    assert cls is getattr(experts, BY_NAME[name])  # the same class as `from moekit.experts import ...`


def test_the_registry_names_standard_format_classes_only():
    assert set(BY_NAME) == {"triton", "hopper", "deep_gemm", "triton_or_deep_gemm", "grouped_mm"}
    assert set(BY_NAME.values()) <= set(experts.__all__)
    assert "NaiveBatchedExperts" not in BY_NAME.values() and "BatchedTritonExperts" not in BY_NAME.values()


def test_unknown_names_are_named_with_the_choices():
    choices = r"\['deep_gemm', 'grouped_mm', 'hopper', 'triton', "
    with pytest.raises(InvalidInputError, match=r"experts must be one of " + choices):
        experts_class("cutlass")
    with pytest.raises(InvalidInputError, match="got 3"):
        experts_class(3)


def test_a_caller_can_offer_a_subset_under_its_own_argument_name():
    book_or_wing = experts.HopperTritonExperts if moekit.device.is_hopper() else experts.TritonExperts
    assert experts_class("triton", among=("triton",)) is book_or_wing
    with pytest.raises(InvalidInputError, match=r"^fp8_experts must be one of \['triton'\], got 'grouped_mm'$"):
        experts_class("grouped_mm", among=("triton",), what="fp8_experts")
    with pytest.raises(InvalidInputError, match=r"among must hold names of moekit.experts.BY_NAME .*got \['cutlass'\]"):
        experts_class("triton", among=("triton", "cutlass"))


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'CutlassExperts'"):
        experts.CutlassExperts  # noqa: B018
