"""gpt-oss as a MAX custom architecture (`ARCHITECTURES`), usable in-process or as
`--custom-architectures <site-packages>:gptoss_max.arch`."""

from __future__ import annotations

from max.graph.weights import WeightsFormat
from max.pipelines.context import TextContext
from max.pipelines.lib import TextTokenizer
from max.pipelines.modeling.types import PipelineTask

from gptoss_max import maxapi
from gptoss_max.arch.model import (
    NativeGptOssBatchProcessor,
    NativeGptOssConfig,
    NativeGptOssModel,
    NativeMemoryPlanner,
)

ARCH_NAME = "GptOssForCausalLM"

gptoss_max_arch = maxapi.SupportedArchitecture(
    name=ARCH_NAME,
    example_repo_ids=["openai/gpt-oss-20b", "openai/gpt-oss-120b"],
    default_encoding="bfloat16",
    supported_encodings=NativeGptOssConfig.SUPPORTED_ENCODINGS,
    pipeline_model=NativeGptOssModel,
    batching=NativeGptOssBatchProcessor,  # MAX's, plus the model ABI buffers graph capture needs
    task=PipelineTask.TEXT_GENERATION,
    tokenizer=TextTokenizer,
    context_type=TextContext,
    default_weights_format=WeightsFormat.safetensors,
    multi_gpu_supported=False,
    weight_adapters={},
    config=NativeGptOssConfig,
    memory_planner=NativeMemoryPlanner,
    supports_overlap_scheduler=False,
    supports_device_graph_capture=False,
)

ARCHITECTURES = [gptoss_max_arch]
