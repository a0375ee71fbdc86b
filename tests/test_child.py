"""The worker's side of a call, in this process: which model a call's settings find."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from trio_infer import errors
from trio_infer.model import Parameters
from trio_infer.repository.settings import ModelSettings
from trio_infer.workers import child


def _settings(name: str, revision: str = "") -> bytes:
    settings = ModelSettings(
        name=name, implementation="trio_infer.examples.models.Dense", revision=revision
    )
    return child.pickled_settings(settings)


def _call(settings: bytes) -> np.ndarray:
    # A copy of the bytes, as each message brings: equal, never the same object.
    outputs = child.predict(
        pickle.loads(pickle.dumps(settings)), {"x": np.ones((1, 256), np.float32)}, Parameters()
    )
    assert isinstance(outputs, dict)
    return outputs["y"]


def test_a_call_finds_its_model_after_calls_of_others_and_not_once_it_is_unloaded() -> None:
    first, second = _settings("child_test_a"), _settings("child_test_b")
    try:
        expected = _call(first)
        np.testing.assert_array_equal(_call(first), expected)
        _call(second)
        np.testing.assert_array_equal(_call(first), expected)
        assert child.unload(first)
        with pytest.raises(errors.Unavailable, match="child_test_a"):
            _call(first)
        np.testing.assert_array_equal(_call(second), expected)  # same weights, seed 0
        assert child.unload(second)
        with pytest.raises(errors.Unavailable, match="child_test_b"):
            _call(second)
        # Loaded again on purpose, it is called again.
        child.load_all([second])
        np.testing.assert_array_equal(_call(second), expected)
    finally:
        child.unload(first)
        child.unload(second)


def test_a_model_reloaded_under_other_settings_is_the_one_its_calls_find() -> None:
    old, new = _settings("child_test_c", "1"), _settings("child_test_c", "2")
    try:
        _call(old)
        loaded = child._models[old]
        _call(new)
        assert child._models[new] is not loaded
        assert child.unload(old)
        _call(new)
        with pytest.raises(errors.Unavailable):
            _call(old)
    finally:
        child.unload(old)
        child.unload(new)
