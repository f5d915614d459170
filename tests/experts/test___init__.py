"""moekit.experts: the classes by name, imported on first use (none of them the wing's)."""

from __future__ import annotations

import pytest

import moekit.experts as experts
from moekit.experts import Experts


@pytest.mark.parametrize("name", [n for n in experts.__all__ if n != "Experts"])
def test_every_class_loads_on_first_use(name):
    cls = getattr(experts, name)
    assert issubclass(cls, Experts) and cls.__name__ == name


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'CutlassExperts'"):
        experts.CutlassExperts  # noqa: B018
