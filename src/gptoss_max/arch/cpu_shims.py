"""What MAX 26.7's gpt_oss needs to run on a CPU. Each shim: one line of why; CPU only.

Applied by `gptoss_max.arch` when the model's devices are all CPUs, in whichever
process builds the graph (the CLI's or MAX's model worker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from max.graph import BufferValue, TensorValue

from gptoss_max import maxapi


class SingleDeviceAllreduce:
    """Why: MAX's Allreduce constructs an Accelerator even for one device, which fails without a GPU."""

    def __init__(self, num_accelerators: int) -> None:
        if num_accelerators != 1:
            raise ValueError("more than one CPU device is not a configuration MAX supports")

    def __call__(self, inputs: Iterable[TensorValue], signal_buffers: Iterable[BufferValue]) -> list[TensorValue]:
        return list(inputs)


@contextlib.contextmanager
def cpu_model_construction() -> Iterator[None]:
    """Swap MAX's Allreduce for the single-device one while the stock block is built."""
    saved = maxapi.stock_block_module.Allreduce
    maxapi.stock_block_module.Allreduce = SingleDeviceAllreduce  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        maxapi.stock_block_module.Allreduce = saved  # type: ignore[misc]
