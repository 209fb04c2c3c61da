"""op_graphs.repeats_that_differ: the bitwise repeat check the op tests share counts what it should."""

from __future__ import annotations

import numpy as np

from op_graphs import repeats_that_differ


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
