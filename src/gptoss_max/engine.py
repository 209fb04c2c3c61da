"""Load gpt-oss through MAX's pipeline registry with our architecture, and generate from token ids."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gptoss_max import maxapi, settings
from gptoss_max.harmony.render import STOP_TOKEN_IDS

ARCH_MODULE = "gptoss_max.arch"


def has_gpu() -> bool:
    from max.driver import accelerator_count

    return accelerator_count() > 0


def uses_gpu(device: str) -> bool:
    """`auto` means a GPU when one is present; otherwise `gpu` or `cpu` as given."""
    return has_gpu() if device == "auto" else device == "gpu"


@dataclass(frozen=True)
class EngineOptions:
    model: str
    device: str = "auto"  # auto | cpu | gpu
    max_length: int = 4096
    max_batch_size: int = 8
    kv_memory_fraction: float | None = None
    encoding: str | None = None  # float32 on CPU and bfloat16 on GPU unless given
    graph_capture: bool = False  # decode steps replay captured device graphs (GPU only; MAX's overlap pipeline)
    # with graph_capture: the pipeline's small per-step graphs replay device graphs too, instead of
    # running eagerly each step: off, on, or check (each replay compared with an eager call);
    # maxapi.replay_in_mode
    replay_small_graphs: str = "off"
    max_batch_input_tokens: int | None = None  # prompt tokens one step may take (MAX's default: 8192)
    arch_module: str = ARCH_MODULE  # the custom architecture module MAX registers (e2e: gptoss_max.stock)

    @property
    def on_gpu(self) -> bool:
        return uses_gpu(self.device)


def pipeline_args(opts: EngineOptions) -> Any:
    """MAX PipelineArgs: our architecture, float32 on CPU (bf16 on GPU), a bounded KV cache.

    A `synthetic:<preset>` model is materialized first (config + tokenizer + a header-only stub);
    the architecture generates its weights in memory."""
    from max.driver import DeviceSpec

    from gptoss_max.synthetic import resolve

    gpu = opts.on_gpu
    settings.check_deterministic(opts.graph_capture)
    if opts.graph_capture and not gpu:
        raise ValueError("device graph capture needs a GPU (MAX's overlap pipeline refuses CPU models)")
    if opts.replay_small_graphs != "off" and not opts.graph_capture:
        raise ValueError("replay_small_graphs needs graph_capture (it wraps the overlap pipeline's per-step graphs)")
    fraction = opts.kv_memory_fraction or (0.9 if gpu else 0.05)
    runtime: dict[str, Any] = {
        "custom_architectures": [opts.arch_module],
        "max_batch_size": opts.max_batch_size,
        "device_graph_capture": opts.graph_capture,
    }
    if opts.max_batch_input_tokens:
        runtime["max_batch_input_tokens"] = opts.max_batch_input_tokens
    return maxapi.PipelineArgs(
        model_path=resolve(opts.model),
        quantization_encoding=opts.encoding or ("bfloat16" if gpu else "float32"),
        device_specs=[DeviceSpec.accelerator(0) if gpu else DeviceSpec.cpu()],
        max_length=opts.max_length,
        kv_cache=maxapi.KVCacheConfig(device_memory_utilization=fraction),
        runtime=maxapi.PipelineRuntimeConfig(**runtime),
    )


class Engine:
    """A compiled gpt-oss pipeline: token ids in, token ids out."""

    def __init__(self, opts: EngineOptions):
        self.opts = opts
        t0 = time.perf_counter()
        self.config = maxapi.PipelineConfig.from_args(pipeline_args(opts))
        retrieved = maxapi.PIPELINE_REGISTRY.retrieve_factory(self.config)
        self.tokenizer = retrieved.tokenizer
        self.memory_plan = retrieved.memory_plan
        self.pipeline = retrieved.factory()
        self.load_seconds = time.perf_counter() - t0
        self.capture_seconds = 0.0
        if opts.graph_capture:
            t0 = time.perf_counter()
            self.pipeline.warmup_graph_capture()  # captures decode graphs per batch size / cache length
            self.capture_seconds = time.perf_counter() - t0
        self.replayed = maxapi.replay_in_mode(self.pipeline, opts.replay_small_graphs)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> Iterator[int]:
        """Yield new token ids until a stop token (yielded) or `max_new_tokens`."""
        params = maxapi.SamplingParams(
            temperature=temperature,
            top_k=1 if temperature == 0 else -1,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=list(STOP_TOKEN_IDS),
            seed=seed,
            detokenize=False,
        )
        return self.run(prompt_ids, params)

    def run(self, prompt_ids: list[int], params: Any) -> Iterator[int]:
        """One request through the pipeline as a batch of one; yields its new token ids."""
        request = maxapi.TextGenerationRequest(
            request_id=maxapi.RequestID(), prompt=list(prompt_ids), model_name="model", sampling_params=params
        )
        context = asyncio.run(self.tokenizer.new_context(request))
        with maxapi.GenerateIterator.from_contexts(self.pipeline, [context], caller="gptoss-max") as batch:
            while not batch.done:
                yield from batch.step().get(0) or []
