"""Every touchpoint with MAX's internal (non-public, release-specific) APIs, in one module.

MAX moves these between releases; `tests/test_maxapi.py` checks that each still
exists with the shape we rely on, so an upgrade fails there first, by name.
Pinned: max==26.7.0.
"""

from __future__ import annotations

import os
from typing import Any

# P2P signal buffers, which MAX reserves for gpt_oss even on one GPU (memory.py's plan).
from max.nn.comm import Signals

# gpt_oss architecture pieces we reuse (attention with sinks, YaRN RoPE, norms, KV params),
# and what builds and drives a pipeline (engine.py, fidelity.py, e2e.py: one step over a batch).
from max.pipelines import PIPELINE_REGISTRY
from max.pipelines.architectures.gpt_oss import gpt_oss as stock_gpt_oss_module
from max.pipelines.architectures.gpt_oss.arch import gpt_oss_arch as stock_gpt_oss_arch
from max.pipelines.architectures.gpt_oss.batch_processor import GptOssBatchProcessor
from max.pipelines.architectures.gpt_oss.gpt_oss import GptOss as StockGptOss
from max.pipelines.architectures.gpt_oss.layers import transformer_block as stock_block_module
from max.pipelines.architectures.gpt_oss.layers.attention import GptOssAttention
from max.pipelines.architectures.gpt_oss.memory_planner import GptOssMemoryPlanner
from max.pipelines.architectures.gpt_oss.model import GptOssInputs, GptOssModel
from max.pipelines.architectures.gpt_oss.model_config import GptOssConfig
from max.pipelines.context import SamplingParams
from max.pipelines.kv_cache.config import KVCacheConfig
from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner
from max.pipelines.kv_cache.paged_kv_cache.cache_manager_interface import PagedKVCacheManagerInterface
from max.pipelines.lib import PipelineArgs, PipelineConfig, SupportedArchitecture
from max.pipelines.lib.generate import GenerateIterator
from max.pipelines.lib.graph_specs import GraphRole, GraphSpec
from max.pipelines.lib.pipeline_runtime_config import PipelineRuntimeConfig
from max.pipelines.modeling import config_enums
from max.pipelines.modeling.types import RequestID, TextGenerationInputs, TextGenerationRequest

# MAX's native library setenv()s PYTHONEXECUTABLE to the `python3` on PATH, so every child
# process (MAX's own model worker included) would start outside this virtualenv. Undo it.
os.unsetenv("PYTHONEXECUTABLE")



def kv_occupancy(kv_manager: Any) -> tuple[int, int, int | None]:
    """(used blocks, total blocks, requests holding blocks) of a pipeline's KV manager.

    The block counts are MAX's public `block_count(replica)`. MAX 26.7 keeps no public count of
    the requests holding blocks, so that one reads its own tables: `_requests` of the Jenga
    manager (gpt-oss's, with its sliding-window layers) or the paged manager's
    `_block_manager.req_to_replica`; None if neither exists (a MAX upgrade moved them)."""
    count = kv_manager.block_count(0)
    requests = None
    for owner, name in ((kv_manager, "_requests"), (getattr(kv_manager, "_block_manager", None), "req_to_replica")):
        table = getattr(owner, name, None)
        if isinstance(table, dict):
            requests = len(table)
            break
    return int(count.used), int(count.total), requests


def model_abi_buffers(inputs: Any) -> tuple[Any, ...]:
    """The positional buffers of MAX 26.7's gpt_oss model call, in `GptOssModel.execute`'s order:
    tokens, return_n_logits, row offsets per device, signal buffers, KV-cache leaves. MAX's device
    graph capture (and replay) calls the compiled model with exactly these; 26.7's GptOssInputs
    does not define them (`buffers` raises), so its gpt_oss cannot be captured as shipped."""
    from max import tree

    offsets = inputs.input_row_offsets if isinstance(inputs.input_row_offsets, list) else [inputs.input_row_offsets]
    kv = tree.leaves(inputs.kv_cache_inputs) if inputs.kv_cache_inputs is not None else []
    return (inputs.tokens, inputs.return_n_logits, *offsets, *inputs.signal_buffers, *kv)


__all__ = [
    "kv_occupancy",
    "PIPELINE_REGISTRY",
    "GenerateIterator",
    "KVCacheConfig",
    "PipelineArgs",
    "PipelineRuntimeConfig",
    "RequestID",
    "SamplingParams",
    "TextGenerationInputs",
    "TextGenerationRequest",
    "Signals",
    "GptOssAttention",
    "GptOssBatchProcessor",
    "GptOssInputs",
    "model_abi_buffers",
    "GptOssConfig",
    "GptOssMemoryPlanner",
    "GptOssModel",
    "GraphRole",
    "GraphSpec",
    "PagedMemoryPlanner",
    "PagedKVCacheManagerInterface",
    "PipelineConfig",
    "StockGptOss",
    "SupportedArchitecture",
    "config_enums",
    "stock_block_module",
    "stock_gpt_oss_arch",
    "stock_gpt_oss_module",
]
