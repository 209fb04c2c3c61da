"""The MAX internals we rely on still exist with the shapes we use (fails first on a MAX upgrade)."""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any

import numpy as np

from gptoss_max import maxapi


def test_pinned_max_version():
    from importlib.metadata import version

    assert version("max") == "26.7.0"


def test_stock_gpt_oss_pieces():
    assert maxapi.stock_gpt_oss_arch.name == "GptOssForCausalLM"
    assert hasattr(maxapi.stock_block_module, "Allreduce")
    assert {"bfloat16", "float32"} <= set(maxapi.config_enums._SUPPORTED_DEVICES)
    params = inspect.signature(maxapi.GptOssAttention.__init__).parameters
    assert {"rope", "kv_params", "layer_idx", "local_window_size", "layer_type"} <= set(params)
    assert {"module", "name", "input_types", "weights", "custom_extensions"} <= set(
        inspect.signature(maxapi.GraphSpec).parameters
    )
    for name in ("graph_specs", "_load_state_dict", "_create_model_config", "execute"):
        assert callable(getattr(maxapi.GptOssModel, name))
    # what arch/moe.py's FusedRouterBlock re-states of the block's forward
    block_call = list(inspect.signature(maxapi.GptOssTransformerBlock.__call__).parameters)
    assert block_call[:6] == ["self", "layer_idx", "xs", "signal_buffers", "kv_collections", "input_row_offsets"]
    init = inspect.getsource(maxapi.GptOssTransformerBlock.__init__)
    for attr in ("self_attn_shards", "input_layernorm_shards", "post_attention_layernorm_shards", "self.allreduce"):
        assert attr in init


def test_stacked_linear_pieces():
    """What arch/exact_f32.py's subclass reads from MAX's StackedLinear (and, by class swap,
    from gpt_oss's q/k/v projection, which must be one)."""
    from max.dtype import DType
    from max.graph import DeviceRef

    stack = maxapi.StackedLinear(8, [4, 2], ["a", "b"], DType.float32, DeviceRef.CPU(), has_bias=True)
    assert stack._quant_config is None and not stack._clip_weight
    assert isinstance(maxapi.StackedLinear.stacked_weight, property)
    assert isinstance(maxapi.StackedLinear.stacked_bias, property)
    assert "StackedLinear(" in inspect.getsource(maxapi.GptOssAttention.__init__)


def test_pipeline_driving_pieces():
    fields = set(maxapi.SamplingParams.__dataclass_fields__)
    assert {"top_k", "top_p", "temperature", "max_new_tokens", "stop_token_ids", "ignore_eos"} <= fields
    assert {"seed", "detokenize", "logits_processors"} <= fields
    assert {"model_path", "quantization_encoding", "device_specs", "max_length", "kv_cache", "runtime"} <= set(
        maxapi.PipelineArgs.model_fields
    )
    assert {"custom_architectures", "max_batch_size", "device_graph_capture"} <= set(
        maxapi.PipelineRuntimeConfig.model_fields
    )
    assert "device_memory_utilization" in maxapi.KVCacheConfig.model_fields
    assert callable(maxapi.GenerateIterator.from_contexts)
    assert callable(maxapi.PIPELINE_REGISTRY.retrieve_factory)
    params = inspect.signature(maxapi.TextGenerationRequest).parameters
    assert {"request_id", "prompt", "model_name", "sampling_params"} <= set(params)


def test_our_architecture_registers():
    from gptoss_max.arch import ARCHITECTURES

    (arch,) = ARCHITECTURES
    assert arch.name == "GptOssForCausalLM"
    assert {"float32", "bfloat16", "float4_e2m1fnx2"} <= set(arch.supported_encodings)


def test_children_stay_in_this_environment():
    """MAX's native library setenv()s PYTHONEXECUTABLE; maxapi undoes it so children keep the venv."""
    import subprocess
    import sys

    from max.nn.kv_cache import PagedCacheValues  # noqa: F401  (the import that sets it)

    from gptoss_max import maxapi  # noqa: F401

    child = subprocess.run([sys.executable, "-c", "import gptoss_max"], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr


def test_benchmark_and_synthetic_weight_pieces():
    """What e2e.py, memory.py, stock.py and the synthetic weights rely on."""
    import dataclasses

    import numpy as np
    from max.driver import Buffer
    from max.dtype import DType
    from max.pipelines.lib.interfaces.pipeline_model import PipelineModel
    from max.pipelines.lib.pipeline_variants.overlap_text_generation import OverlapTextGenerationPipeline

    assert maxapi.Signals.NUM_BYTES > 0  # reserved for gpt_oss even on one device
    assert maxapi.GptOssMemoryPlanner._always_signal_buffers
    assert "batches" in inspect.signature(maxapi.TextGenerationInputs).parameters
    # e2e.run_batch steps a pipeline as GenerateIterator.step does, through the KV manager's rows.
    for name in ("claim", "alloc", "release", "contains"):
        assert callable(getattr(maxapi.PagedKVCacheManagerInterface, name)), name
    assert "replica_idx" in inspect.signature(maxapi.PagedKVCacheManagerInterface.claim).parameters
    assert "kv_manager.alloc(context).synchronize()" in inspect.getsource(maxapi.GenerateIterator.step)
    assert "max_batch_input_tokens" in maxapi.PipelineRuntimeConfig.model_fields
    # The synthetic weights hand MAX bf16 buffers as views of uint16 bit patterns.
    bits = np.array([0x3F80, 0x4000], dtype=np.uint16)
    assert Buffer.from_numpy(bits).view(DType.bfloat16).dtype == DType.bfloat16
    # Both architectures' weights arrive through PipelineModel._load_state_dict(self.weights, self.adapter).
    assert "self.weights.items()" in inspect.getsource(PipelineModel._load_state_dict)
    # stock.py swaps only the pipeline model of MAX's own gpt_oss architecture.
    assert "pipeline_model" in {f.name for f in dataclasses.fields(maxapi.stock_gpt_oss_arch)}
    # --graph-capture: MAX's overlap pipeline captures decode graphs in warmup_graph_capture().
    assert callable(OverlapTextGenerationPipeline.warmup_graph_capture)
    assert isinstance(maxapi.GptOssModel.model, property)  # what the capture runner replays


def test_kv_occupancy_reads_max_kv_managers():
    """The KV figures /metrics shows come through maxapi.kv_occupancy: MAX's public
    block_count() and, for the request count, the manager tables MAX 26.7 keeps."""
    import inspect

    from gptoss_max import maxapi

    class Count:
        used, total = 3, 10

    class Jenga:
        _requests = {"a": 1, "b": 2}

        def block_count(self, replica):
            assert replica == 0
            return Count()

    class Paged:
        class _block_manager:  # noqa: N801
            req_to_replica = {"a": 0}

        def block_count(self, replica):
            return Count()

    assert maxapi.kv_occupancy(Jenga()) == (3, 10, 2)
    assert maxapi.kv_occupancy(Paged()) == (3, 10, 1)
    # the public count exists on MAX's managers under that name
    from max.pipelines import kv_cache

    names = {n for n, obj in inspect.getmembers(kv_cache) if inspect.isclass(obj) and hasattr(obj, "block_count")}
    assert names, "no MAX KV manager class has block_count() any more"


def test_graph_capture_buffers_follow_the_model_call():
    """Device graph capture replays the compiled model with `inputs.buffers`: they must be
    exactly what MAX's GptOssModel.execute passes it, in that order."""
    from types import SimpleNamespace

    from max.driver import CPU, Buffer

    from gptoss_max.arch import gptoss_max_arch
    from gptoss_max.arch.model import NativeGptOssBatchProcessor, NativeGptOssInputs

    # MAX sets the model's batch processor from the architecture's `batching` at registration
    assert gptoss_max_arch.batching is NativeGptOssBatchProcessor
    assert issubclass(NativeGptOssBatchProcessor, maxapi.stock_gpt_oss_arch.batching)
    b = [Buffer.from_numpy(np.array([i], np.int64)) for i in range(7)]
    inputs = NativeGptOssInputs(
        tokens=b[0], input_row_offsets=[b[1]], signal_buffers=[b[2], b[3]], return_n_logits=b[4],
        kv_cache_inputs=[b[5], b[6]],
    )  # fmt: skip
    seen: list = []
    compiled = SimpleNamespace(execute=lambda *args: seen.extend(args) or [b[0]])
    maxapi.GptOssModel.execute(SimpleNamespace(model=compiled, devices=[CPU()]), inputs)
    assert len(seen) == 7 and all(x is y for x, y in zip(seen, inputs.buffers, strict=True))
    # tokens, return_n_logits, row offsets, signal buffers, KV leaves
    assert [int(x.to_numpy()[0]) for x in inputs.buffers] == [0, 4, 1, 2, 3, 5, 6]


def test_memory_estimator_reads_the_device_free_figure():
    """memory.plan and maxapi.plan_with_free_memory rely on MAX planning the KV cache from
    `Device.stats["free_memory"]` of devices from the module-level `load_devices`."""
    est = maxapi.max_memory_estimation
    assert callable(est.load_devices) and callable(est.MemoryEstimator.plan)
    assert 'stats["free_memory"]' in inspect.getsource(est.MemoryEstimator._free_memory)
    assert "device_memory_utilization" in inspect.getsource(est.MemoryEstimator.plan_from_sizes)
    assert maxapi.MEMORY_MANAGER_SIZE_ENV == "MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT"


def test_paged_kv_graph_inputs_round_trip():
    """The paged-cache graph inputs the attention tests and benches declare: six cache tensors
    in a fixed order, read back into MAX's PagedCacheValues field by field."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph
    from max.nn.kv_cache import MHAKVCacheParams, PagedCacheValues

    cpu = DeviceRef.CPU()
    params = MHAKVCacheParams(dtype=DType.bfloat16, n_kv_heads=2, head_dim=16, num_layers=3, page_size=8, devices=[cpu])
    types = maxapi.paged_kv_input_types(params, cpu)
    assert len(types) == 6
    assert list(types[0].shape)[1:] == [2, 3, 8, 2, 16] and types[0].dtype == DType.bfloat16
    assert [t.dtype for t in types[1:]] == [DType.int64] + [DType.uint32] * 4
    assert [len(t.shape) for t in types[1:]] == [1, 1, 2, 1, 1]
    dispatch = maxapi.paged_kv_dispatch_type()
    assert dispatch.dtype == DType.int64 and list(dispatch.shape) == [4]
    with Graph("paged_kv_inputs", input_types=[*types, dispatch]) as g:
        *cache, meta = g.inputs
        kv = maxapi.paged_kv_values(cache, meta)
        assert type(kv).__name__ == PagedCacheValues.__name__
        assert kv.kv_blocks is cache[0].buffer
        assert kv.page_stride is cache[1].tensor and kv.cache_lengths is cache[2].tensor
        assert kv.lookup_table is cache[3].tensor
        assert kv.max_prompt_length is cache[4].tensor and kv.max_cache_length is cache[5].tensor
        assert kv.attention_dispatch_metadata is meta.tensor


def test_linear_weight_bias_of_linear_and_stacked_linear() -> None:
    """arch/dense.py projects with a layer's own weight and bias: a Linear's, and a StackedLinear's
    (gpt_oss's q/k/v) whole stacked weight and bias."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, TensorValue
    from max.nn import Linear

    from gptoss_max import maxapi

    cpu = DeviceRef.CPU()
    lin = Linear(32, 8, dtype=DType.bfloat16, device=cpu, has_bias=True)
    w, b = maxapi.linear_weight_bias(lin)
    assert w is lin.weight and b is lin.bias
    # stacked=True: one fused weight (the unfused children's graph-time concat goes through the
    # same property, but their bare weight names would collide outside a model)
    qkv = maxapi.StackedLinear(
        32, [8, 4, 4], ["q_proj", "k_proj", "v_proj"], DType.bfloat16, cpu, stacked=True, has_bias=True
    )
    with Graph("stacked_wb", input_types=[TensorType(DType.bfloat16, [1, 32], cpu)]):
        w, b = maxapi.linear_weight_bias(qkv)
        assert [int(d) for d in TensorValue(w).shape] == [16, 32]
        assert [int(d) for d in TensorValue(b).shape] == [16]


def test_device_sync_enabled_reads_max_debug_flag():
    """`--deterministic` relies on MAX's process-wide DebugConfig.device_sync_mode (set at import
    from MODULAR_DEBUG: test_deterministic.py)."""
    from max.engine import InferenceSession

    before = InferenceSession.debug.device_sync_mode
    try:
        for value in (False, True):
            InferenceSession.debug.device_sync_mode = value
            assert maxapi.device_sync_enabled() is value
    finally:
        InferenceSession.debug.device_sync_mode = before


def test_grammars_never_let_a_string_hold_bytes_no_utf8_text_has(tmp_path):
    """MAX's xgrammar takes the lone byte tokens C0, C1 and F5-F7 as starts of characters, so a
    3-character string could come out as `We` + 4 U+FFFD (seen once in test_server_e2e);
    maxapi.mask_never_utf8_tokens makes them special in every backend MAX builds."""
    import numpy as np
    from transformers import AutoTokenizer

    from gptoss_max.hf_tokenizer import VOCAB_SIZE, write_tokenizer
    from gptoss_max.tokenizer import never_utf8_ids

    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    raw = maxapi.token_bytes(tok)
    never = never_utf8_ids(raw)
    vocab = {i: t for t, i in tok.get_vocab().items()}
    decoder = maxapi._byte_level_decoder()
    assert raw[tok.convert_tokens_to_ids("ĠWe")] == b" We" and raw[200005] == b"<|channel|>"
    assert {raw[i] for i in never} >= {bytes([b]) for b in (0xC0, 0xC1, 0xF5, 0xFF)}
    assert all("\ufffd" in tok.decode([i]) for i in never)  # each decodes to a replacement character
    assert len(never) < 64 and tok.convert_tokens_to_ids("We") not in never

    sob = maxapi.max_structured_output
    build = sob.XgrammarBackend.from_tokenizer_delegate
    assert getattr(build, "masks_never_utf8", False)  # installed at import
    maxapi.mask_never_utf8_tokens()  # idempotent
    assert sob.XgrammarBackend.from_tokenizer_delegate.__func__ is build.__func__
    assert list(inspect.signature(build.base).parameters) == [  # MAX's constructor, as the wrapper takes it
        "cls",
        "tokenizer_delegate",
        "vocab_size",
        "stop_token_ids",
        "special_token_ids",
        "any_whitespace",
    ]
    schema = {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3}},
              "required": ["code"], "additionalProperties": False}  # fmt: skip

    def allowed_after_we(backend) -> set[int]:
        matcher = backend.create_matcher(backend.compile_json_schema(schema))
        prefix = tok.encode('{"code":"We', add_special_tokens=False)
        assert matcher.try_consume_tokens(prefix) == len(prefix)
        mask = backend.allocate_token_bitmask(1, VOCAB_SIZE)
        backend.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
        return set(np.nonzero(bits)[0].tolist())

    backend = sob.make_grammar_backend("xgrammar", tok, VOCAB_SIZE)
    ours = allowed_after_we(backend)
    plain = allowed_after_we(build.base(sob.XgrammarBackend, tok, VOCAB_SIZE, special_token_ids=[]))  # MAX alone
    assert plain & never  # MAX alone allows some of them here ...
    assert not ours & never  # ... and none with the mask
    assert plain - ours == plain & never and len(ours) > 1000  # nothing else lost

    # after a lone lead byte whose next byte UTF-8 restricts, only that range may follow
    def first_bytes_after(lead: int, matcher=None, backend=backend) -> set[int]:
        if matcher is None:
            matcher = backend.create_matcher(backend.compile_json_schema(schema))
            prefix = tok.encode('{"code":"W', add_special_tokens=False)
            lone = tok.convert_tokens_to_ids(next(c for c, b in decoder.items() if b == lead))
            assert matcher.try_consume_tokens([*prefix, lone]) == len(prefix) + 1 and matcher.last_token == lone
        mask = backend.allocate_token_bitmask(1, VOCAB_SIZE)
        backend.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
        return {decoder[vocab[i][0]] for i in np.nonzero(bits)[0].tolist() if i in vocab}

    unguarded = sob.make_grammar_backend("xgrammar", tok, VOCAB_SIZE)
    unguarded.utf8_guard = None
    for lead, ok in maxapi.UTF8_SECOND_BYTE.items():
        assert first_bytes_after(lead) == set(ok), hex(lead)
        assert first_bytes_after(lead, backend=unguarded) == set(range(0x80, 0xC0)), hex(lead)  # xgrammar alone
    e0 = backend.create_matcher(backend.compile_json_schema(schema))
    e0.try_consume_tokens([*tok.encode('{"code":"W', add_special_tokens=False), tok.convert_tokens_to_ids("à")])
    assert first_bytes_after(0xE0, e0.deep_copy()) == set(range(0xA0, 0xC0))  # a copy keeps the last token


def test_random_walks_under_a_grammar_give_only_valid_utf8(tmp_path):
    """Many random walks through a 3-character string schema, each token drawn from what the
    backend allows (single-byte tokens favoured, where the holes were): with maxapi's masks every
    accepted output decodes and validates; without the lead guard (special ids only) some do not."""
    import json

    import jsonschema
    import numpy as np
    from transformers import AutoTokenizer

    from gptoss_max.hf_tokenizer import FIRST_SPECIAL, VOCAB_SIZE, write_tokenizer

    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    raw = maxapi.token_bytes(tok)
    singles = np.array(sorted(i for i, b in raw.items() if len(b) == 1))
    schema = {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3}},
              "required": ["code"], "additionalProperties": False}  # fmt: skip

    def invalid_outputs(backend, walks: int) -> int:
        rng = np.random.default_rng(1)
        grammar = backend.compile_json_schema(schema)
        bad = 0
        for _ in range(walks):
            matcher, out = backend.create_matcher(grammar), b""
            while not matcher.is_accepting() and len(out) < 200:
                mask = backend.allocate_token_bitmask(1, VOCAB_SIZE)
                backend.fill_next_token_bitmask(matcher, mask, 0)
                allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB_SIZE].astype(bool)
                allowed[FIRST_SPECIAL:] = False  # the stop tokens: walk until the grammar accepts
                pick = (
                    singles[allowed[singles]]
                    if rng.random() < 0.7 and allowed[singles].any()
                    else np.nonzero(allowed)[0]
                )
                t = int(rng.choice(pick))
                assert matcher.try_consume_tokens([t]) == 1
                out += raw[t]
            try:
                jsonschema.validate(json.loads(out.decode("utf-8", "replace")), schema)
            except (ValueError, jsonschema.ValidationError):
                bad += 1
        return bad

    sob = maxapi.max_structured_output
    assert invalid_outputs(sob.make_grammar_backend("xgrammar", tok, VOCAB_SIZE), 120) == 0
    unguarded = sob.make_grammar_backend("xgrammar", tok, VOCAB_SIZE)
    unguarded.utf8_guard = None
    assert invalid_outputs(unguarded, 120) > 0


def test_overlap_sync_waits_times_the_wait_on_each_batchs_outputs():
    # the touchpoint: MAX's in-flight batch waits for its outputs on `copy_event`, in this method
    fields = {f.name for f in dataclasses.fields(maxapi.AsyncBatch)}
    assert "copy_event" in fields
    assert "self.copy_event.synchronize()" in inspect.getsource(maxapi.AsyncBatch.sync_and_process_outputs)

    class Event:
        def __init__(self, block_s):
            self.block_s, self.synced = block_s, False

        def synchronize(self):
            time.sleep(self.block_s)
            self.synced = True

    class Batch:  # the shape of AsyncBatch that matters: sync on copy_event, then read outputs
        def __init__(self, block_s):
            self.copy_event = Event(block_s)

        def sync_and_process_outputs(self, tag=None):
            self.copy_event.synchronize()
            return tag, self.copy_event.synced

    original = Batch.sync_and_process_outputs
    waits: list[float] = []
    with maxapi.overlap_sync_waits(waits, batch_class=Batch) as seen:
        assert seen is waits
        assert Batch(0.02).sync_and_process_outputs(tag="a") == ("a", True)  # arguments, result and
        assert Batch(0.0).sync_and_process_outputs() == (None, True)  # the event's own state pass through
    assert Batch.sync_and_process_outputs is original
    assert len(waits) == 2 and waits[0] >= 0.02 and waits[1] < 0.02
    Batch(0.0).sync_and_process_outputs()  # restored: no longer timed
    assert len(waits) == 2


def test_tree_leaves_is_max_trees_leaves_without_the_structure():
    import collections

    from max import tree
    from max.driver import Buffer

    @tree.dataclass
    class PerDevice:
        blocks: Any
        lengths: Any
        extra: Any = None

    Pair = collections.namedtuple("Pair", "a b")
    b = [Buffer.from_numpy(np.array([i], np.int64)) for i in range(9)]
    nested = [
        PerDevice(b[0], [b[1], b[2]]),
        (PerDevice(b[3], Pair(b[4], None), {"z": b[5], "a": b[6]}),),
        {"k": [b[7]], "j": ()},
        b[8],
        7,
    ]
    want = tree.leaves(nested)
    got = maxapi.tree_leaves(nested)
    assert len(got) == len(want) and all(x is y for x, y in zip(got, want, strict=True))
    as_ints = [int(x.to_numpy()[0]) if isinstance(x, Buffer) else x for x in got]
    assert as_ints == [0, 1, 2, 3, 4, None, 6, 5, 7, 8, 7]  # a dict by sorted key; None a leaf, but not a None field
    assert maxapi.tree_leaves(b[0]) == [b[0]] and maxapi.tree_leaves([]) == []
