"""Float32 dense projections that stay float32 on a GPU.

MAX 26.7 runs a float32 matmul on Hopper's tensor cores as TF32 (its tensor-core wrappers map
float32 operands to `tensor_float32`: 10 mantissa bits, a relative error of ~5e-4 per operand),
while transformers' float32 reference keeps TF32 off. A float32 graph exists here only to be
checked against that reference (tests/test_model_fidelity.py, scripts/gpu_fidelity_full.py), so
its projections must be float32-accurate, not TF32-accurate.

The fix needs no kernel of our own. gpt-oss's dense weights are bf16 in every checkpoint, so W is
exact in TF32; split the activations x = hi + lo with hi = x rounded to bf16 (exact in TF32) and
lo = x - hi (exact in float32, |lo| <= 2^-9 |x|). Then x W^T = hi W^T + lo W^T, where the first
product is exact up to float32 accumulation and the second loses at most TF32's rounding of lo
(11 significant bits, even if truncated: 2^-10 |lo| <= 2^-19 |x| per operand): float32-level
accuracy from two TF32 matmuls. On a CPU (float32 matmuls in float32) the split changes nothing
but costs a second matmul, so only GPU graphs take it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from max.dtype import DType
from max.graph import TensorValue, ops
from max.nn.layer import Module
from max.nn.linear import Linear

from gptoss_max import maxapi


def split_bf16(x: TensorValue) -> tuple[TensorValue, TensorValue]:
    """float32 `x` = hi + lo exactly, hi representable in bf16 (hence in TF32)."""
    hi = ops.cast(ops.cast(x, DType.bfloat16), DType.float32)
    return hi, x - hi


def exact_matmul_t(x: TensorValue, weight: TensorValue) -> TensorValue:
    """`x @ weight.T` for a float32 `x` and a bf16-valued float32 `weight`, float32-accurate on
    hardware that rounds float32 matmul operands to TF32."""
    hi, lo = split_bf16(x)
    w_t = ops.transpose(weight, 0, 1)
    return ops.matmul(hi, w_t) + ops.matmul(lo, w_t)


class ExactF32Linear(Linear):
    """MAX's Linear (no quantization) whose float32 product is split as `exact_matmul_t` does."""

    def __call__(self, x: TensorValue) -> TensorValue:
        if x.dtype != DType.float32 or self.quant_config is not None or self.clip_weight:
            return super().__call__(x)
        out = exact_matmul_t(x, self.weight.to(x.device))
        return out + self.bias.to(out.device) if self.bias is not None else out


class ExactF32StackedLinear(maxapi.StackedLinear):
    """MAX's StackedLinear (q, k, v as one product), split the same way."""

    def __call__(self, x: TensorValue) -> TensorValue:
        if x.dtype != DType.float32 or self._quant_config is not None or self._clip_weight:
            return super().__call__(x)
        out = exact_matmul_t(x, self.stacked_weight.to(x.device))
        bias = self.stacked_bias
        return out + bias.to(out.device) if bias is not None else out


_REPLACEMENT = {Linear: ExactF32Linear, maxapi.StackedLinear: ExactF32StackedLinear}


def reachable_modules(root: Module) -> Iterator[Module]:
    """Every Module reachable from `root` through attributes, lists and tuples, each once: the
    sublayers and also the per-device shards (`*_shards`, `distributed_linear_layers`), which MAX
    keeps as plain lists and calls in the forward pass instead of the module they came from."""
    seen: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
            continue
        if not isinstance(obj, Module) or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        stack.extend(vars(obj).values())


def use_exact_f32_projections(root: Module) -> int:
    """Turn every plain Linear / StackedLinear reachable from `root` into its exact-float32
    subclass (in place; weights and names untouched). Returns how many were changed."""
    changed = 0
    for module in reachable_modules(root):
        new = _REPLACEMENT.get(type(module))
        if new is not None:
            module.__class__ = new
            changed += 1
    return changed
