"""Every touchpoint with MAX's internal (non-public, release-specific) APIs, in one module.

MAX moves these between releases; `tests/test_maxapi.py` checks that each still
exists with the shape we rely on, so an upgrade fails there first, by name.
Pinned: max==26.7.0.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

# P2P signal buffers, which MAX reserves for gpt_oss even on one GPU (memory.py's plan).
from max.nn.comm import Signals

# The q/k/v projection gpt_oss's attention uses (arch/exact_f32.py subclasses it).
from max.nn.stacked_linear import StackedLinear

# gpt_oss architecture pieces we reuse (attention with sinks, YaRN RoPE, norms, KV params),
# and what builds and drives a pipeline (engine.py, fidelity.py, e2e.py: one step over a batch).
from max.pipelines import PIPELINE_REGISTRY
from max.pipelines.architectures.gpt_oss import gpt_oss as stock_gpt_oss_module
from max.pipelines.architectures.gpt_oss.arch import gpt_oss_arch as stock_gpt_oss_arch
from max.pipelines.architectures.gpt_oss.batch_processor import GptOssBatchProcessor
from max.pipelines.architectures.gpt_oss.gpt_oss import GptOss as StockGptOss
from max.pipelines.architectures.gpt_oss.layers import transformer_block as stock_block_module
from max.pipelines.architectures.gpt_oss.layers.attention import GptOssAttention
from max.pipelines.architectures.gpt_oss.layers.transformer_block import GptOssTransformerBlock
from max.pipelines.architectures.gpt_oss.memory_planner import GptOssMemoryPlanner
from max.pipelines.architectures.gpt_oss.model import GptOssInputs, GptOssModel
from max.pipelines.architectures.gpt_oss.model_config import GptOssConfig
from max.pipelines.context import SamplingParams
from max.pipelines.kv_cache.config import KVCacheConfig
from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner
from max.pipelines.kv_cache.paged_kv_cache.cache_manager_interface import PagedKVCacheManagerInterface
from max.pipelines.lib import PipelineArgs, PipelineConfig, SupportedArchitecture
from max.pipelines.lib import memory_estimation as max_memory_estimation
from max.pipelines.lib.generate import GenerateIterator
from max.pipelines.lib.graph_specs import GraphRole, GraphSpec
from max.pipelines.lib.pipeline_runtime_config import PipelineRuntimeConfig
from max.pipelines.lib.pipeline_variants import structured_output_backend as max_structured_output

# The overlap pipeline's in-flight batch (device graph capture): its host waits for the GPU in
# `sync_and_process_outputs`, on `copy_event` (overlap_sync_waits).
from max.pipelines.lib.pipeline_variants.overlap_text_generation import AsyncBatch
from max.pipelines.modeling import config_enums
from max.pipelines.modeling.types import RequestID, TextGenerationInputs, TextGenerationRequest

from gptoss_max.tokenizer import never_utf8_ids

# MAX's native library setenv()s PYTHONEXECUTABLE to the `python3` on PATH, so every child
# process (MAX's own model worker included) would start outside this virtualenv. Undo it.
os.unsetenv("PYTHONEXECUTABLE")

_log = logging.getLogger(__name__)

# MAX's device memory manager. Opening a GPU, MAX 26.7's DeviceContext sizes a memory pool at
# MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT of the device's memory, and
# `Device.stats["free_memory"]`, which `MemoryEstimator` plans the KV cache from, reports that
# pool, not CUDA's free memory: the estimator's `device_memory_utilization` (0.9 by default)
# then applies on top, so the KV budget is 0.9 x 0.9 x free - weights - activations. The default
# share is not documented; 0.9 is inferred (docs/GPU.md, "The KV plan at 0.9"): it reproduces
# MAX's two 120b plans on the H100 to the byte, and a capture run held ~77.5 GB whatever the model.
MEMORY_MANAGER_SIZE_ENV = "MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT"
MEMORY_MANAGER_DEFAULT_SHARE = 0.9


# Grammar-constrained decoding and bytes no UTF-8 text holds. MAX's xgrammar takes a JSON string's
# characters as UTF-8 by lead and continuation bytes only, so it lets a string hold the byte-level
# vocabulary's lone tokens C0, C1 and F5-F7 (F8-FF it refuses), which no UTF-8 text contains.
# Decoded, each becomes U+FFFD, and with the continuation bytes after it a string can come out
# longer than its maxLength: a CPU test once got `{"code": "We\ufffd\ufffd\ufffd\ufffd"}` for a
# 3-character code (four bytes the grammar took for one character: one of these leads, or one of
# the context cases below). MAX
# marks ids "special" per tokenizer (excluded from string contents, kept where a grammar names
# them by id); `mask_never_utf8_tokens` adds these ids to that set in every xgrammar backend
# built after it (idempotent; called at import, so in MAX's model worker too, which imports our
# architecture before it builds its pipeline). Sequences that are invalid only in context (a
# surrogate ED A0.., an overlong E0 80.. or F0 80.., F4 90.. above U+10FFFF) cannot be masked
# per token without losing valid characters, so there the row xgrammar fills is narrowed after
# a token that ends in such a lead (Utf8Guard).


def _byte_level_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode), character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_bytes(tokenizer_delegate: Any) -> dict[int, bytes]:
    """A byte-level tokenizer's tokens as their bytes, by id (a special token's name, where its
    characters are all in the byte-level alphabet, reads as its ASCII bytes: harmless here)."""
    decoder = _byte_level_decoder()
    return {
        int(idx): bytes(decoder[c] for c in token)
        for token, idx in tokenizer_delegate.get_vocab().items()
        if token and all(c in decoder for c in token)
    }


# The lead bytes whose next byte UTF-8 restricts to part of 80-BF, with that part.
UTF8_SECOND_BYTE = {0xE0: range(0xA0, 0xC0), 0xED: range(0x80, 0xA0), 0xF0: range(0x90, 0xC0), 0xF4: range(0x80, 0x90)}


class Utf8Guard:
    """What xgrammar lets through after a lead byte of UTF8_SECOND_BYTE (a surrogate, an overlong
    form, a code point past U+10FFFF): for each such lead, the packed bitmask words (MAX's int32
    row layout) of the tokens that start with a continuation byte outside its range, and which
    tokens end in that lead. `restrict(row, last)` clears those tokens from a filled row when the
    last token taken ends in a lead."""

    def __init__(self, tokens: dict[int, bytes], vocab_size: int) -> None:
        """tokens: the vocabulary as its bytes, by id (token_bytes)."""
        words = (vocab_size + 31) // 32
        self.ends_in: dict[int, int] = {}  # token id -> its last byte, a restricted lead
        bits = {lead: np.zeros(words * 32, dtype=bool) for lead in UTF8_SECOND_BYTE}
        for idx, raw in tokens.items():
            if idx >= vocab_size:
                continue
            if raw[-1] in UTF8_SECOND_BYTE:
                self.ends_in[idx] = raw[-1]
            for lead, ok in UTF8_SECOND_BYTE.items():
                if 0x80 <= raw[0] <= 0xBF and raw[0] not in ok:
                    bits[lead][idx] = True
        self.keep = {
            lead: ~np.packbits(b, bitorder="little").view(np.int32) for lead, b in bits.items()
        }  # the words to AND a row with

    def restrict(self, row: Any, last: int | None) -> None:
        lead = self.ends_in.get(last) if last is not None else None
        if lead is not None:
            n = min(len(row), len(self.keep[lead]))
            row[:n] &= self.keep[lead][:n]


def mask_never_utf8_tokens() -> None:
    """Keep bytes no UTF-8 text holds out of grammar-constrained text, in every xgrammar backend
    MAX builds from now on (XgrammarBackend.from_tokenizer_delegate, which make_grammar_backend
    calls): the tokens of never_utf8_ids become special tokens (above), and after a token that
    ends in a lead byte of UTF8_SECOND_BYTE the next token's first byte must be in that lead's
    range (the matcher remembers its last token; the backend's Utf8Guard clears the rest from
    the row xgrammar fills). One pass over the vocabulary serves both. Idempotent; MAX's own
    constructor stays at `XgrammarBackend.from_tokenizer_delegate.base`."""
    sob = max_structured_output
    if getattr(sob.XgrammarBackend.from_tokenizer_delegate, "masks_never_utf8", False):
        return
    base_build = sob.XgrammarBackend.from_tokenizer_delegate.__func__  # type: ignore[attr-defined]
    base_fill = sob.XgrammarBackend.fill_next_token_bitmask
    base_consume = sob.XgrammarMatcher.try_consume_tokens
    base_copy = sob.XgrammarMatcher.deep_copy

    def from_tokenizer_delegate(
        cls: Any,
        tokenizer_delegate: Any,
        vocab_size: int,
        stop_token_ids: Any = None,
        special_token_ids: Any = (),
        any_whitespace: bool = False,
    ) -> Any:
        tokens = token_bytes(tokenizer_delegate)
        special = set(special_token_ids) | never_utf8_ids(tokens)
        backend = base_build(cls, tokenizer_delegate, vocab_size, stop_token_ids, special, any_whitespace)
        backend.utf8_guard = Utf8Guard(tokens, vocab_size)
        return backend

    def fill_next_token_bitmask(self: Any, matcher: Any, bitmask: Any, index: int) -> None:
        base_fill(self, matcher, bitmask, index)
        guard = getattr(self, "utf8_guard", None)
        if guard is not None and not matcher.is_stopped():
            guard.restrict(bitmask[index], getattr(matcher, "last_token", None))

    def try_consume_tokens(self: Any, tokens: list[int]) -> int:
        n = base_consume(self, tokens)
        if n:
            self.last_token = int(tokens[n - 1])
        return n

    def deep_copy(self: Any) -> Any:
        twin = base_copy(self)
        twin.last_token = getattr(self, "last_token", None)
        return twin

    from_tokenizer_delegate.masks_never_utf8 = True  # type: ignore[attr-defined]
    from_tokenizer_delegate.base = base_build  # type: ignore[attr-defined]
    sob.XgrammarBackend.from_tokenizer_delegate = classmethod(from_tokenizer_delegate)  # type: ignore[method-assign]
    sob.XgrammarBackend.fill_next_token_bitmask = fill_next_token_bitmask  # type: ignore[method-assign]
    sob.XgrammarMatcher.try_consume_tokens = try_consume_tokens  # type: ignore[method-assign]
    sob.XgrammarMatcher.deep_copy = deep_copy  # type: ignore[method-assign]


mask_never_utf8_tokens()


class _TimedEvent:
    """A batch's `copy_event` that adds the seconds its `synchronize()` blocked to `waits`."""

    def __init__(self, event: Any, waits: list[float]):
        self._event = event
        self._waits = waits

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        self._event.synchronize()
        self._waits.append(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._event, name)


@contextlib.contextmanager
def overlap_sync_waits(waits: list[float] | None = None, batch_class: Any = AsyncBatch) -> Iterator[list[float]]:
    """While open, appends to `waits` (a new list if None; yielded) the seconds the host spent
    blocked on each overlap-pipeline batch's outputs (`AsyncBatch.sync_and_process_outputs` waits
    on the batch's `copy_event`, the one wait of a replayed decode step), in order. A step whose
    host waited ~0 was bound by the host's own work (MAX's Python, ours); one that waited long, by
    the GPU. Patches the class for the duration, so one at a time."""
    waits = [] if waits is None else waits
    original = batch_class.sync_and_process_outputs

    @functools.wraps(original)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.copy_event = _TimedEvent(self.copy_event, waits)
        return original(self, *args, **kwargs)

    batch_class.sync_and_process_outputs = timed
    try:
        yield waits
    finally:
        batch_class.sync_and_process_outputs = original


class ReplayedModel:
    """A compiled MAX model whose calls replay device graphs, captured per input signature.

    MAX's overlap pipeline replays the model's decode step from a device graph, but runs two small
    graphs eagerly every step: the sampler (`_sampler_without_bitmask`) and the scatter of the
    previous step's token into this step's input (`RealizeFutureTokenProcessor._graph`). Eager, each
    costs the host ~0.15-0.25 ms of MAX's launch path per step (py-spy on the H200, bench/NOTES.md,
    "Fourteenth session"), as much as the replay of the whole model. Here, a signature seen
    `capture_after` times is captured into a graph (stable copies of its device inputs); later
    calls copy their device inputs into those (one batched copy on the stream) and replay.

    The signature is every input's shape, dtype and device, plus the value of each host-resident
    input (a replay reads those only at capture: the sampler's `max_k` and `min_top_p` scalars), so
    a captured graph only ever sees values it was captured with. Inputs it cannot refresh (a
    non-empty pinned buffer, a large host one) keep the call eager, as do signatures past
    `max_graphs`. Outputs are the graph's own buffers, overwritten by the next replay of that
    signature: the overlap pipeline consumes each step's outputs on the stream (the next step's
    scatter, the token's copy to the host) before the next replay of the same graph is queued.
    `replay_if` (the scatter's guard, replay_overlap_graphs) keeps calls whose inputs it refuses
    eager."""

    HOST_KEY_ELEMENTS = 64  # host inputs up to this many elements go into the key by value
    SEEN_LIMIT = 1024  # signatures counted towards a capture at most
    COUNTS_EVERY = 1024  # calls between two log lines of the counts (what a served run did)

    def __init__(
        self,
        model: Any,
        *,
        name: str = "model",
        capture_after: int = 2,
        max_graphs: int = 8,
        check: bool = False,
        replay_if: Callable[[tuple[Any, ...]], bool] | None = None,
    ):
        self.model = model
        self.name = name
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        # replay_if: a call whose inputs it refuses runs eagerly (counted as held), captured or not
        self.replay_if = replay_if
        self.output_ptrs: set[int] = set()  # where the captured graphs' outputs live
        # check: every replay also runs the call eagerly, and counts outputs that differ (a test
        # mode: it syncs the host with the GPU twice a call)
        self.check = check
        self.graphs: dict[tuple[Any, ...], tuple[list[Any], list[Any], int]] = {}
        self.seen: dict[tuple[Any, ...], int] = {}
        self.refused: set[tuple[Any, ...]] = set()
        self.counts = {"replay": 0, "capture": 0, "eager": 0} | ({"checked": 0, "mismatch": 0} if check else {})
        if replay_if is not None:
            self.counts["held"] = 0
        # host seconds in calls that replayed (a capture's own call among them) and in eager ones
        self.host_s = {"replay": 0.0, "eager": 0.0}

    def __getattr__(self, name: str) -> Any:  # input_metadata, signature, ... of the model
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:  # as MAX's Model.__call__
        bound = self.model.signature.bind(*args, **kwargs)
        return self.execute(*bound.arguments.values())

    @staticmethod
    def kept(b: Any) -> bool:
        """Whether an input stays the captured buffer, never refreshed: host-resident or pinned (as
        MAX's ServeGraphCaptureRunner.replay skips them), so its value belongs in the key."""
        return b.device.is_host or b.pinned

    def key(self, inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The signature of a call, or None where it cannot be replayed."""
        from max.driver import Buffer

        parts: list[Any] = []
        for b in inputs:
            if not isinstance(b, Buffer):
                return None
            dev = b.device
            part: tuple[Any, ...] = (tuple(b.shape), str(b.dtype), dev.label, dev.id)
            if self.kept(b):
                if b.pinned and b.num_elements:
                    return None  # the graph would read it through its pointer: not refreshable
                if b.num_elements > self.HOST_KEY_ELEMENTS:
                    return None
                part += (b.to_numpy().tobytes(),)
            parts.append(part)
        return tuple(parts)

    def execute(self, *inputs: Any) -> list[Any]:
        calls = self.counts["replay"] + self.counts["eager"]
        if calls and calls % self.COUNTS_EVERY == 0:
            host_us = {k: round(1e6 * s / max(self.counts[k], 1), 1) for k, s in self.host_s.items()}
            _log.info(
                "%s: after %d calls: %s, %d signatures counted; host µs per call %s",
                self.name, calls, dict(self.counts), len(self.seen), host_us,
            )  # fmt: skip
        t0 = time.perf_counter()
        replays = self.counts["replay"]
        outputs = self._execute(inputs)
        self.host_s["replay" if self.counts["replay"] > replays else "eager"] += time.perf_counter() - t0
        return outputs

    def _execute(self, inputs: tuple[Any, ...]) -> list[Any]:
        held = self.replay_if is not None and not self.replay_if(inputs)
        if held:
            self.counts["held"] += 1
        key = None if held else self.key(inputs)  # held: eager, neither captured nor counted towards it
        entry = self.graphs.get(key) if key is not None else None
        if entry is None and key is not None and key not in self.refused and len(self.graphs) < self.max_graphs:
            if len(self.seen) >= self.SEEN_LIMIT and key not in self.seen:
                self.seen.clear()  # many one-off signatures (e.g. prefill shapes): start counting afresh
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] >= self.capture_after:
                entry = self._capture(key, inputs)
        if entry is None:
            self.counts["eager"] += 1
            return self.model.execute(*inputs)
        stable, outputs, graph_key = entry
        # refresh the device inputs (kept ones are in the key, and stay the captured buffers)
        pairs = [(d, s) for s, d in zip(inputs, stable, strict=True) if d is not s and not self.kept(d)]
        if pairs:
            from max.driver import batch_inplace_copy

            batch_inplace_copy([dst for dst, _ in pairs], [src for _, src in pairs])
        self.model.replay(graph_key, *stable)
        self.counts["replay"] += 1
        if self.check:
            self._check(inputs, outputs, graph_key)
        return list(outputs)

    MISMATCHES_LOGGED = 5  # check mode: the first mismatches of each model are logged, then only counted

    def _check(self, inputs: tuple[Any, ...], outputs: list[Any], graph_key: int) -> None:
        """Check mode: run the call eagerly too and count (and log the first few) replays whose
        outputs differ from the eager ones."""
        eager = self.model.execute(*inputs)
        differ = [
            i
            for i, (o, e) in enumerate(zip(outputs, eager, strict=True))
            if not np.array_equal(o.to_numpy(), e.to_numpy())
        ]
        self.counts["checked"] += 1
        self.counts["mismatch"] += bool(differ)
        if differ and self.counts["mismatch"] <= self.MISMATCHES_LOGGED:
            shapes = [tuple(b.shape) for b in inputs]
            first = {i: [b.to_numpy().ravel()[:8].tolist() for b in (outputs[i], eager[i])] for i in differ}
            _log.warning(
                "%s: replay of graph %d differs from an eager call in outputs %s (input shapes %s; "
                "replayed vs eager, first values: %s); counts %s",
                self.name, graph_key, differ, shapes, first, dict(self.counts),
            )  # fmt: skip

    def _capture(self, key: tuple[Any, ...], inputs: tuple[Any, ...]) -> tuple[list[Any], list[Any], int] | None:
        from max.driver import Buffer

        stable = []
        for b in inputs:  # filled with this call's values, so whatever capture runs reads real ones
            if self.kept(b):
                stable.append(b)
            else:
                stable.append(Buffer(shape=b.shape, dtype=b.dtype, device=b.device))
                stable[-1].inplace_copy_from(b)
        graph_key = len(self.graphs) + 1
        try:
            outputs = list(self.model.capture(graph_key, *stable))
        except Exception as exc:  # a graph MAX cannot capture stays eager (and says so once)
            self.refused.add(key)
            _log.warning("%s: device graph capture failed (%s); this signature stays eager", self.name, exc)
            return None
        await_graphs = getattr(self.model, "_await_device_graphs", None)
        if await_graphs is not None:  # MAX instantiates captured graphs on threads (26.7)
            await_graphs()
        self.graphs[key] = (stable, outputs, graph_key)
        self.output_ptrs.update(b._data_ptr() for b in outputs)
        self.seen.pop(key, None)
        self.counts["capture"] += 1
        shapes = [tuple(b.shape) for b in inputs]
        values = [b.to_numpy().tolist() for b in inputs if self.kept(b)]
        _log.info("%s: captured graph %d (input shapes %s; host values %s)", self.name, graph_key, shapes, values)
        return self.graphs[key]


def replay_overlap_graphs(pipeline: Any, names: Sequence[str] | None = None, **kwargs: Any) -> list[ReplayedModel]:
    """Wrap the overlap pipeline's eager per-step graphs (MAX 26.7: the sampler, the sampler with a
    token bitmask where structured output is on (its bitmask is a device input, refreshed like the
    others), and the future-token scatter) in `ReplayedModel`s; returns them (their `counts` say
    what ran). `names` picks some of them (`settings.REPLAYABLE_GRAPHS`; default
    `settings.DEFAULT_REPLAY_GRAPHS`, the samplers); `kwargs` are ReplayedModel's. A pipeline without
    them (not the overlap pipeline) is left as it is."""
    from gptoss_max.settings import DEFAULT_REPLAY_GRAPHS

    wanted = set(DEFAULT_REPLAY_GRAPHS if names is None else names)
    wrapped: list[ReplayedModel] = []
    sampler_attrs = (("_sampler_without_bitmask", "sampler"), ("_sampler_with_bitmask", "sampler_bitmask"))
    for attr, name in sampler_attrs:
        sampler = getattr(pipeline, attr, None)  # the second only where structured output is on
        if name in wanted and sampler is not None and not isinstance(sampler, ReplayedModel):
            setattr(pipeline, attr, ReplayedModel(sampler, name=name, **kwargs))
            wrapped.append(getattr(pipeline, attr))

    def tokens_of_a_replayed_sampler(inputs: tuple[Any, ...]) -> bool:
        """Whether the scatter's inputs hold the previous tokens where a replayed sampler wrote them.
        Replayed on an eager sampler's tokens, the scatter crashed the server's worker on an H200;
        with both replayed, or both eager, it passed (bench/NOTES.md, "Sixteenth session")."""
        samplers = [
            s for s in (getattr(pipeline, attr, None) for attr, _ in sampler_attrs) if isinstance(s, ReplayedModel)
        ]
        ptrs = [b._data_ptr() for b in inputs if hasattr(b, "_data_ptr")]
        return any(p in s.output_ptrs for s in samplers for p in ptrs)

    realize = getattr(pipeline, "_realize_future_token_processor", None)
    graph = getattr(realize, "_graph", None) if "realize_future_token" in wanted else None
    if realize is not None and graph is not None and not isinstance(graph, ReplayedModel):
        realize._graph = ReplayedModel(
            graph, name="realize_future_token", replay_if=tokens_of_a_replayed_sampler, **kwargs
        )
        wrapped.append(realize._graph)
    return wrapped


def replay_in_mode(pipeline: Any, mode: str) -> list[ReplayedModel]:
    """`--replay-small-graphs`' mode on a pipeline: off wraps nothing; on wraps the graphs
    `GPTOSS_MAX_REPLAY_GRAPHS` names (settings.replay_graphs); check wraps them with each replay
    compared with an eager call (ReplayedModel.check)."""
    from gptoss_max import settings

    if mode not in settings.REPLAY_MODES:
        raise ValueError(f"replay mode {mode!r}; choose from {', '.join(settings.REPLAY_MODES)}")
    if mode == "off":
        return []
    return replay_overlap_graphs(pipeline, settings.replay_graphs(), check=mode == "check")


def device_sync_enabled() -> bool:
    """MAX's `device_sync_mode` flag for this process (`InferenceSession.debug`, a process-wide
    singleton): every device op waits for the one before it, so no two run at once. What
    `GPTOSS_MAX_DETERMINISTIC=on` (settings.deterministic) relies on. It holds only when MAX read
    `MODULAR_DEBUG=device-sync-mode` at import (settings.export_device_sync): set on the flag where
    the model is built, after the session exists, it did not make an H200 run repeat."""
    from max.engine import InferenceSession

    return bool(InferenceSession.debug.device_sync_mode)


def memory_manager_share() -> float:
    """The share of a GPU's free memory MAX's planner sees (the env override, else the default)."""
    raw = os.environ.get(MEMORY_MANAGER_SIZE_ENV, "").strip()
    try:
        share = float(raw) / 100 if raw else MEMORY_MANAGER_DEFAULT_SHARE
    except ValueError:
        return MEMORY_MANAGER_DEFAULT_SHARE
    return share if 0 < share <= 1 else MEMORY_MANAGER_DEFAULT_SHARE


def device_free_memory(device_id: int = 0) -> int:
    """Free memory of a GPU as MAX's planner reads it (`Device.stats["free_memory"]`)."""
    from max.driver import Accelerator

    return int(Accelerator(device_id).stats["free_memory"])


def plan_with_free_memory(pipeline_config: Any, arch: Any, free_memory: int, total_memory: int | None = None) -> Any:
    """MAX's own `MemoryEstimator.plan` for `pipeline_config`, with its device replaced by one
    whose stats report `free_memory`: what MAX would plan on a GPU, computed without one."""

    class _PlannedDevice:
        label = "gpu"
        id = 0

        def __init__(self) -> None:
            total = total_memory or free_memory
            self.stats = {"free_memory": free_memory, "total_memory": total}
            self.max_single_alloc_size = total

    real = max_memory_estimation.load_devices
    max_memory_estimation.load_devices = lambda specs: [_PlannedDevice() for _ in specs]
    try:
        return max_memory_estimation.MemoryEstimator.plan(pipeline_config, arch)
    finally:
        max_memory_estimation.load_devices = real


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


def tree_leaves(value: Any) -> list[Any]:
    """`max.tree.leaves(value)` (no `leaf` selector, aliases not shared), without the structure
    (`TreeDef`) and paths it builds: a replayed decode step flattens its KV inputs every step,
    and `tree.leaves` cost the 20b's step ~0.07 ms of host time on the H200 (bench/NOTES.md,
    "Fourteenth session"). The same walk: a node (`tree.is_node`) is taken apart one level at a
    time (`tree.flatten_one_level`), anything else is a leaf."""
    from max import tree

    out: list[Any] = []

    def walk(v: Any) -> None:
        if tree.is_node(v):
            for child in tree.flatten_one_level(v)[0]:
                walk(child)
        else:
            out.append(v)

    walk(value)
    return out


def model_abi_buffers(inputs: Any) -> tuple[Any, ...]:
    """The positional buffers of MAX 26.7's gpt_oss model call, in `GptOssModel.execute`'s order:
    tokens, return_n_logits, row offsets per device, signal buffers, KV-cache leaves. MAX's device
    graph capture (and replay) calls the compiled model with exactly these; 26.7's GptOssInputs
    does not define them (`buffers` raises), so its gpt_oss cannot be captured as shipped."""
    offsets = inputs.input_row_offsets if isinstance(inputs.input_row_offsets, list) else [inputs.input_row_offsets]
    kv = tree_leaves(inputs.kv_cache_inputs) if inputs.kv_cache_inputs is not None else []
    return (inputs.tokens, inputs.return_n_logits, *offsets, *inputs.signal_buffers, *kv)


def linear_weight_bias(layer: Any) -> tuple[Any, Any]:
    """(weight [N, K], bias [N] or None) of a MAX Linear, or of a StackedLinear (gpt_oss's q/k/v:
    its children's weights concatenated at graph-build time, as its own __call__ uses them)."""
    if isinstance(layer, StackedLinear):
        return layer.stacked_weight, layer.stacked_bias
    return layer.weight, layer.bias


def paged_kv_input_types(params: Any, device: Any) -> list[Any]:
    """Graph input types of MAX 26.7's paged KV cache for a graph that takes the cache as inputs
    (the attention tests, bench/attention.py, scripts/gpu_attn_probe.py): kv_blocks,
    page_stride, cache_lengths, lookup_table, max_prompt_length, max_cache_length, in that
    order (`paged_kv_values` reads them back). The per-page block layout is
    `params.shape_per_block` ([2, layers, page_size, kv_heads, head_dim]); the counters and the
    stride live on the host."""
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, TensorType

    cpu, u32 = DeviceRef.CPU(), DType.uint32
    return [
        BufferType(params.dtype, ["P", *params.shape_per_block], device),
        TensorType(DType.int64, [1], cpu),
        TensorType(u32, ["B"], device),
        TensorType(u32, ["B", "M"], device),
        TensorType(u32, [1], cpu),
        TensorType(u32, [1], cpu),
    ]


def paged_kv_dispatch_type() -> Any:
    """Graph input type of MAX 26.7's attention dispatch metadata (int64[4], on the host)."""
    from max.dtype import DType
    from max.graph import DeviceRef, TensorType

    return TensorType(DType.int64, [4], DeviceRef.CPU())


def paged_kv_values(cache_inputs: Any, dispatch: Any) -> Any:
    """MAX's `PagedCacheValues` from the graph inputs `paged_kv_input_types` declared (six, in
    its order) and the dispatch metadata input."""
    from max.nn.kv_cache import PagedCacheValues

    blocks, stride, lengths, table, max_prompt, max_cache = cache_inputs
    return PagedCacheValues(
        kv_blocks=blocks.buffer,
        cache_lengths=lengths.tensor,
        lookup_table=table.tensor,
        max_prompt_length=max_prompt.tensor,
        max_cache_length=max_cache.tensor,
        page_stride=stride.tensor,
        attention_dispatch_metadata=dispatch.tensor,
    )


__all__ = [
    "MEMORY_MANAGER_DEFAULT_SHARE",
    "MEMORY_MANAGER_SIZE_ENV",
    "device_free_memory",
    "kv_occupancy",
    "max_memory_estimation",
    "memory_manager_share",
    "paged_kv_dispatch_type",
    "paged_kv_input_types",
    "paged_kv_values",
    "plan_with_free_memory",
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
    "StackedLinear",
    "GptOssAttention",
    "GptOssTransformerBlock",
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
