"""`GptOssForCausalLM` for MAX: the stock gpt_oss graph with our MoE (and its fused router head), our YaRN
and our sink attention."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, ClassVar

from max.dtype import DType
from max.graph import DeviceRef

from gptoss_max import maxapi, memory, settings
from gptoss_max.arch import cpu_shims
from gptoss_max.arch.attention import use_sink_attention
from gptoss_max.arch.exact_f32 import use_exact_f32_projections
from gptoss_max.arch.moe import NativeMoE, use_fused_router
from gptoss_max.arch.rope import use_gptoss_rope
from gptoss_max.arch.weights import SyntheticWeights, adapt_state_dict
from gptoss_max.config import ModelSpec
from gptoss_max.kernels import kernels_path
from gptoss_max.synthetic import SyntheticModel

_log = logging.getLogger("max.pipelines.gptoss_max")  # MAX's pipeline logger: load phases sit together


def on_cpu(devices: list[DeviceRef]) -> bool:
    return all(d.device_type.value == "cpu" for d in devices)


class NativeGptOssConfig(maxapi.GptOssConfig):
    SUPPORTED_ENCODINGS: ClassVar[set[Any]] = {"float32", "bfloat16", "float4_e2m1fnx2"}
    mxfp4_experts: bool = True

    def finalize(self, huggingface_config: Any, state_dict: dict[str, Any], return_logits: Any) -> None:
        super().finalize(huggingface_config, state_dict, return_logits)
        self.quant_config = None  # the experts are ours; nothing else in gpt-oss is quantized
        self.mxfp4_experts = any(k.endswith(".experts.gate_up_blocks") for k in state_dict)


class NativeGptOss(maxapi.StockGptOss):
    """MAX's GptOss module with each layer's mlp replaced by `NativeMoE`."""

    def __init__(self, config: NativeGptOssConfig) -> None:
        cpu = on_cpu(config.devices)
        guard = cpu_shims.cpu_model_construction() if cpu else contextlib.nullcontext()
        with guard:
            super().__init__(config)
        for block in self.language_model.layers:
            moe = NativeMoE(
                hidden=config.hidden_size,
                inter=config.intermediate_size,
                experts=config.num_local_experts,
                top_k=config.num_experts_per_tok,
                mxfp4=config.mxfp4_experts,
                dtype=config.dtype,
                device=config.devices[0],
            )
            block.mlp = moe
            block.mlp_shards = [moe]
            use_fused_router(block)
            use_gptoss_rope([block.self_attn, *block.self_attn_shards])
            impl = "ours" if cpu else settings.attention_impl()
            if impl != "max":
                use_sink_attention(block, hybrid=impl == "hybrid")
        if impl != "max" and settings.qkv_head_impl() == "fused":
            # Each block's final residual add goes into the next one's attention head (fused there
            # in bf16 graphs; a float32 graph adds, norms and projects as before).
            for block in list(self.language_model.layers)[:-1]:
                block.defer_add = True
        if config.dtype == DType.float32 and not cpu:
            # MAX's GPU float32 matmuls are TF32; the float32 graph is the one checked against
            # transformers' true float32 (exact_f32.py).
            use_exact_f32_projections(self)


@dataclasses.dataclass
class NativeGptOssInputs(maxapi.GptOssInputs):
    """MAX's gpt_oss inputs plus the model ABI buffers device graph capture replays."""

    @property
    def buffers(self) -> tuple[Any, ...]:
        return maxapi.model_abi_buffers(self)


class NativeGptOssBatchProcessor(maxapi.GptOssBatchProcessor):
    def prepare_initial_token_inputs(self, *args: Any, **kwargs: Any) -> NativeGptOssInputs:
        inputs = super().prepare_initial_token_inputs(*args, **kwargs)
        return NativeGptOssInputs(**{f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)})


class NativeGptOssModel(maxapi.GptOssModel):
    model_config_cls: ClassVar[type[Any]] = NativeGptOssConfig
    batch_processor_cls: ClassVar[type[Any]] = NativeGptOssBatchProcessor

    def _load_state_dict(self) -> dict[str, Any]:
        cfg = self.huggingface_config.to_dict()
        spec = ModelSpec.from_hf(cfg)
        encoding = self.pipeline_config.model.quantization_encoding or "bfloat16"
        dtype = DType.float32 if encoding == "float32" else DType.bfloat16
        synthetic = SyntheticModel.from_hf_config(cfg)
        # A synthetic model's directory holds a header-only stub: its weights are made here instead.
        weights = SyntheticWeights.generate(synthetic) if synthetic else self.weights
        start = time.perf_counter()
        self._language_weights_dict = adapt_state_dict(dict(weights.items()), spec, dtype)
        _log.info(
            "adapted %d %s tensors to our architecture (any MXFP4 experts into the op's tiled order) in %.1f s",
            len(self._language_weights_dict),
            "synthetic" if synthetic else "checkpoint",
            time.perf_counter() - start,
        )
        return self._language_weights_dict

    def _create_model_config(self, state_dict: dict[str, Any]) -> NativeGptOssConfig:
        config = NativeGptOssConfig.initialize(self.pipeline_config, max_seq_len=self.max_seq_len)
        config.finalize(
            huggingface_config=self.huggingface_config,
            state_dict=state_dict,
            return_logits=self.return_logits,
        )
        return config

    def graph_specs(self, model_config: NativeGptOssConfig) -> dict[str, maxapi.GraphSpec]:
        if settings.deterministic():
            _log.info("GPTOSS_MAX_DETERMINISTIC=on: MAX's device_sync_mode, our attention for every step")
            if not maxapi.device_sync_enabled():
                _log.warning("MAX's device_sync_mode is off: MAX was imported before gptoss_max could set "
                             "MODULAR_DEBUG=%s, and setting it late does not hold (settings.export_device_sync)",
                             settings.DEVICE_SYNC_DEBUG)  # fmt: skip
        nn_model = NativeGptOss(model_config)
        nn_model.load_state_dict(self._language_weights_dict, weight_alignment=1, strict=True)
        self._language_weights_dict = {}
        return {
            maxapi.GraphRole.DECODER: maxapi.GraphSpec(
                nn_model,
                "GptOssMax",
                self._bind_graph_inputs(nn_model.input_tree()),
                weights=nn_model.state_dict(auto_initialize=False),
                custom_extensions=[kernels_path()],
            )
        }


def _on_cpu(pipeline_config: Any) -> bool:
    return all(spec.device_type == "cpu" for spec in pipeline_config.model.device_specs)


class NativeMemoryPlanner(maxapi.GptOssMemoryPlanner):
    """No BF16 dequant buffer: experts stay MXFP4. Reserve only a workspace for activations.

    Weights are counted as the device holds them (memory.weight_bytes), not as files: a float32
    graph doubles bf16 files, and a synthetic model's stub file holds no data."""

    def estimate_weights_size(self, pipeline_config: Any) -> int:
        cfg = pipeline_config.model.huggingface_config.to_dict()
        mxfp4 = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
        dense = memory.dtype_bytes(pipeline_config.model.quantization_encoding)
        return sum(memory.weight_bytes(ModelSpec.from_hf(cfg), mxfp4, dense).values())

    def estimate_activation_memory(self, pipeline_config: Any, huggingface_config: Any) -> int:
        return memory.ACTIVATION_RESERVE["cpu" if _on_cpu(pipeline_config) else "gpu"]
