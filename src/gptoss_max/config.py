"""The gpt-oss model configuration: one frozen dataclass built from config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

LAYER_TYPES = ("sliding_attention", "full_attention")
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
NOT_QUANTIZED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    vocab_size: int = 201088
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    rope_theta: float = 150000.0
    rope_scaling: dict[str, Any] = field(default_factory=lambda: dict(YARN))
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if not self.layer_types:
            alternating = tuple(LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", alternating)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        problems = [
            msg
            for ok, msg in [
                (len(self.layer_types) == self.num_hidden_layers, "one layer_type per layer"),
                (set(self.layer_types) <= set(LAYER_TYPES), f"layer_types within {LAYER_TYPES}"),
                (self.num_attention_heads % self.num_key_value_heads == 0, "heads divisible by kv heads"),
                (self.hidden_size % 32 == 0, "hidden_size a multiple of 32 (MXFP4 blocks)"),
                (self.intermediate_size % 32 == 0, "intermediate_size a multiple of 32"),
                (0 < self.num_experts_per_tok <= self.num_local_experts, "0 < top-k <= experts"),
                (self.rope_scaling.get("rope_type") == "yarn", "yarn rope scaling"),
            ]
            if not ok
        ]
        if problems:
            raise ValueError("invalid gpt-oss config: " + "; ".join(problems))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelSpec:
        names = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in cfg.items() if k in names}
        if "num_experts_per_tok" not in kwargs and "experts_per_token" in cfg:
            kwargs["num_experts_per_tok"] = cfg["experts_per_token"]
        return cls(**kwargs)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelSpec:
        return cls.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def with_(self, **changes: Any) -> ModelSpec:
        return replace(self, **changes)

    def to_hf(self, mxfp4_experts: bool) -> dict[str, Any]:
        cfg = asdict(self)
        cfg["layer_types"] = list(self.layer_types)
        cfg.update(
            architectures=["GptOssForCausalLM"],
            model_type="gpt_oss",
            experts_per_token=self.num_experts_per_tok,
            attention_bias=True,
            attention_dropout=0.0,
            hidden_act="silu",
            initial_context_length=4096,
            initializer_range=0.02,
            output_router_logits=False,
            router_aux_loss_coef=0.9,
            tie_word_embeddings=False,
            use_cache=True,
            eos_token_id=200002,
            pad_token_id=199999,
            torch_dtype="bfloat16",
        )
        if mxfp4_experts:
            cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_QUANTIZED}
        return cfg


_20B = ModelSpec(
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
)

PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=4,
    ),
    "20b": _20B,
    "120b": _20B.with_(num_hidden_layers=36, num_local_experts=128, layer_types=()),
}
