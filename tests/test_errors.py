"""moekit.errors: one base class, and the builtin exception each named error also is."""

from __future__ import annotations

import inspect

import pytest

from moekit import errors

ARGUMENT_ERRORS = ["InvalidInputError", "InvalidIdsError", "ChunkSizeError", "QuantizationError",
                   "UnsupportedModelError"]  # fmt: skip
RUNTIME_ERRORS = ["WorkspaceShapeError", "CapacityError", "StaleMetadataError", "BackendUnavailableError",
                  "DistributedError"]  # fmt: skip


@pytest.mark.parametrize("name", errors.__all__)
def test_every_exported_error_is_a_moekit_error(name):
    cls = getattr(errors, name)
    assert isinstance(cls, type) and issubclass(cls, errors.MoekitError)
    with pytest.raises(errors.MoekitError, match="what came"):
        raise cls("what came")


@pytest.mark.parametrize("name", ARGUMENT_ERRORS)
def test_argument_errors_are_value_errors(name):
    assert issubclass(getattr(errors, name), ValueError)
    with pytest.raises(ValueError):
        raise getattr(errors, name)("bad argument")


def test_ids_errors_are_input_errors():
    assert issubclass(errors.InvalidIdsError, errors.InvalidInputError)


def test_format_mismatch_is_a_type_error():
    assert issubclass(errors.FormatMismatchError, TypeError)
    assert not issubclass(errors.FormatMismatchError, ValueError)


@pytest.mark.parametrize("name", RUNTIME_ERRORS)
def test_runtime_errors_are_runtime_errors(name):
    cls = getattr(errors, name)
    assert issubclass(cls, RuntimeError) and not issubclass(cls, ValueError)


def test_optional_dependency_is_an_import_error():
    assert issubclass(errors.OptionalDependencyError, ImportError)
    with pytest.raises(ImportError, match="moekit\\[hf\\]"):
        raise errors.OptionalDependencyError("pip install 'moekit[hf]'")


def test_all_lists_every_error_defined_in_the_module():
    defined = {
        name
        for name, value in inspect.getmembers(errors, inspect.isclass)
        if value.__module__ == errors.__name__ and issubclass(value, errors.MoekitError)
    }
    assert sorted(errors.__all__) == sorted(defined)
    others = {"MoekitError", "FormatMismatchError", "OptionalDependencyError", "ExerciseFailed"}
    assert set(ARGUMENT_ERRORS) | set(RUNTIME_ERRORS) | others == defined


def test_a_failed_exercise_is_an_assertion_error():
    assert issubclass(errors.ExerciseFailed, AssertionError)
    with pytest.raises(AssertionError, match="expected"):
        raise errors.ExerciseFailed("chunk_plan(M=1, C=3) gave []; expected [(0, 1)]")
