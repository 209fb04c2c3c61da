"""op_graphs.repeats_that_differ: the bitwise repeat check the op tests share counts what it should."""

from __future__ import annotations

import os

import numpy as np

from op_graphs import POISONS, poisons_that_differ, repeats_that_differ


class _Out:
    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def to(self, _device) -> _Out:
        return self

    def to_numpy(self) -> np.ndarray:
        return self.a


class _Drifting:
    """An op whose result for the same inputs moves by one float32 step after every run of other inputs."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.drift = np.float32(0)

    def execute(self, *inputs):
        self.calls.append(inputs[0])
        if inputs[0] == "other":
            self.drift += np.spacing(np.float32(2))
        return [_Out(np.array([1.0, 2.0], np.float32) + self.drift)]


def test_repeats_that_differ_interleaves_and_counts():
    model = _Drifting()
    first, differ = repeats_that_differ(model, ["same"], ["other"], 4)
    assert model.calls == ["same", "same", "other", "same", "same", "other", "same"]
    assert np.array_equal(first[0], [1.0, 2.0]) and differ == 3  # the repeats after the first other
    extra = iter([np.zeros(2), np.zeros(2), np.ones(2)])
    _, differ = repeats_that_differ(_Steady(), ["same"], ["other"], 2, also=lambda: next(extra))
    assert differ == 1  # only the read-back differs, on the second repeat


class _Steady:
    def execute(self, *inputs):
        return [_Out(np.array([3.0], np.float32))]


class _ReadsItsOutput:
    """An op whose second output starts from what its buffer held (GPTOSS_MAX_POISON's byte) when
    that byte is 0x7b or 0xff; its first output is always written."""

    def execute(self, *inputs):
        fill = os.environ.get("GPTOSS_MAX_POISON")
        held = np.float32(1e36) if fill in ("big", "nan") else np.float32(0)
        return [_Out(np.array([1.0], np.float32)), _Out(np.array([2.0], np.float32) + held)]


def test_poisons_that_differ_names_the_fills_that_change_outputs(monkeypatch):
    monkeypatch.setenv("GPTOSS_MAX_POISON", "small")  # the caller's setting comes back afterwards
    assert poisons_that_differ(_ReadsItsOutput(), ["x"]) == ["big", "nan"]
    assert poisons_that_differ(_ReadsItsOutput(), ["x"], outputs=[0]) == []
    assert os.environ["GPTOSS_MAX_POISON"] == "small"
    monkeypatch.delenv("GPTOSS_MAX_POISON")
    assert poisons_that_differ(_Steady(), ["x"]) == [] and "GPTOSS_MAX_POISON" not in os.environ
    assert POISONS == ("zero", "small", "big", "nan")
