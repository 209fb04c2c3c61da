"""Synthetic gpt-oss: the real configs with random weights of realistic distributions.

`synthetic:<preset>[,seed=N][,experts=mxfp4|bf16][,layers=N]` names such a model wherever a
model is taken (`SyntheticModel.parse`). Every tensor is a pure function of (seed, tensor
name, chunk index): uniform 16-bit draws (PCG64) mapped through a 65,536-entry table, the
inverse CDF of that tensor's distribution. So generation runs at memory speed on every core,
is deterministic by seed whatever the thread order, and can stream chunk by chunk:

- dense tensors (attention, router, norms, embeddings, LM head, biases, sinks): bf16
  N(mean, std), quantiles of the normal distribution (tails cut at 4.3 std);
- MXFP4 experts: E8M0 scales, and e2m1 codes conditioned on their block's scale, drawn from
  the joint statistics of `mxfp4.encode` over N(0, std) weights, so dequantized experts have
  the magnitude and the per-block scale spread of quantized trained weights;
- stds scale with 1/sqrt(fan-in), so any width sees the same activations: q/k give attention
  logits of std ~1.4, sinks are N(3, 2), and router logits N(0, 1.7) (+ bias N(0, 0.2))
  spread tokens over all experts, as a trained router with a balance loss does;
- conditioned like a trained model, not chaotic: embeddings N(0, 3) make the residual stream
  large next to each layer's update, and attention logits stay ~1.4 units. Generator 2 (q/k std
  2.3 / sqrt(h), attention logits ~5 units; embeddings N(0, 1)) amplified any perturbation ~1.4x
  per layer and its bf16 routing flips cascaded: transformers' own bf16 run agreed with its
  float64 run to cos 0.37 at 24 layers (float32: cos min 0.978), so no fidelity check at full
  depth could tell a bug from rounding. Measurements: docs/GPU.md (issue 9) and
  scripts/synthetic_precision.py.

Three ways out: in memory (`generate_arrays`, what the architecture loads instead of reading
files), an HF checkpoint (`write_checkpoint`: safetensors shards + index, streamed, bounded
RAM), and `SyntheticModel.materialize`: the directory MAX's pipeline is pointed at, with
config.json, tokenizer and a header-only `model.safetensors` whose data region is a hole of
the full size (a sparse file, as MAX's own header-only stubs): MAX's weight discovery and
memory planning see a real checkpoint, and the weights are generated in memory instead.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import sys
import time
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from gptoss_max import mxfp4, settings
from gptoss_max.checkpoint import BF16, U8, expected_tensors, safetensors_header, to_bf16_bits
from gptoss_max.config import PRESETS, ModelSpec

PREFIX = "synthetic:"
MARKER = "gptoss_max_synthetic"  # config.json key naming the synthetic model a directory stands for
GENERATOR = 3  # bump whenever a tensor's values change for the same seed
CHUNK = 1 << 20  # units (elements; blocks of 32 for MXFP4) per chunk: part of the generator's definition
SHARD_BYTES = 5 * 10**9
# Conditioning (generator 3; generator 2 had 2.3 and 1.0, and was chaotic at depth: see above)
QK_STD = 1.2  # q/k weight std x sqrt(hidden): attention logits q.k/8 of std ~QK_STD^2
EMBED_STD = 3.0  # embeddings: a residual stream large next to each layer's update

GENERATION_CONFIG = {
    "bos_token_id": 199998,
    "eos_token_id": [200002, 199999, 200012],
    "pad_token_id": 199999,
    "do_sample": True,
}
_NP = {BF16: np.uint16, U8: np.uint8}


# ---------------------------------------------------------------------------------------------
# What each tensor is drawn from


@dataclass(frozen=True)
class Dist:
    kind: str  # normal | mxfp4_blocks | mxfp4_scales
    mean: float = 0.0
    std: float = 1.0
    scale_key: str = ""  # MXFP4: the scales tensor whose draws both tensors share

    @property
    def unit(self) -> int:
        """Bytes (= elements of the stored dtype) per unit of a chunk: a block's 16 bytes for blocks."""
        return mxfp4.BLOCK // 2 if self.kind == "mxfp4_blocks" else 1


def distribution(name: str, spec: ModelSpec) -> Dist:
    h, i = spec.hidden_size, spec.intermediate_size
    fan_h, fan_i = 1.0 / np.sqrt(h), 1.0 / np.sqrt(i)
    expert_std = {"gate_up_proj": 1.1 * fan_h, "down_proj": 1.1 * fan_i}
    leaf = name.rsplit(".", 1)[-1]
    table: dict[str, tuple[float, float]] = {
        "embed_tokens.weight": (0.0, EMBED_STD),
        "lm_head.weight": (0.0, 3.4 * fan_h),
        "norm.weight": (1.0, 0.1),  # model.norm and both layer norms
        "q_proj.weight": (0.0, QK_STD * fan_h),
        "k_proj.weight": (0.0, QK_STD * fan_h),
        "v_proj.weight": (0.0, 1.1 * fan_h),
        "q_proj.bias": (0.0, 0.1),
        "k_proj.bias": (0.0, 0.1),
        "v_proj.bias": (0.0, 0.1),
        "o_proj.weight": (0.0, 1.0 / np.sqrt(spec.q_dim)),
        "o_proj.bias": (0.0, 0.05),
        "self_attn.sinks": (3.0, 2.0),  # several units, above and below typical attention logits
        "router.weight": (0.0, 1.7 * fan_h),
        "router.bias": (0.0, 0.2),
        "experts.gate_up_proj_bias": (0.0, 0.1),
        "experts.down_proj_bias": (0.0, 0.05),
        "experts.gate_up_proj": (0.0, expert_std["gate_up_proj"]),
        "experts.down_proj": (0.0, expert_std["down_proj"]),
    }
    if leaf in ("gate_up_proj_blocks", "down_proj_blocks", "gate_up_proj_scales", "down_proj_scales"):
        proj, _, part = leaf.rpartition("_")
        kind = "mxfp4_blocks" if part == "blocks" else "mxfp4_scales"
        return Dist(kind, 0.0, float(expert_std[proj]), scale_key=name[: -len(part)] + "scales")
    for suffix, (mean, std) in table.items():
        if name.endswith(suffix):
            return Dist("normal", mean, float(std))
    raise KeyError(f"no synthetic distribution for tensor {name}")


# ---------------------------------------------------------------------------------------------
# Tables: uniform uint16 -> value


@functools.cache
def _normal_quantiles() -> np.ndarray:
    inv = statistics.NormalDist().inv_cdf
    return np.array([inv((k + 0.5) / 65536) for k in range(65536)])


@functools.cache
def _normal_table(mean: float, std: float) -> np.ndarray:
    return to_bf16_bits((mean + std * _normal_quantiles()).astype(np.float32))


def _inverse_cdf(probs: np.ndarray) -> np.ndarray:
    """65,536 uniform slots -> index k with frequency probs[k] (rounded to 1/65536)."""
    cum = np.cumsum(probs / probs.sum())
    slots = (np.arange(65536) + 0.5) / 65536
    return np.minimum(np.searchsorted(cum, slots, side="right"), len(probs) - 1)


@functools.cache
def _mxfp4_tables(std: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uint16 -> scale class, class -> E8M0 byte, class * 65536 + uint16 -> code byte).

    Calibrated once on 2^20 N(0, std) weights encoded by `mxfp4.encode`: the scale histogram,
    and for each scale the histogram of the codes of its blocks (independent within a block).
    """
    sample = std * np.random.Generator(np.random.PCG64(0x6D786670)).standard_normal(1 << 20)
    blocks, scales = mxfp4.encode(sample.astype(np.float32).reshape(-1, 32 * 64))
    scales = scales.reshape(-1)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(len(scales), mxfp4.BLOCK)
    class_bytes = np.unique(scales)
    scale_class = _inverse_cdf(np.array([(scales == s).sum() for s in class_bytes], dtype=np.float64))
    code_table = np.empty((len(class_bytes), 65536), dtype=np.uint8)
    for c, s in enumerate(class_bytes):
        p = np.bincount(codes[scales == s].reshape(-1), minlength=16).astype(np.float64)
        pair = np.outer(p, p).reshape(-1)  # index hi * 16 + lo
        pair_idx = _inverse_cdf(pair)
        code_table[c] = ((pair_idx % 16) | ((pair_idx // 16) << 4)).astype(np.uint8)
    return scale_class.astype(np.uint8), class_bytes.astype(np.uint8), code_table.reshape(-1)


def _draws(seed: int, key: str, chunk: int, n: int) -> np.ndarray:
    ss = np.random.SeedSequence(entropy=seed, spawn_key=(zlib.crc32(key.encode()), chunk))
    raw = np.random.Generator(np.random.PCG64(ss)).bit_generator.random_raw((n + 3) // 4)
    return raw.view(np.uint16)[:n]


def chunk_values(name: str, dist: Dist, seed: int, chunk: int, units: int) -> np.ndarray:
    """The stored values (bf16 bits or bytes) of units [chunk * CHUNK, chunk * CHUNK + units)."""
    if dist.kind == "normal":
        return _normal_table(dist.mean, dist.std)[_draws(seed, name, chunk, units)]
    scale_class, class_bytes, code_table = _mxfp4_tables(dist.std)
    cls = scale_class[_draws(seed, dist.scale_key, chunk, units)]
    if dist.kind == "mxfp4_scales":
        return class_bytes[cls]
    idx = np.repeat(cls.astype(np.int32) << 16, mxfp4.BLOCK // 2)
    idx |= _draws(seed, name, chunk, units * (mxfp4.BLOCK // 2))
    return code_table[idx]


# ---------------------------------------------------------------------------------------------
# Tensors, in file order


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype: BF16 (stored as uint16 bits) or U8
    dist: Dist

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * (2 if self.dtype == BF16 else 1)

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """(chunk index, units) covering the tensor."""
        total = int(np.prod(self.shape)) // self.dist.unit
        return [(c, min(CHUNK, total - c * CHUNK)) for c in range((total + CHUNK - 1) // CHUNK)]


def tensor_plans(spec: ModelSpec, mxfp4_experts: bool) -> list[TensorPlan]:
    """Every tensor of the checkpoint, in file order: embeddings, layer by layer, norm, LM head."""
    want = expected_tensors(spec, mxfp4_experts)
    head = ["model.embed_tokens.weight"]
    tail = ["model.norm.weight", "lm_head.weight"]
    layers = [n for n in want if n not in head + tail]
    layers.sort(key=lambda n: int(n.split(".")[2]))  # stable: per-layer order as listed
    return [TensorPlan(n, want[n][0], want[n][1], distribution(n, spec)) for n in head + layers + tail]


def threads_default() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class Progress:
    """Bytes done of a total, on stderr: tqdm when installed, else a line every few seconds."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled, self.done = total, desc, enabled, 0
        self.t0 = self._last = time.perf_counter()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, mininterval=1)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and (time.perf_counter() - self._last > 5 or self.done == self.total):
            self._last = time.perf_counter()
            print(f"{self.desc}: {self.done / 1e9:.1f}/{self.total / 1e9:.1f} GB", file=sys.stderr, flush=True)

    def close(self) -> float:
        if self._bar is not None:
            self._bar.close()
        return time.perf_counter() - self.t0


def generate_arrays(
    spec: ModelSpec,
    seed: int,
    mxfp4_experts: bool,
    threads: int | None = None,
    progress: bool = True,
    plans: list[TensorPlan] | None = None,
) -> dict[str, tuple[np.ndarray, str]]:
    """All tensors in memory: name -> (array, safetensors dtype); BF16 arrays hold uint16 bits."""
    plans = plans if plans is not None else tensor_plans(spec, mxfp4_experts)
    out = {p.name: (np.empty(p.shape, dtype=_NP[p.dtype]), p.dtype) for p in plans}
    bar = Progress(sum(p.nbytes for p in plans), f"generating synthetic weights (seed {seed})", progress)

    def fill(plan: TensorPlan, chunk: int, units: int) -> int:
        flat = out[plan.name][0].reshape(-1)
        start = chunk * CHUNK * plan.dist.unit
        flat[start : start + units * plan.dist.unit] = chunk_values(plan.name, plan.dist, seed, chunk, units)
        return units * plan.dist.unit * flat.itemsize

    with ThreadPoolExecutor(threads or threads_default()) as pool:
        futures = [pool.submit(fill, p, c, u) for p in plans for c, u in p.chunks]
        for f in futures:
            bar.update(f.result())
    bar.close()
    return out


def stream_tensor_bytes(
    plans: list[TensorPlan], seed: int, threads: int | None = None
) -> Iterator[tuple[TensorPlan, np.ndarray]]:
    """Each plan's stored values, chunk by chunk in file order; at most ~4 chunks per thread in flight."""
    n = threads or threads_default()
    with ThreadPoolExecutor(n) as pool:
        pending: deque[tuple[TensorPlan, Future[np.ndarray]]] = deque()
        tasks = ((p, c, u) for p in plans for c, u in p.chunks)
        for p, c, u in tasks:
            pending.append((p, pool.submit(chunk_values, p.name, p.dist, seed, c, u)))
            if len(pending) >= 4 * n:
                plan, fut = pending.popleft()
                yield plan, fut.result()
        while pending:
            plan, fut = pending.popleft()
            yield plan, fut.result()


# ---------------------------------------------------------------------------------------------
# Files


def _header(plans: list[TensorPlan], metadata: dict[str, str] | None = None) -> tuple[bytes, int]:
    entries = [(p.name, p.dtype, p.shape, p.nbytes) for p in plans]
    return safetensors_header(entries, metadata)


def shard(plans: list[TensorPlan], shard_bytes: int) -> list[list[TensorPlan]]:
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _write_model_files(out: Path, spec: ModelSpec, mxfp4_experts: bool, extra_config: dict | None = None) -> None:
    from gptoss_max.hf_tokenizer import write_tokenizer

    cfg = spec.to_hf(mxfp4_experts)
    cfg.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    write_tokenizer(out)


def write_checkpoint(
    out: Path,
    spec: ModelSpec,
    seed: int = 0,
    mxfp4_experts: bool = True,
    shard_bytes: int = SHARD_BYTES,
    threads: int | None = None,
    progress: bool = False,
) -> Path:
    """A complete HF gpt-oss model directory: config, generation config, tokenizer, and the
    weights as safetensors (one `model.safetensors`, or `model-0000k-of-0000n.safetensors` shards
    with `model.safetensors.index.json` past `shard_bytes`). Streams: RAM stays ~100s of MB."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_model_files(out, spec, mxfp4_experts)
    plans = tensor_plans(spec, mxfp4_experts)
    shards = shard(plans, shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    bar = Progress(sum(p.nbytes for p in plans), f"writing {out}", progress)
    for name, part in zip(names, shards, strict=True):
        head, _ = _header(part)
        with open(out / name, "wb") as fh:
            fh.write(head)
            for _plan, data in stream_tensor_bytes(part, seed, threads):
                fh.write(data.data)
                bar.update(data.nbytes)
    bar.close()
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(p.nbytes for p in plans)},
            "weight_map": {p.name: name for name, part in zip(names, shards, strict=True) for p in part},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def write_stub(path: Path, plans: list[TensorPlan], note: str) -> int:
    """A safetensors file with the full header and a data region that is a hole: bytes on disk ~ header."""
    head, data_bytes = _header(plans, {MARKER: note})
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + data_bytes)
    return len(head) + data_bytes


# ---------------------------------------------------------------------------------------------
# `synthetic:<preset>,...` as a model


@dataclass(frozen=True)
class SyntheticModel:
    preset: str
    seed: int = 0
    experts: str = "mxfp4"
    layers: int | None = None

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown synthetic preset {self.preset!r}; presets: {', '.join(PRESETS)}")
        if self.experts not in ("mxfp4", "bf16"):
            raise ValueError(f"experts must be mxfp4 or bf16, not {self.experts!r}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be at least 1, not {self.layers}")

    @staticmethod
    def is_spec(text: str) -> bool:
        return text.startswith(PREFIX)

    @classmethod
    def parse(cls, text: str) -> SyntheticModel:
        """`synthetic:20b`, `synthetic:120b,seed=3`, `synthetic:20b,experts=bf16,layers=2` (or without
        the `synthetic:` prefix)."""
        body = text[len(PREFIX) :] if text.startswith(PREFIX) else text
        preset, *options = [part.strip() for part in body.split(",")]
        kwargs: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for opt in options:
            key, eq, value = opt.partition("=")
            if not eq or key not in types or key == "preset":
                raise ValueError(f"bad synthetic option {opt!r} in {text!r}: use seed=N, experts=mxfp4|bf16, layers=N")
            kwargs[key] = value if key == "experts" else int(value)
        return cls(preset, **kwargs)

    @property
    def name(self) -> str:
        opts = [f"seed={self.seed}"] + ([f"experts={self.experts}"] if self.experts != "mxfp4" else [])
        opts += [f"layers={self.layers}"] if self.layers else []
        return PREFIX + ",".join([self.preset, *opts])

    @property
    def mxfp4_experts(self) -> bool:
        return self.experts == "mxfp4"

    @property
    def spec(self) -> ModelSpec:
        spec = PRESETS[self.preset]
        if self.layers is not None:
            spec = spec.with_(num_hidden_layers=self.layers, layer_types=())
        return spec

    def marker(self) -> dict[str, Any]:
        return {"preset": self.preset, "seed": self.seed, "experts": self.experts, "layers": self.layers,
                "generator": GENERATOR}  # fmt: skip

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> SyntheticModel | None:
        """The synthetic model a config.json stands for (None for a real checkpoint)."""
        m = cfg.get(MARKER)
        if not m:
            return None
        if m.get("generator") != GENERATOR:
            raise ValueError(f"synthetic model dir made by generator {m.get('generator')}, this is {GENERATOR}: "
                             "remake it (delete the directory)")  # fmt: skip
        return cls(m["preset"], int(m["seed"]), m["experts"], m.get("layers"))

    def arrays(self, threads: int | None = None, progress: bool = True) -> dict[str, tuple[np.ndarray, str]]:
        return generate_arrays(self.spec, self.seed, self.mxfp4_experts, threads, progress)

    def weights_bytes(self) -> int:
        return sum(p.nbytes for p in tensor_plans(self.spec, self.mxfp4_experts))

    def directory(self, root: Path | None = None) -> Path:
        slug = self.name[len(PREFIX) :].replace(",", "-").replace("=", "")
        return (root or settings.cache_dir() / "synthetic") / f"{slug}-g{GENERATOR}"

    def materialize(self, root: Path | None = None) -> Path:
        """The model directory MAX is pointed at: config.json (with the marker), generation config,
        tokenizer, and a sparse header-only `model.safetensors`. Reused when already complete."""
        out = self.directory(root)
        plans = tensor_plans(self.spec, self.mxfp4_experts)
        head, data_bytes = _header(plans, {MARKER: self.name})
        stub = out / "model.safetensors"
        if (out / "config.json").exists() and stub.exists():
            same = json.loads((out / "config.json").read_text()).get(MARKER) == self.marker()
            if same and stub.stat().st_size == len(head) + data_bytes:
                return out
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _write_model_files(tmp, self.spec, self.mxfp4_experts, {MARKER: self.marker()})
        write_stub(tmp / "model.safetensors", plans, self.name)
        shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:  # another process made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        on_disk = (out / "model.safetensors").stat().st_blocks * 512
        if on_disk > 64 * 2**20:
            print(f"warning: this filesystem did not keep {out / 'model.safetensors'} sparse "
                  f"({on_disk / 1e9:.1f} GB on disk)", file=sys.stderr)  # fmt: skip
        return out


def resolve(model: str, root: Path | None = None) -> str:
    """A `synthetic:...` spec -> its materialized directory; anything else unchanged."""
    return str(SyntheticModel.parse(model).materialize(root)) if SyntheticModel.is_spec(model) else model
