"""Device memory of our architecture, from the config alone: weights by part, KV per token, the
activation reserve, MAX 26.7's planning rule, and the bytes one decode step must read (roofline).

`NativeMemoryPlanner` (arch/model.py) takes its weights and activation figures from here, so
`gptoss-max bench --plan` prints what the pipeline will plan, without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptoss_max import mxfp4
from gptoss_max.config import ModelSpec

GIB = 1024**3
ACTIVATION_RESERVE = {"gpu": 2 * GIB, "cpu": 128 * 1024**2}  # workspace beyond weights and KV
KV_PAGE_TOKENS = 128  # MAX 26.7's default kv_cache_page_size
MXFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 32  # e2m1 nibble + one E8M0 byte per 32


def dtype_bytes(encoding: str | None) -> int:
    """Bytes per element of the dense weights (and the KV cache) for a MAX encoding."""
    return 4 if encoding == "float32" else 2


def weight_bytes(spec: ModelSpec, mxfp4_experts: bool, dense_bytes: int) -> dict[str, int]:
    """Bytes of every weight as our architecture holds it on the device, by part.

    Dense weights in the graph's dtype; experts as stored (MXFP4 blocks + scales, or bf16 in the
    graph's dtype); expert biases float32; with MXFP4 experts, the byte per 16 rows of each
    projection that the loader derives from the scales (`mxfp4.big_scale_groups`, arch/weights.py).
    """
    h, i, e, v, n = (spec.hidden_size, spec.intermediate_size, spec.num_local_experts, spec.vocab_size,
                     spec.num_hidden_layers)  # fmt: skip
    q, kv = spec.q_dim, spec.kv_dim
    attention = q * h + 2 * kv * h + h * q + q + 2 * kv + h + spec.num_attention_heads
    per_expert = 3 * i * h
    experts = n * e * per_expert
    return {
        "embedding": v * h * dense_bytes,
        "lm_head": v * h * dense_bytes,
        "attention": n * attention * dense_bytes,
        "norms": (2 * n + 1) * h * dense_bytes,
        "router": n * (e * h + e) * dense_bytes,
        "experts": int(experts * MXFP4_BYTES_PER_WEIGHT) if mxfp4_experts else experts * dense_bytes,
        "expert_biases": n * e * (2 * i + h) * 4,
        "expert_flags": n * e * (2 * i + h) // mxfp4.TILE_ROWS if mxfp4_experts else 0,
    }


def kv_bytes_per_token(spec: ModelSpec, kv_dtype_bytes: int) -> int:
    """MAX's paged cache keeps K and V of every layer (sliding ones too) for each token."""
    return 2 * spec.num_hidden_layers * spec.kv_dim * kv_dtype_bytes


def expected_experts_touched(spec: ModelSpec, batch: int) -> float:
    """Distinct experts one layer reads for `batch` tokens routed uniformly and independently."""
    e, k = spec.num_local_experts, spec.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def decode_step_bytes(
    spec: ModelSpec, mxfp4_experts: bool, batch: int, context: float, dense_bytes: int = 2, kv_dtype_bytes: int = 2
) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences at `context` tokens reads from device memory:
    every dense weight once (the embedding only for its `batch` rows), the experts the batch routes
    to, the K/V each sequence attends to (sliding layers: the window), and the new K/V written."""
    w = weight_bytes(spec, mxfp4_experts, dense_bytes)
    h, e, n = spec.hidden_size, spec.num_local_experts, spec.num_hidden_layers
    per_expert = (w["experts"] + w["expert_biases"]) / (n * e)
    touched = expected_experts_touched(spec, batch)
    row = 2 * spec.kv_dim * kv_dtype_bytes
    attended = sum(min(context, spec.sliding_window) if t == "sliding_attention" else context for t in spec.layer_types)
    parts = {
        "dense": float(w["lm_head"] + w["attention"] + w["norms"] + w["router"] + batch * h * dense_bytes),
        "experts": n * touched * per_expert,
        "kv_read": batch * attended * row,
        "kv_write": batch * n * row,
    }
    parts["total"] = sum(parts.values())
    parts["experts_touched_per_layer"] = touched
    return parts


def roofline_tok_s(
    spec: ModelSpec, mxfp4_experts: bool, batch: int, prompt: int, output: int, bandwidth: float, dense_bytes: int = 2
) -> float:
    """Output tokens/s if each decode step only had to stream its bytes at `bandwidth` B/s
    (context: the mean over the decode steps)."""
    step = decode_step_bytes(spec, mxfp4_experts, batch, prompt + output / 2, dense_bytes, dense_bytes)
    return batch * bandwidth / step["total"]


@dataclass(frozen=True)
class Plan:
    """MAX 26.7's rule (MemoryEstimator.plan_from_sizes): KV gets `free * utilization` minus
    weights, activation reserve and signal buffers, where `free` is what MAX's device reports:
    on a GPU its memory manager's pool, `pool_share` (0.9) of the device's free memory
    (maxapi.memory_manager_share), so the default utilization 0.9 leaves 0.81 of the device."""

    weights: dict[str, int]
    activations: int
    signal_buffers: int
    device_free: int  # as CUDA reports it (nvidia-smi), before MAX opens the device
    utilization: float
    kv_per_token: int
    batch: int
    max_length: int
    pool_share: float = 1.0  # the share of device_free MAX's planner sees (1.0 on a CPU)

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def static(self) -> int:
        return self.weights_total + self.activations + self.signal_buffers

    @property
    def max_free(self) -> int:
        """The free memory MAX's planner reads (`Device.stats["free_memory"]`)."""
        return int(self.device_free * self.pool_share)

    @property
    def kv_budget(self) -> int:
        return int(self.max_free * self.utilization) - self.static

    @property
    def utilization_needed(self) -> float:
        """The smallest `--kv-memory-fraction` whose budget holds `kv_needed`."""
        return (self.static + self.kv_needed) / self.max_free

    @property
    def kv_needed(self) -> int:
        pages = -(-self.max_length // KV_PAGE_TOKENS)
        return self.batch * pages * KV_PAGE_TOKENS * self.kv_per_token

    @property
    def fits(self) -> bool:
        return self.kv_budget >= self.kv_needed

    def as_dict(self) -> dict[str, Any]:
        return {
            "weights_bytes": self.weights_total,
            "weights_by_part": dict(self.weights),
            "activation_reserve_bytes": self.activations,
            "signal_buffer_bytes": self.signal_buffers,
            "device_free_bytes": self.device_free,
            "memory_manager_share": self.pool_share,
            "max_free_bytes": self.max_free,
            "kv_memory_utilization": self.utilization,
            "kv_memory_utilization_needed": round(self.utilization_needed, 4),
            "kv_budget_bytes": self.kv_budget,
            "kv_bytes_per_token": self.kv_per_token,
            "kv_tokens_fit": max(0, self.kv_budget) // self.kv_per_token,
            "kv_needed_bytes": self.kv_needed,
            "batch": self.batch,
            "max_length": self.max_length,
            "fits": self.fits,
        }

    def lines(self) -> list[str]:
        g = 1e9
        pool = f" (MAX's pool: {self.pool_share:.2f} x {self.device_free / g:.2f} GB free)"
        pool = pool if self.pool_share != 1 else ""
        out = [f"weights            {self.weights_total / g:8.2f} GB"]
        out += [f"  {k:16s} {b / g:8.2f} GB" for k, b in self.weights.items()]
        out += [
            f"activation reserve {self.activations / g:8.2f} GB",
            f"signal buffers     {self.signal_buffers / g:8.2f} GB",
            f"KV budget          {self.kv_budget / g:8.2f} GB"
            f"  = {self.utilization:.2f} x {self.max_free / g:.2f} GB - the above{pool}",
            f"KV per token       {self.kv_per_token / 1024:8.1f} KiB"
            f" -> {max(0, self.kv_budget) // self.kv_per_token:,} tokens fit",
            f"KV for batch {self.batch} x {self.max_length} tokens: {self.kv_needed / g:.2f} GB -> "
            + ("fits" if self.fits else "DOES NOT FIT")
            + f" (needs --kv-memory-fraction >= {self.utilization_needed:.3f}; every layer at full length:"
            " MAX's Jenga cache keeps only the window of a sliding layer, so it may need less)",
        ]
        return out


def signal_buffer_bytes() -> int:
    from gptoss_max import maxapi

    return int(maxapi.Signals.NUM_BYTES)


def plan(
    spec: ModelSpec,
    mxfp4_experts: bool,
    *,
    device_free: int,
    encoding: str = "bfloat16",
    utilization: float = 0.9,
    batch: int = 1,
    max_length: int = 4096,
    gpu: bool = True,
    pool_share: float | None = None,
) -> Plan:
    """`device_free`: free memory as CUDA reports it (a GPU) or the host's memory (a CPU).
    `pool_share`: the share MAX's planner sees, by default maxapi.memory_manager_share() on a
    GPU and 1.0 on a CPU."""
    from gptoss_max import maxapi

    d = dtype_bytes(encoding)
    if pool_share is None:
        pool_share = maxapi.memory_manager_share() if gpu else 1.0
    return Plan(
        pool_share=pool_share,
        weights=weight_bytes(spec, mxfp4_experts, d),
        activations=ACTIVATION_RESERVE["gpu" if gpu else "cpu"],
        signal_buffers=signal_buffer_bytes(),
        device_free=device_free,
        utilization=utilization,
        kv_per_token=kv_bytes_per_token(spec, d),
        batch=batch,
        max_length=max_length,
    )
