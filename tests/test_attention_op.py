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

pytestmark = pytest.mark.slow

N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 16
N_LAYERS, LAYER, PAGE_SIZE, N_PAGES, MAX_PAGES = 2, 1, 4, 16, 6
WINDOW = 4
SCALE = HEAD_DIM**-0.5

_summary: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def fidelity_summary(request: pytest.FixtureRequest):
    yield
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        print("\n[attention op] " + "\n[attention op] ".join(_summary))


@pytest.fixture(scope="module")
def model():
    """Outputs: (windowed attention, full attention); the cache is updated in place."""
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import BufferType, DeviceRef, Graph, TensorType, ops
    from max.nn.kernels import kv_cache_store_paged_ragged
    from max.nn.kv_cache import PagedCacheValues

    from gptoss_max.kernels.ops import attention_with_sinks

    cpu = DeviceRef.CPU()
    f32, u32 = DType.float32, DType.uint32
    types = [
        TensorType(f32, ["T", N_HEADS, HEAD_DIM], cpu),  # q
        TensorType(f32, ["T", N_KV_HEADS, HEAD_DIM], cpu),  # new k
        TensorType(f32, ["T", N_KV_HEADS, HEAD_DIM], cpu),  # new v
        BufferType(f32, ["P", 2, N_LAYERS, PAGE_SIZE, N_KV_HEADS, HEAD_DIM], cpu),
        TensorType(DType.int64, [1], cpu),  # page_stride
        TensorType(u32, ["B"], cpu),  # cache_lengths
        TensorType(u32, ["B", "M"], cpu),  # lookup_table
        TensorType(u32, [1], cpu),  # max_prompt_length
        TensorType(u32, [1], cpu),  # max_cache_length
        TensorType(u32, ["B1"], cpu),  # input_row_offsets
        TensorType(f32, [N_HEADS], cpu),  # sinks
    ]
    with Graph("attention_with_sinks", input_types=types) as graph:
        q, k, v, blocks, stride, lengths, table, max_prompt, max_cache, offsets, sinks = (
            graph.inputs
        )
        kv = PagedCacheValues(
            kv_blocks=blocks.buffer,
            cache_lengths=lengths.tensor,
            lookup_table=table.tensor,
            max_prompt_length=max_prompt.tensor,
            max_cache_length=max_cache.tensor,
            page_stride=stride.tensor,
        )
        layer = ops.constant(LAYER, u32, device=cpu)
        for which, x in enumerate((k.tensor, v.tensor)):
            kv_cache_store_paged_ragged(kv, x, offsets.tensor, layer, key_or_value=which)
        args = (kv, layer, offsets.tensor, sinks.tensor, SCALE)
        windowed = attention_with_sinks(q.tensor, *args, window=WINDOW)
        full = attention_with_sinks(q.tensor, *args, window=None)
        graph.output(windowed, full)
    start = time.perf_counter()
    compiled = InferenceSession(devices=[CPU()]).load(graph)
    _summary.append(f"compile: {time.perf_counter() - start:.1f} s")
    return compiled


@dataclass
class Batch:
    cache_lengths: list[int]  # tokens cached before this step
    new_tokens: list[int]


def _reference(q, keys, values, sinks, positions, window):
    """q [n, H, D]; keys/values [len, KVH, D] of one sequence; float64 math."""
    group = N_HEADS // N_KV_HEADS
    out = np.zeros(q.shape)
    for row, p in enumerate(positions):
        first = max(p - window + 1, 0) if window else 0
        for h in range(N_HEADS):
            k = keys[first : p + 1, h // group].astype(np.float64)
            v = values[first : p + 1, h // group].astype(np.float64)
            logits = SCALE * (k @ q[row, h].astype(np.float64))
            m = max(logits.max(), sinks[h])
            w = np.exp(logits - m)
            out[row, h] = (w @ v) / (w.sum() + np.exp(sinks[h] - m))
    return out


def _run_case(model, batch: Batch, seed: int, page_pad: int) -> None:
    """`page_pad` > 0 puts the pages `page_pad` elements further apart than
    packed and passes that stride as `page_stride` (MAX's padded pools)."""
    from max.driver import Buffer

    rng = np.random.default_rng(seed)
    n_seq = len(batch.new_tokens)
    totals = [c + n for c, n in zip(batch.cache_lengths, batch.new_tokens, strict=True)]
    # Every sequence gets scattered pages; the rest of the pool holds garbage.
    pages = rng.permutation(N_PAGES)
    table = np.zeros((n_seq, MAX_PAGES), np.uint32)
    cursor = 0
    for b, total in enumerate(totals):
        used = -(-total // PAGE_SIZE)
        table[b, :used] = pages[cursor : cursor + used]
        cursor += used
    page_shape = (2, N_LAYERS, PAGE_SIZE, N_KV_HEADS, HEAD_DIM)
    stride = int(np.prod(page_shape)) + page_pad
    pool = (100 * rng.standard_normal(N_PAGES * stride)).astype(np.float32)
    pages_of = pool.reshape(N_PAGES, stride)[:, : stride - page_pad].reshape(N_PAGES, *page_shape)
    keys = [rng.standard_normal((t, N_KV_HEADS, HEAD_DIM)).astype(np.float32) for t in totals]
    values = [rng.standard_normal((t, N_KV_HEADS, HEAD_DIM)).astype(np.float32) for t in totals]
    for b, cached in enumerate(batch.cache_lengths):  # history, in the layout we read
        for p in range(cached):
            page, slot = table[b, p // PAGE_SIZE], p % PAGE_SIZE
            pages_of[page, 0, LAYER, slot] = keys[b][p]
            pages_of[page, 1, LAYER, slot] = values[b][p]
    # The graph sees a packed-shaped view; with padding it is shorter than the
    # span the stride reaches (as MAX binds it), so the pool must be aliased.
    n_view = len(pool) // (stride - page_pad)
    blocks = Buffer.from_numpy(pool[: n_view * (stride - page_pad)].reshape(n_view, *page_shape))
    offsets = np.concatenate([[0], np.cumsum(batch.new_tokens)]).astype(np.uint32)
    new_k = np.concatenate([keys[b][c:] for b, c in enumerate(batch.cache_lengths)])
    new_v = np.concatenate([values[b][c:] for b, c in enumerate(batch.cache_lengths)])
    # Scaled so that some logits exceed the sink (exercises the running max).
    q = (4 * rng.standard_normal((int(offsets[-1]), N_HEADS, HEAD_DIM))).astype(np.float32)
    sinks = (6 + rng.standard_normal(N_HEADS)).astype(np.float32)

    inputs = [
        q,
        new_k,
        new_v,
        blocks,
        np.array([stride if page_pad else -1], np.int64),
        np.array(batch.cache_lengths, np.uint32),
        table,
        np.array([max(batch.new_tokens)], np.uint32),
        np.array([max(totals)], np.uint32),
        offsets,
        sinks,
    ]
    args = [
        a if isinstance(a, Buffer) else Buffer.from_numpy(np.ascontiguousarray(a)) for a in inputs
    ]
    windowed, full = (o.to_numpy() for o in model.execute(*args))

    for b, (cached, total) in enumerate(zip(batch.cache_lengths, totals, strict=True)):
        for p in range(cached, total):  # MAX wrote this step's K/V where we read it
            page, slot = table[b, p // PAGE_SIZE], p % PAGE_SIZE
            np.testing.assert_array_equal(pages_of[page, 0, LAYER, slot], keys[b][p])
            np.testing.assert_array_equal(pages_of[page, 1, LAYER, slot], values[b][p])

    for window, out in ((WINDOW, windowed), (None, full)):
        ref = np.concatenate(
            [
                _reference(
                    q[offsets[b] : offsets[b + 1]],
                    keys[b],
                    values[b],
                    sinks,
                    range(batch.cache_lengths[b], totals[b]),
                    window,
                )
                for b in range(n_seq)
            ]
        )
        assert np.isfinite(out).all()
        rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        _summary.append(
            f"cache {batch.cache_lengths} new {batch.new_tokens} pad {page_pad} "
            f"window {window}: rel err {rel:.2e}"
        )
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(
    "batch",
    [
        Batch([0, 0], [7, 3]),  # two prefills of different lengths
        Batch([5, 0], [3, 9]),  # a chunk after a cached prefix, and a prefill
        Batch([10, 3], [1, 1]),  # decode steps
    ],
    ids=["prefill", "chunked", "decode"],
)
@pytest.mark.parametrize("page_pad", [0, 40], ids=["packed", "padded"])
def test_attention_with_sinks(model, batch: Batch, page_pad: int) -> None:
    _run_case(
        model, batch, seed=sum(batch.cache_lengths) + sum(batch.new_tokens), page_pad=page_pad
    )
