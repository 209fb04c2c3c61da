"""The Hugging Face gpt-oss checkpoint layout: expected tensors, validation, a safetensors writer.

MXFP4 experts stay a (blocks, scales) pair of uint8 tensors; nothing here upcasts them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from gptoss_max.config import ModelSpec

BF16, U8, F32 = "BF16", "U8", "F32"
Tensor = tuple[tuple[int, ...], str]


class CheckpointError(ValueError):
    """A checkpoint does not match the gpt-oss layout; the message names the tensor."""


def expected_tensors(spec: ModelSpec, mxfp4_experts: bool) -> dict[str, Tensor]:
    """Every tensor of a HF gpt-oss checkpoint: name -> (shape, safetensors dtype)."""
    h, i, e, v = spec.hidden_size, spec.intermediate_size, spec.num_local_experts, spec.vocab_size
    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": ((v, h), BF16),
        "model.norm.weight": ((h,), BF16),
        "lm_head.weight": ((v, h), BF16),
    }
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}."
        out.update(
            {
                p + "input_layernorm.weight": ((h,), BF16),
                p + "post_attention_layernorm.weight": ((h,), BF16),
                p + "self_attn.q_proj.weight": ((spec.q_dim, h), BF16),
                p + "self_attn.q_proj.bias": ((spec.q_dim,), BF16),
                p + "self_attn.k_proj.weight": ((spec.kv_dim, h), BF16),
                p + "self_attn.k_proj.bias": ((spec.kv_dim,), BF16),
                p + "self_attn.v_proj.weight": ((spec.kv_dim, h), BF16),
                p + "self_attn.v_proj.bias": ((spec.kv_dim,), BF16),
                p + "self_attn.o_proj.weight": ((h, spec.q_dim), BF16),
                p + "self_attn.o_proj.bias": ((h,), BF16),
                p + "self_attn.sinks": ((spec.num_attention_heads,), BF16),
                p + "mlp.router.weight": ((e, h), BF16),
                p + "mlp.router.bias": ((e,), BF16),
                p + "mlp.experts.gate_up_proj_bias": ((e, 2 * i), BF16),
                p + "mlp.experts.down_proj_bias": ((e, h), BF16),
            }
        )
        if mxfp4_experts:
            out.update(
                {
                    p + "mlp.experts.gate_up_proj_blocks": ((e, 2 * i, h // 32, 16), U8),
                    p + "mlp.experts.gate_up_proj_scales": ((e, 2 * i, h // 32), U8),
                    p + "mlp.experts.down_proj_blocks": ((e, h, i // 32, 16), U8),
                    p + "mlp.experts.down_proj_scales": ((e, h, i // 32), U8),
                }
            )
        else:
            out.update(
                {
                    p + "mlp.experts.gate_up_proj": ((e, h, 2 * i), BF16),
                    p + "mlp.experts.down_proj": ((e, i, h), BF16),
                }
            )
    return out


def has_mxfp4_experts(names: set[str] | Mapping[str, object]) -> bool:
    return any(n.endswith("gate_up_proj_blocks") for n in names)


def validate(spec: ModelSpec, found: Mapping[str, Tensor]) -> bool:
    """Raise CheckpointError naming every missing, extra, mis-shaped or wrong-dtype tensor.

    Returns whether the experts are MXFP4.
    """
    mxfp4 = has_mxfp4_experts(found)
    want = expected_tensors(spec, mxfp4)
    problems = [f"missing tensor {n}" for n in want if n not in found]
    problems += [f"unexpected tensor {n}" for n in found if n not in want]
    for name, (shape, dtype) in want.items():
        if name not in found:
            continue
        got_shape, got_dtype = found[name]
        if tuple(got_shape) != shape:
            problems.append(f"tensor {name} has shape {tuple(got_shape)}, expected {shape}")
        allowed = {dtype, F32} if dtype == BF16 else {dtype}
        if got_dtype not in allowed:
            problems.append(f"tensor {name} has dtype {got_dtype}, expected {dtype}")
    if problems:
        raise CheckpointError("; ".join(problems))
    return mxfp4


def _read_header(fh) -> tuple[dict, int]:
    """A safetensors header and the offset where tensor data starts."""
    (n,) = struct.unpack("<Q", fh.read(8))
    return json.loads(fh.read(n)), 8 + n


def read_index(model_dir: Path) -> dict[str, Tensor]:
    """Shapes and dtypes of every tensor in a directory's safetensors files (headers only)."""
    found: dict[str, Tensor] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    for f in files:
        with open(f, "rb") as fh:
            header, _ = _read_header(fh)
        for name, meta in header.items():
            if name != "__metadata__":
                found[name] = (tuple(meta["shape"]), meta["dtype"])
    return found


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + 0x7FFF + ((u >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def safetensors_header(
    entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> tuple[bytes, int]:
    """The bytes before the data of a safetensors file holding `(name, dtype, shape, nbytes)` in
    order (length prefix + JSON header padded to 8), and the data's total size."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, offset


def save_safetensors(path: Path, tensors: Mapping[str, tuple[np.ndarray, str]]) -> None:
    """Write `name -> (array, dtype)`; BF16 arrays are given as float32 and rounded here."""
    blobs = {
        name: (to_bf16_bits(arr) if dtype == BF16 else np.ascontiguousarray(arr))
        for name, (arr, dtype) in tensors.items()
    }
    entries = [(name, dtype, arr.shape, blobs[name].nbytes) for name, (arr, dtype) in tensors.items()]
    head, _ = safetensors_header(entries)
    with open(path, "wb") as fh:
        fh.write(head)
        for raw in blobs.values():
            fh.write(raw.tobytes())


_NP_DTYPES = {BF16: np.uint16, U8: np.uint8, F32: np.float32}


def load_tensor(path: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file as NumPy (BF16 widened exactly to float32)."""
    with open(path, "rb") as fh:
        header, data_start = _read_header(fh)
        meta = header[name]
        start, end = meta["data_offsets"]
        fh.seek(data_start + start)
        raw = np.frombuffer(fh.read(end - start), dtype=_NP_DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return from_bf16_bits(raw) if meta["dtype"] == BF16 else raw
