"""Sink attention over a MAX paged KV cache, on CPU, against a NumPy reference.

The graph stores this step's K/V with MAX's own `mo.kv_cache.store.paged.ragged`
(as `rope_split_store_ragged` does), then runs our op on the same cache; the
cache buffer is read back to check where MAX put the new tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest

from gptoss_max.kernels import reference
from reporting import report

pytestmark = pytest.mark.slow

N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 16
N_LAYERS, LAYER, PAGE_SIZE, N_PAGES, MAX_PAGES = 2, 1, 16, 40, 16
WINDOW = 4
SCALE = HEAD_DIM**-0.5

def _compile(ours: bool):
    """Graph: store this step's K/V with MAX's op, then attend over the cache.

    ours=True outputs (our op with WINDOW, our op without window);
    ours=False outputs MAX's own CPU flash_attention_ragged with sinks (causal:
    MAX's CPU kernel rejects windows < 256). The cache is updated in place.
    """
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType, ops
    from max.nn.attention import MHAMaskVariant
    from max.nn.kernels import flash_attention_ragged, kv_cache_store_paged_ragged
    from max.nn.kv_cache import MHAKVCacheParams

    from gptoss_max.kernels.ops import attention_with_sinks
    from gptoss_max.maxapi import paged_kv_dispatch_type, paged_kv_input_types, paged_kv_values

    cpu = DeviceRef.CPU()
    f32, u32 = DType.float32, DType.uint32
    params = MHAKVCacheParams(
        dtype=f32,
        n_kv_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        num_layers=N_LAYERS,
        page_size=PAGE_SIZE,
        devices=[cpu],
    )
    assert params.shape_per_block == [2, N_LAYERS, PAGE_SIZE, N_KV_HEADS, HEAD_DIM]
    types = [
        TensorType(f32, ["T", N_HEADS, HEAD_DIM], cpu),  # q
        TensorType(f32, ["T", N_KV_HEADS, HEAD_DIM], cpu),  # new k
        TensorType(f32, ["T", N_KV_HEADS, HEAD_DIM], cpu),  # new v
        *paged_kv_input_types(params, cpu),  # blocks, page_stride, lengths, lookup, max prompt / cache
        TensorType(u32, ["B1"], cpu),  # input_row_offsets
        TensorType(f32, [N_HEADS], cpu),  # sinks
        paged_kv_dispatch_type(),
    ]
    with Graph(f"attention_sinks_{'ours' if ours else 'max'}", input_types=types) as graph:
        q, k, v, *cache, offsets, sinks, meta = graph.inputs
        kv = paged_kv_values(cache, meta)
        layer = ops.constant(LAYER, u32, device=cpu)
        for which, x in enumerate((k.tensor, v.tensor)):
            kv_cache_store_paged_ragged(kv, x, offsets.tensor, layer, key_or_value=which)
        if ours:
            args = (kv, layer, offsets.tensor, sinks.tensor, SCALE)
            windowed = attention_with_sinks(q.tensor, *args, window=WINDOW)
            graph.output(windowed, attention_with_sinks(q.tensor, *args, window=None))
        else:
            kv.kv_blocks_per_layer = None
            full = flash_attention_ragged(
                params,
                input=q.tensor,
                input_row_offsets=offsets.tensor,
                kv_collection=kv,
                layer_idx=layer,
                mask_variant=MHAMaskVariant.CAUSAL_MASK,
                scale=SCALE,
                sink_weights=sinks.tensor,
            )
            graph.output(full)
    start = time.perf_counter()
    compiled = InferenceSession(devices=[CPU()]).load(graph)
    report('attention op', f"compile {graph.name}: {time.perf_counter() - start:.1f} s")
    return compiled


@pytest.fixture(scope="module")
def model():
    return _compile(ours=True)


@dataclass
class Batch:
    cache_lengths: list[int]  # tokens cached before this step
    new_tokens: list[int]


@dataclass
class Case:
    """One step's inputs plus what the checks need; `page_pad` > 0 puts pages
    that many elements further apart than packed (MAX's padded pools)."""

    batch: Batch
    page_pad: int
    seed: int

    def __post_init__(self) -> None:
        from max.driver import Buffer

        rng = np.random.default_rng(self.seed)
        b_ = self.batch
        n_seq = len(b_.new_tokens)
        self.totals = [c + n for c, n in zip(b_.cache_lengths, b_.new_tokens, strict=True)]
        # Each sequence gets scattered pages; the rest of the pool holds garbage.
        pages = rng.permutation(N_PAGES)
        self.table = np.zeros((n_seq, MAX_PAGES), np.uint32)
        cursor = 0
        for b, total in enumerate(self.totals):
            used = -(-total // PAGE_SIZE)
            self.table[b, :used] = pages[cursor : cursor + used]
            cursor += used
        page_shape = (2, N_LAYERS, PAGE_SIZE, N_KV_HEADS, HEAD_DIM)
        packed = int(np.prod(page_shape))
        stride = packed + self.page_pad
        pool = (100 * rng.standard_normal(N_PAGES * stride)).astype(np.float32)
        self.pages = pool.reshape(N_PAGES, stride)[:, :packed].reshape(N_PAGES, *page_shape)
        kv_shape = (N_KV_HEADS, HEAD_DIM)
        self.keys = [rng.standard_normal((t, *kv_shape)).astype(np.float32) for t in self.totals]
        self.values = [rng.standard_normal((t, *kv_shape)).astype(np.float32) for t in self.totals]
        for b, cached in enumerate(b_.cache_lengths):  # history, in the layout we read
            for p in range(cached):
                self.pages[self._page(b, p), 0, LAYER, p % PAGE_SIZE] = self.keys[b][p]
                self.pages[self._page(b, p), 1, LAYER, p % PAGE_SIZE] = self.values[b][p]
        # The graph gets a packed-shaped view; padded, it is shorter than the
        # span the stride reaches (as MAX binds it), so the pool must be aliased.
        view = pool[: len(pool) // packed * packed].reshape(-1, *page_shape)
        self.offsets = np.concatenate([[0], np.cumsum(b_.new_tokens)]).astype(np.uint32)
        new_k = np.concatenate([self.keys[b][c:] for b, c in enumerate(b_.cache_lengths)])
        new_v = np.concatenate([self.values[b][c:] for b, c in enumerate(b_.cache_lengths)])
        # Scaled so that some logits exceed the sink (exercises the running max).
        q_shape = (int(self.offsets[-1]), N_HEADS, HEAD_DIM)
        self.q = (4 * rng.standard_normal(q_shape)).astype(np.float32)
        self.sinks = (6 + rng.standard_normal(N_HEADS)).astype(np.float32)
        arrays = [
            self.q,
            new_k,
            new_v,
            None,
            np.array([stride if self.page_pad else -1], np.int64),
            np.array(b_.cache_lengths, np.uint32),
            self.table,
            np.array([max(b_.new_tokens)], np.uint32),
            np.array([max(self.totals)], np.uint32),
            self.offsets,
            self.sinks,
            np.array([n_seq, max(b_.new_tokens), 1, max(self.totals)], np.int64),
        ]
        self.inputs = [Buffer.from_numpy(view if a is None else np.ascontiguousarray(a)) for a in arrays]

    def _page(self, b: int, p: int) -> int:
        return int(self.table[b, p // PAGE_SIZE])

    def check_store(self) -> None:
        """MAX's store put this step's K/V where our op reads them."""
        for b, (cached, total) in enumerate(zip(self.batch.cache_lengths, self.totals, strict=True)):
            for p in range(cached, total):
                page, slot = self._page(b, p), p % PAGE_SIZE
                np.testing.assert_array_equal(self.pages[page, 0, LAYER, slot], self.keys[b][p])
                np.testing.assert_array_equal(self.pages[page, 1, LAYER, slot], self.values[b][p])

    def reference(self, window: int | None) -> np.ndarray:
        parts = []
        for b, cached in enumerate(self.batch.cache_lengths):
            q = self.q[self.offsets[b] : self.offsets[b + 1]]
            positions = range(cached, self.totals[b])
            keys, values = self.keys[b], self.values[b]
            parts.append(reference.attention_with_sinks(q, keys, values, self.sinks, positions, SCALE, window))
        return np.concatenate(parts)

    def rel_err(self, out: np.ndarray, window: int | None, label: str) -> float:
        assert np.isfinite(out).all()
        ref = self.reference(window)
        rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        report('attention op', 
            f"{label:<4} cache {self.batch.cache_lengths} new {self.batch.new_tokens} "
            f"pad {self.page_pad} window {window}: rel err {rel:.2e}"
        )
        return rel


BATCHES = [
    Batch([0, 0], [7, 3]),  # two prefills of different lengths
    Batch([21, 0], [3, 9]),  # a chunk after a cached prefix, and a prefill
    Batch([10, 3], [1, 1]),  # decode steps
    Batch([0, 37], [200, 1]),  # a long prefill beside a decode step
]
BATCH_IDS = ["prefill", "chunked", "decode", "long"]


@pytest.mark.parametrize("batch", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("page_pad", [0, 40], ids=["packed", "padded"])
def test_attention_with_sinks(model, batch: Batch, page_pad: int) -> None:
    case = Case(batch, page_pad, seed=sum(batch.cache_lengths) + sum(batch.new_tokens))
    outs = [o.to_numpy() for o in model.execute(*case.inputs)]
    case.check_store()
    for window, out in zip((WINDOW, None), outs, strict=True):
        ref = case.reference(window)
        assert case.rel_err(out, window, "ours") <= 1e-5
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _max_rel_err(batch: Batch) -> float:
    case = Case(batch, 0, seed=sum(batch.cache_lengths) + sum(batch.new_tokens))
    (out,) = [o.to_numpy() for o in _max_model().execute(*case.inputs)]
    return case.rel_err(out, None, "MAX")


def test_max_cpu_sink_attention_short() -> None:
    """MAX 26.7's own CPU flash_attention_ragged with sinks (causal only: it
    rejects windows < 256) on the same cache: right while sequences are short."""
    assert _max_rel_err(Batch([0, 0], [100, 28])) <= 1e-5


@pytest.mark.xfail(
    strict=True,
    reason="MAX 26.7 CPU sink attention adds exp(sink) once per 128-key tile of the "
    "sequence (masked tiles included): effective sink = sink + ln(ceil(len / 128))",
)
@pytest.mark.parametrize("batch", [Batch([0, 0], [200, 40]), Batch([199, 39], [1, 1])], ids=["prefill", "decode"])
def test_max_cpu_sink_attention_long(batch: Batch) -> None:
    assert _max_rel_err(batch) <= 1e-4


_MAX_MODEL: list = []


def _max_model():
    if not _MAX_MODEL:
        _MAX_MODEL.append(_compile(ours=False))
    return _MAX_MODEL[0]
