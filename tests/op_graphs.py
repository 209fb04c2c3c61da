"""Shared by the op tests: which devices to run on, one op graph built and loaded there, and the
bitwise repeat check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def op_devices() -> list[str]:
    """`cpu`, and `gpu` where one is present."""
    from max.driver import accelerator_count

    return ["cpu", "gpu"] if accelerator_count() > 0 else ["cpu"]


def load_op_graph(kind: str, name: str, forward: Callable[..., Any], types: Callable[[Any], list[Any]]):
    """(device, loaded model) of `Graph(f"{name}_{kind}", forward, types(device_ref))` on `kind`."""
    from max.driver import CPU, Accelerator
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph

    device = Accelerator() if kind == "gpu" else CPU()
    graph = Graph(f"{name}_{kind}", forward=forward, input_types=types(DeviceRef.from_device(device)))
    return device, InferenceSession(devices=[device]).load(graph)


def skip_past_gpu_bound(kind: str, tokens: int, bound: int) -> None:
    """GPU paths of the decode ops take at most `bound` tokens by design (the model dispatches
    larger steps elsewhere): such cases run on the CPU only."""
    import pytest

    if kind == "gpu" and tokens > bound:
        pytest.skip(f"the GPU path takes T <= {bound} by design; the model dispatches larger steps")


def host_outputs(model: Any, inputs: list[Any]) -> list[np.ndarray]:
    """`model.execute(*inputs)`'s outputs as host NumPy arrays."""
    from max.driver import CPU

    return [o.to(CPU()).to_numpy() for o in model.execute(*inputs)]


def repeats_that_differ(
    model: Any, same: list[Any], other: list[Any], repeats: int, also: Callable[[], np.ndarray] | None = None
) -> tuple[list[np.ndarray], int]:
    """Bitwise repeatability: `model` on the inputs `same` once, then `repeats` times more, with the
    inputs `other` through it before every second repeat. `also()`: one more result read after each
    run of `same` (a buffer the op updates in place). (The first results, how many of the repeats
    did not equal them bit for bit.)"""

    def run() -> list[np.ndarray]:
        out = host_outputs(model, same)
        return [*out, also()] if also is not None else out

    first = run()
    differ = 0
    for r in range(repeats):
        if r % 2:
            model.execute(*other)
        differ += any(not np.array_equal(a, b) for a, b in zip(first, run(), strict=True))
    return first, differ


POISONS = ("zero", "small", "big", "nan")  # GPTOSS_MAX_POISON's fills (kernels/poison.mojo)


def poisons_that_differ(model: Any, inputs: list[Any], outputs: list[int] | None = None) -> list[str]:
    """Which of GPTOSS_MAX_POISON's fills change `model`'s outputs (those at `outputs`, else all):
    each op of ours fills its outputs with that byte before it runs, so an op that reads an output
    (or its scratch) before writing it shows here, where a repeat does not (MAX gives a repeat the
    same leftovers). Empty: the outputs are the same bits under every fill."""
    import os

    def pick(out: list[np.ndarray]) -> list[np.ndarray]:
        return out if outputs is None else [out[i] for i in outputs]

    saved = os.environ.pop("GPTOSS_MAX_POISON", None)
    try:
        plain = pick(host_outputs(model, inputs))
        differ = []
        for fill in POISONS:
            os.environ["GPTOSS_MAX_POISON"] = fill
            got = pick(host_outputs(model, inputs))
            if any(not np.array_equal(a, b) for a, b in zip(plain, got, strict=True)):
                differ.append(fill)
        return differ
    finally:
        os.environ.pop("GPTOSS_MAX_POISON", None)
        if saved is not None:
            os.environ["GPTOSS_MAX_POISON"] = saved
