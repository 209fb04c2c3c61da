"""Shared by the op tests: which devices to run on, and one op graph built and loaded there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
