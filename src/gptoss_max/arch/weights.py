"""Checkpoint -> MAX module names, one explicit map. Validates before renaming."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.graph.type import Shape
from max.graph.weights import WeightData

from gptoss_max import mxfp4
from gptoss_max.checkpoint import BF16, F32, U8, validate
from gptoss_max.config import ModelSpec

_ST_DTYPE = {DType.bfloat16: BF16, DType.float32: F32, DType.uint8: U8}
_PREFIXES = [
    ("model.embed_tokens.", "language_model.embed_tokens."),
    ("model.norm.", "language_model.norm."),
    ("lm_head.", "language_model.lm_head."),
    ("model.layers.", "language_model.layers."),
]
# checkpoint expert suffix -> (our suffix, kind)
_EXPERTS = {
    "gate_up_proj_blocks": ("gate_up_blocks", "blocks"),
    "down_proj_blocks": ("down_blocks", "blocks"),
    "gate_up_proj_scales": ("gate_up_scales", "scales"),
    "down_proj_scales": ("down_scales", "scales"),
    "gate_up_proj_bias": ("gate_up_bias", "f32"),
    "down_proj_bias": ("down_bias", "f32"),
    "gate_up_proj": ("gate_up_weight", "transpose"),
    "down_proj": ("down_weight", "transpose"),
}


def _describe(data: WeightData) -> tuple[tuple[int, ...], str]:
    return tuple(int(d) for d in data.shape), _ST_DTYPE.get(data.dtype, str(data.dtype))


def _rename(name: str) -> str:
    for before, after in _PREFIXES:
        if name.startswith(before):
            return after + name[len(before) :]
    raise KeyError(name)


def _from_numpy(arr: np.ndarray, name: str) -> WeightData:
    return WeightData.from_numpy(np.ascontiguousarray(arr), name)


def _convert(name: str, data: WeightData, dtype: DType, owned: bool = False) -> list[WeightData]:
    """The module's tensors made from one checkpoint tensor: itself converted, and for MXFP4
    scales also their `big` flags (`mxfp4.big_scale_groups`: which 16-row groups hold a scale
    byte above 128, read by the prefill GEMM instead of scanning the scales). `owned`: nothing
    else reads `data`'s memory (a synthetic tensor handed over), so the MXFP4 repack may rewrite
    it in place instead of filling a new array."""
    head, _, suffix = name.rpartition(".")
    if ".mlp.experts" not in head:
        return [dataclasses.replace(data.astype(dtype), name=name)]
    new_suffix, kind = _EXPERTS[suffix]
    new_name = f"{head}.{new_suffix}"
    # MXFP4 experts: into the MoE op's tiled byte order (mxfp4.tile_for_op), same shapes.
    if kind in ("blocks", "scales"):
        arr = np.from_dlpack(data.data)
        in_place = owned and arr.flags.writeable and arr.flags.c_contiguous
        tile = mxfp4.tile_blocks if kind == "blocks" else mxfp4.tile_scales
        arr = tile(arr, in_place=in_place)
        if kind == "blocks":  # [E, rows, nb, 16] -> [E, rows, nb * 16]
            return [_from_numpy(arr.reshape(*arr.shape[:2], -1), new_name)]
        big_name = f"{head}.{new_suffix.removesuffix('scales')}big"
        return [_from_numpy(arr, new_name), _from_numpy(mxfp4.big_scale_groups(arr), big_name)]
    f32 = np.from_dlpack(data.astype(DType.float32).data)
    if kind == "f32":
        return [_from_numpy(f32, new_name)]
    # HF bf16 experts are [E, in, out]; the op wants [E, out, in].
    out = _from_numpy(f32.transpose(0, 2, 1), new_name)
    return [dataclasses.replace(out.astype(dtype), name=new_name)]


def adapt_state_dict(weights: Mapping[str, Any], spec: ModelSpec, dtype: DType) -> dict[str, WeightData]:
    """HF gpt-oss tensors -> our module's state dict, in `dtype` except MXFP4 and biases."""
    datas = {name: w.data() for name, w in weights.items()}
    validate(spec, {name: _describe(d) for name, d in datas.items()})
    out = {}
    owned = {name: isinstance(w, _Generated) for name, w in weights.items()}
    for name in list(datas):  # each source is dropped once converted: a file's repack copies
        for w in _convert(_rename(name), datas.pop(name), dtype, owned[name]):
            out[w.name] = w
    return out


class _Generated:
    def __init__(self, owner: SyntheticWeights, name: str):
        self._owner, self.name = owner, name

    def data(self) -> WeightData:
        return self._owner.take(self.name)

    def exists(self) -> bool:
        return self.name in self._owner.names


class SyntheticWeights:
    """MAX's `Weights` protocol, the part pipelines use (`items()`, then `data()` per tensor), over
    a synthetic model's arrays generated in memory. Each array is handed over once and forgotten,
    so only the module that loads it keeps it alive."""

    def __init__(self, arrays: dict[str, tuple[np.ndarray, str]]):
        self._arrays = arrays
        self.names = frozenset(arrays)

    @classmethod
    def generate(cls, model: Any) -> SyntheticWeights:
        """`model`: a `synthetic.SyntheticModel`."""
        return cls(model.arrays())

    @property
    def name(self) -> str:
        return ""

    def items(self) -> Iterator[tuple[str, _Generated]]:
        for name in sorted(self.names):
            yield name, _Generated(self, name)

    def take(self, name: str) -> WeightData:
        if name not in self._arrays:
            raise KeyError(f"synthetic weight {name} was already handed over (or never existed)")
        arr, dtype = self._arrays.pop(name)
        buf = Buffer.from_numpy(arr)
        if dtype == BF16:
            buf = buf.view(DType.bfloat16)
        return WeightData(buf, name, buf.dtype, Shape(arr.shape))
