"""gptoss_attention_rope_sinks (RoPE + this step's K/V store + sink attention, one op) against a
float64 NumPy restatement: rotate-half RoPE from MAX's (cos, sin) table, then causal sink attention
over the whole sequence (kernels/reference.py). The cache is checked afterwards: the new roped K and
V rows where MAX's layout puts them, every other element untouched. On the CPU, and on a GPU where
one is present, where pure decode steps of gpt-oss's attention shape (bf16, 64 query heads, 8 KV
heads, head_dim 64) take the one-launch kernel and the rest the two-step path.

One case also runs MAX's own rope_split_store_ragged + our attention op on the same inputs: the
fused op must agree with the composition it replaces (the table's layout and the pairing)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest

from gptoss_max.arch.rope import yarn_inv_freq
from gptoss_max.checkpoint import from_bf16_bits, to_bf16_bits
from gptoss_max.kernels import reference
from op_graphs import host_outputs, op_devices, poisons_that_differ, repeats_that_differ
from reporting import report

pytestmark = pytest.mark.slow

N_LAYERS, MAX_PAGES, N_POS = 2, 48, 2048
WINDOW = 128  # layer 0 is a sliding-window layer, layer 1 a full one


@dataclass(frozen=True)
class Shape:
    name: str
    n_heads: int
    n_kv: int
    head_dim: int
    page_size: int
    bf16: bool

    @property
    def qkv_width(self) -> int:
        return (self.n_heads + 2 * self.n_kv) * self.head_dim


GPTOSS = Shape("gptoss", 64, 8, 64, 32, True)
SMALL = Shape("small", 4, 2, 16, 16, False)


def _table(head_dim: int) -> np.ndarray:
    """A YaRN table as gpt-oss's: [N_POS, head_dim], (cos, sin) of frequency i at 2 i, 2 i + 1."""
    inv = yarn_inv_freq(head_dim, 150000.0, 32.0, 32.0, 1.0, 4096, False).astype(np.float64)
    angles = np.arange(N_POS, dtype=np.float64)[:, None] * inv[None, :]
    mscale = 0.1 * np.log(32.0) + 1.0
    table = np.empty((N_POS, head_dim), np.float64)
    table[:, 0::2], table[:, 1::2] = np.cos(angles) * mscale, np.sin(angles) * mscale
    return table.astype(np.float32)


def _build(kind: str, shape: Shape, max_rope: bool = False, core: str = "ours"):
    """Graph: qkv, table -> (layer 0 with WINDOW, layer 1 full) through our fused op, or with
    max_rope through MAX's rope_split_store_ragged and our attention op. core="max": MAX's RoPE and
    store, then MAX's flash_attention_ragged with sinks (what the model's prompt steps run on a GPU;
    on the CPU, whose kernel rejects windows below 256, causal on both layers). The cache is
    updated in place."""
    from max.driver import CPU, Accelerator
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType, ops
    from max.nn.attention import MHAMaskVariant
    from max.nn.kernels import flash_attention_ragged, rope_split_store_ragged
    from max.nn.kv_cache import MHAKVCacheParams

    from gptoss_max.kernels.ops import attention_rope_with_sinks, attention_with_sinks
    from gptoss_max.maxapi import paged_kv_dispatch_type, paged_kv_input_types, paged_kv_values

    device = Accelerator() if kind == "gpu" else CPU()
    dev, cpu = DeviceRef.from_device(device), DeviceRef.CPU()
    dtype = DType.bfloat16 if shape.bf16 else DType.float32
    f32, u32 = DType.float32, DType.uint32
    params = MHAKVCacheParams(
        dtype=dtype, n_kv_heads=shape.n_kv, head_dim=shape.head_dim, num_layers=N_LAYERS,
        page_size=shape.page_size, devices=[dev],
    )  # fmt: skip
    types = [
        TensorType(f32, ["T", shape.qkv_width], dev),
        TensorType(f32, [N_POS, shape.head_dim], dev),
        *paged_kv_input_types(params, dev),  # blocks, page_stride, lengths, lookup, max prompt / cache
        TensorType(u32, ["B1"], dev),  # input_row_offsets
        TensorType(f32, [shape.n_heads], dev),  # sinks
        paged_kv_dispatch_type(),
    ]
    name = f"attention_rope_{shape.name}_{kind}{'_max' if max_rope else ''}{'_maxcore' if core == 'max' else ''}"
    with Graph(name, input_types=types) as graph:
        qkv, table, *cache, offsets, sinks, meta = graph.inputs
        kv = paged_kv_values(cache, meta)
        x, freqs = ops.cast(qkv.tensor, dtype), ops.cast(table.tensor, dtype)
        scale = shape.head_dim**-0.5
        outs = []
        for layer, window in enumerate((WINDOW, None)):
            idx = ops.constant(layer, u32, device=cpu)
            if max_rope or core == "max":
                xq = rope_split_store_ragged(
                    kv_params=params, qkv=x, input_row_offsets=offsets.tensor, freqs_cis=freqs, kv_collection=kv,
                    layer_idx=idx, n_heads=shape.n_heads, interleaved=False,
                ).reshape((-1, shape.n_heads, shape.head_dim))  # fmt: skip
                if core == "max":
                    sliding = window is not None and kind == "gpu"
                    mask = MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK if sliding else MHAMaskVariant.CAUSAL_MASK
                    out = flash_attention_ragged(
                        params, input=xq, kv_collection=kv, layer_idx=idx, input_row_offsets=offsets.tensor,
                        mask_variant=mask, scale=scale, local_window_size=WINDOW,
                        sink_weights=ops.cast(sinks.tensor, dtype),
                    )  # fmt: skip
                else:
                    out = attention_with_sinks(xq, kv, idx, offsets.tensor, sinks.tensor, scale, window)
            else:
                out = attention_rope_with_sinks(
                    x, freqs, kv, idx, offsets.tensor, sinks.tensor, shape.n_heads, scale, window
                )
            outs.append(ops.cast(out, f32))
        graph.output(*outs)
    start = time.perf_counter()
    model = InferenceSession(devices=[device]).load(graph)
    report("attention rope op", f"compile {name}: {time.perf_counter() - start:.1f} s")
    return device, model


_MODELS: dict[tuple[str, str, bool, str], tuple] = {}


def _model(kind: str, shape: Shape, max_rope: bool = False, core: str = "ours"):
    key = (kind, shape.name, max_rope, core)
    if key not in _MODELS:
        _MODELS[key] = _build(kind, shape, max_rope, core)
    return _MODELS[key]


class Step:
    """One step's inputs (random history in scattered pages, garbage elsewhere) and its reference."""

    def __init__(self, shape: Shape, cached: list[int], new: list[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.shape, self.cached, self.new = shape, cached, new
        s = shape
        rnd = reference.round_to_bf16 if s.bf16 else (lambda a: a.astype(np.float32))
        self.totals = [c + n for c, n in zip(cached, new, strict=True)]
        pages_of = [-(-t // s.page_size) for t in self.totals]
        n_pages = sum(pages_of) + 3
        perm = rng.permutation(n_pages)
        self.lookup = np.zeros((len(new), MAX_PAGES), np.uint32)
        cursor = 0
        for b, used in enumerate(pages_of):
            self.lookup[b, :used] = perm[cursor : cursor + used]
            cursor += used
        self.pool = rnd(rng.standard_normal((n_pages, 2, N_LAYERS, s.page_size, s.n_kv, s.head_dim)) * 3)
        self.offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
        tokens = int(self.offsets[-1])
        self.qkv = rnd(rng.standard_normal((tokens, s.qkv_width)) * 2)
        self.table = _table(s.head_dim)
        self.sinks = (2 + rng.standard_normal(s.n_heads)).astype(np.float32)
        self.positions = [p for c, n in zip(cached, new, strict=True) for p in range(c, c + n)]

    def _slot(self, b: int, p: int) -> tuple[int, int]:
        return int(self.lookup[b, p // self.shape.page_size]), p % self.shape.page_size

    def inputs(self, device, far_pages: int = 0) -> list:
        """The graph's inputs. far_pages > 0: the pool has that many pages and this step's pages are
        its last ones (the same contents, the page table moved with them)."""
        from max.driver import Buffer
        from max.dtype import DType

        host_pool = to_bf16_bits(self.pool) if self.shape.bf16 else self.pool
        lookup = self.lookup
        if far_pages:
            shift = far_pages - self.pool.shape[0]
            big = np.zeros((far_pages, *self.pool.shape[1:]), host_pool.dtype)
            big[shift:] = host_pool
            host_pool, lookup = big, self.lookup + np.uint32(shift)
        pool = Buffer.from_numpy(host_pool)
        if self.shape.bf16:
            pool = pool.view(DType.bfloat16, list(host_pool.shape))
        arrays = [
            self.qkv, self.table, None, np.array([-1], np.int64), np.array(self.cached, np.uint32), lookup,
            np.array([max(self.new)], np.uint32), np.array([max(self.totals)], np.uint32), self.offsets, self.sinks,
            np.array([len(self.new), max(self.new), 1, max(self.totals)], np.int64),
        ]  # fmt: skip
        host = {3, 6, 7, 10}  # CPU-side inputs
        bufs = []
        for i, a in enumerate(arrays):
            buf = pool if a is None else Buffer.from_numpy(np.ascontiguousarray(a))
            bufs.append(buf if i in host else buf.to(device))
        return bufs

    def expected(self) -> tuple[list[np.ndarray], np.ndarray]:
        """(layer 0 and layer 1 outputs [T, n_heads, d], the pool after the step), float64 / dtype."""
        s, rnd = self.shape, (reference.round_to_bf16 if self.shape.bf16 else (lambda a: a.astype(np.float32)))
        table = rnd(self.table)  # the graph casts the table to the cache dtype, as the model does
        heads = self.qkv.reshape(-1, s.n_heads + 2 * s.n_kv, s.head_dim)
        q = rnd(reference.rope(heads[:, : s.n_heads], table, self.positions).astype(np.float32))
        k_new = rnd(reference.rope(heads[:, s.n_heads : s.n_heads + s.n_kv], table, self.positions).astype(np.float32))
        v_new = heads[:, s.n_heads + s.n_kv :]
        pool = self.pool.copy()
        row = 0
        for b, (c, n) in enumerate(zip(self.cached, self.new, strict=True)):
            for p in range(c, c + n):
                page, slot = self._slot(b, p)
                pool[page, 0, :, slot] = k_new[row]
                pool[page, 1, :, slot] = v_new[row]
                row += 1
        outs = []
        for layer, window in enumerate((WINDOW, None)):
            parts, row = [], 0
            for b, (c, n) in enumerate(zip(self.cached, self.new, strict=True)):
                slots = [self._slot(b, p) for p in range(c + n)]
                keys = np.stack([pool[pg, 0, layer, sl] for pg, sl in slots])
                values = np.stack([pool[pg, 1, layer, sl] for pg, sl in slots])
                parts.append(
                    reference.attention_with_sinks(
                        q[row : row + n], keys, values, self.sinks, range(c, c + n), s.head_dim**-0.5, window
                    )
                )
                row += n
            outs.append(np.concatenate(parts))
        return outs, pool

    def read_pool(self, buf) -> np.ndarray:
        from max.driver import CPU
        from max.dtype import DType

        host = buf.to(CPU())
        if self.shape.bf16:
            return from_bf16_bits(host.view(DType.uint16, list(self.pool.shape)).to_numpy()).reshape(self.pool.shape)
        return host.to_numpy()


CASES = [
    # (shape, cached per sequence, new tokens per sequence)
    (GPTOSS, [300], [1]),  # batch-1 decode: 16 key splits on the full layer
    (GPTOSS, [1000, 5, 129], [1, 1, 1]),  # batch-3 decode, a page boundary and the window's edge
    (GPTOSS, [40, 0], [1, 9]),  # a prompt beside a decode step: the two-step path
    # batch-17 decode: above ROPE_ONE_LAUNCH_TOKENS, the GPU's two-step path for a pure decode step
    (GPTOSS, [3 + 11 * i for i in range(17)], [1] * 17),
    (SMALL, [21, 0], [3, 9]),
    (SMALL, [10, 3, 47], [1, 1, 1]),
]


@pytest.mark.parametrize("kind", op_devices())
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1]}-{c[2]}")
def test_attention_rope_matches_float64(kind: str, case) -> None:
    from max.driver import CPU

    shape, cached, new = case
    step = Step(shape, cached, new, seed=sum(cached) * 31 + len(new))
    device, model = _model(kind, shape)
    inputs = step.inputs(device)
    outs = [o.to(CPU()).to_numpy() for o in model.execute(*inputs)]
    want, want_pool = step.expected()
    got_pool = step.read_pool(inputs[2])
    # The step's V rows are copies and nothing else in the pool moves: exact. K rows are roped in f32
    # against float64 before one rounding: one step of bf16 apart at most, or (float32) the f32
    # rounding of x cos - y sin, which cancels, relative to the terms' size.
    k_mask = np.zeros(want_pool.shape, bool)
    k_mask[:, 0] = True
    np.testing.assert_array_equal(got_pool[~k_mask], want_pool[~k_mask])
    got_k, want_k = got_pool[k_mask], want_pool[k_mask]
    if shape.bf16:
        np.testing.assert_allclose(got_k, want_k, rtol=2.0**-7, atol=0)
    else:
        np.testing.assert_allclose(got_k, want_k, rtol=0, atol=1e-6 * np.abs(want_k).max())
    tol = 1e-2 if shape.bf16 else 1e-5  # bf16 outputs carry ~3e-3 of rounding
    for layer, (got, ref) in enumerate(zip(outs, want, strict=True)):
        assert np.isfinite(got).all()
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        report("attention rope op", f"{kind} {shape.name} cached {cached} new {new} layer {layer}: rel err {rel:.2e}")
        assert rel <= tol


@pytest.mark.parametrize("core", ["ours", "max"])
@pytest.mark.parametrize("kind", op_devices())
def test_attention_rope_repeats_bitwise(kind: str, core: str) -> None:
    """Each case's step again and again (another case's step between every other repeat): the
    outputs and the cache equal the first run's bit for bit (a step only rewrites its own K/V rows
    with the same values, so the same inputs can run again). Ours, and MAX's flash attention (the
    model's prompt steps on a GPU), whose stale-slot and far-page checks failed on an H200 where its
    source masks what they vary (bench/NOTES.md): is it simply not repeatable?"""
    repeats = 8 if kind == "gpu" else 2
    failures = []
    for i, (shape, cached, new) in enumerate(CASES if core == "ours" else STALE_CASES):
        device, model = _model(kind, shape, core=core)
        step = Step(shape, cached, new, seed=7 + i)
        other_case = next(c for c in CASES[i + 1 :] + CASES[:i] if c[0] is shape)
        other = Step(shape, other_case[1], other_case[2], seed=99 + i).inputs(device)
        inputs = step.inputs(device)
        _, differ = repeats_that_differ(model, inputs, other, repeats, also=partial(step.read_pool, inputs[2]))
        report(
            "attention rope op repeats",
            f"{kind} {core} {shape.name} cached {cached} new {new}: {differ} of {repeats} differ",
        )
        if differ:
            failures.append((shape.name, cached, new, differ))
    assert not failures, f"(shape, cached, new, repeats that differ): {failures}"


def _unused_slots(step: Step) -> np.ndarray:
    """A mask over the pool: True where no sequence of the step has a position (history or new)."""
    used = np.zeros(step.pool.shape, bool)
    for b, total in enumerate(step.totals):
        for p in range(total):
            page, slot = step._slot(b, p)
            used[page, :, :, slot] = True
    return ~used


STALE_CASES = [*CASES[:4], (GPTOSS, [0], [69]), (GPTOSS, [100, 0], [29, 40])]


def _how_far(runs: list[list[np.ndarray]], step: Step) -> str:
    """Two runs' layer outputs that should be equal: how far apart they are, and each one's relative
    error against the float64 reference (a rounding-level difference, or a wrong result?)."""
    want, _ = step.expected()
    apart = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(runs[0][:2], runs[1][:2], strict=True))
    errs = [
        max(float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(run[:2], want, strict=True))
        for run in runs
    ]
    return f"max |diff| {apart:.3g}, rel err against float64 {errs[0]:.2e} / {errs[1]:.2e}"


@pytest.mark.parametrize("core", ["ours", "max"])
@pytest.mark.parametrize("kind", op_devices())
def test_attention_ignores_stale_cache_slots(kind: str, core: str) -> None:
    """What a request leaves in the cache must not reach another's attention: the same step over a
    pool whose unused slots (other pages, and the rest of its own last page) hold zeros, large
    leftovers, or NaN (a request whose K/V went bad), and zeros again after every other run, gives
    the same outputs bit for bit. Ours, and
    MAX's flash attention, which the model's prompt steps run on a GPU (a GPU greedy run was not
    repeatable, bench/results/repeat_h200_20261129.json; its sm90 source masks stale keys' scores
    but multiplies stale V rows by P = 0, so NaN there would leak)."""
    # Each fill over every case before the next fill, so every NaN run comes after all finite ones,
    # and a zero run again at the end: NaN there means the kernel read memory an earlier run left
    # (MAX's on an H200: bench/results/op_checks_h200_20261129b.log).
    fills = ("zeros", "leftovers", "nan", "zeros_again")
    runs: dict[int, dict[str, list[np.ndarray]]] = {i: {} for i in range(len(STALE_CASES))}
    used_before: dict[int, list[np.ndarray]] = {i: [] for i in range(len(STALE_CASES))}
    steps: dict[int, Step] = {}  # each case's step (same geometry and seed in every fill), for the report
    for fill in fills:
        for i, (shape, cached, new) in enumerate(STALE_CASES):
            device, model = _model(kind, shape, core=core)
            step = steps[i] = Step(shape, cached, new, seed=11 + i)
            unused = _unused_slots(step)
            rnd = reference.round_to_bf16 if shape.bf16 else (lambda a: a.astype(np.float32))
            stale = {"zeros": 0.0, "zeros_again": 0.0, "nan": np.nan}.get(fill)
            if stale is None:
                stale = rnd(40 * np.random.default_rng(i).standard_normal(int(unused.sum())))
            step.pool[unused] = stale
            inputs = step.inputs(device)
            used_before[i].append(step.read_pool(inputs[2])[~unused])
            runs[i][fill] = [*host_outputs(model, inputs), step.read_pool(inputs[2])[~unused]]
    failures = []
    for i, (shape, cached, new) in enumerate(STALE_CASES):
        assert all(np.array_equal(used_before[i][0], u) for u in used_before[i]), (
            "the pools start with the same sequences"
        )
        differ = {
            fill: [j for j, (a, b) in enumerate(zip(runs[i]["zeros"], out, strict=True)) if not np.array_equal(a, b)]
            for fill, out in runs[i].items()
            if fill != "zeros"
        }
        differ = {fill: js for fill, js in differ.items() if js}
        report(
            "attention stale slots",
            f"{kind} {core} {shape.name} cached {cached} new {new}: outputs that differ {differ}"
            + "".join(f"; {fill}: {_how_far([runs[i]['zeros'], runs[i][fill]], steps[i])}" for fill in differ),
        )
        if differ:
            failures.append((shape.name, cached, new, differ))
    assert not failures, (
        f"(shape, cached, new, {{fill: outputs that differ: 0/1 layers, 2 the used cache}}): {failures}"
    )


@pytest.mark.parametrize("kind", op_devices())
def test_attention_rope_outputs_ignore_what_their_memory_held(kind: str) -> None:
    """Our attention op gives the same bits whatever byte its outputs and split scratch held before
    it ran (GPTOSS_MAX_POISON; op_graphs.poisons_that_differ): decode, mixed and prompt steps."""
    failures = []
    for i, (shape, cached, new) in enumerate(STALE_CASES if kind == "gpu" else STALE_CASES[2:5]):
        device, model = _model(kind, shape)
        differ = poisons_that_differ(model, Step(shape, cached, new, seed=31 + i).inputs(device), outputs=[0, 1])
        report(
            "attention poison", f"{kind} {shape.name} cached {cached} new {new}: fills that change the outputs {differ}"
        )
        if differ:
            failures.append((shape.name, cached, new, differ))
    assert not failures, f"(shape, cached, new, fills that change the outputs): {failures}"


# Pages past 2^31 elements (and 2^32 bytes) of the pool on a GPU: a 24-layer model's 128-slot page
# holds 3.1 M elements, so a page id above ~680 is already there in a full-size KV cache.
FAR_PAGES = {"cpu": 700, "gpu": 66_000}  # gpu: 66,000 pages x 65,536 elements = 4.3 G elements (8.6 GB)


@pytest.mark.parametrize("core", ["ours", "max"])
@pytest.mark.parametrize("kind", op_devices())
def test_attention_reads_far_pages(kind: str, core: str) -> None:
    """The same step with its pages at the start of a small pool and at the end of a large one: the
    same outputs bit for bit (an offset computed in 32 bits would read elsewhere)."""
    failures = []
    for i, (shape, cached, new) in enumerate([STALE_CASES[0], STALE_CASES[2], STALE_CASES[4]]):
        device, model = _model(kind, shape, core=core)
        near = host_outputs(model, Step(shape, cached, new, seed=23 + i).inputs(device))
        # a new Step: the cache again as it was before the step
        far = host_outputs(model, Step(shape, cached, new, seed=23 + i).inputs(device, FAR_PAGES[kind]))
        differ = [j for j, (a, b) in enumerate(zip(near, far, strict=True)) if not np.array_equal(a, b)]
        report(
            "attention far pages",
            f"{kind} {core} cached {cached} new {new}: layers that differ {differ}"
            + (f"; {_how_far([near, far], Step(shape, cached, new, seed=23 + i))}" if differ else ""),
        )
        if differ:
            failures.append((cached, new, differ))
    assert not failures, f"(cached, new, layers that differ): {failures}"


def test_attention_rope_matches_max_rope_then_attention() -> None:
    """The fused op against MAX's rope_split_store_ragged (interleaved=False) + our attention op on
    the CPU, same inputs: same outputs and the same cache."""
    from max.driver import CPU

    step_args = (SMALL, [21, 0, 7], [3, 9, 1])
    got = []
    for max_rope in (False, True):
        step = Step(*step_args, seed=5)
        device, model = _model("cpu", SMALL, max_rope)
        inputs = step.inputs(device)
        got.append(([o.to(CPU()).to_numpy() for o in model.execute(*inputs)], step.read_pool(inputs[2])))
    (ours, ours_pool), (theirs, theirs_pool) = got
    np.testing.assert_allclose(ours_pool, theirs_pool, rtol=1e-6, atol=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_attention_rope_refuses_bad_shapes() -> None:
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, Graph, TensorType, ops
    from max.nn.kv_cache import PagedCacheValues

    from gptoss_max.kernels.ops import attention_rope_with_sinks

    cpu, f32, u32 = DeviceRef.CPU(), DType.float32, DType.uint32

    def build(qkv_width: int, table_width: int) -> None:
        types = [
            TensorType(f32, ["T", qkv_width], cpu),
            TensorType(f32, [N_POS, table_width], cpu),
            BufferType(f32, ["P", 2, N_LAYERS, 16, 2, 16], cpu),
            TensorType(DType.int64, [1], cpu),
            TensorType(u32, ["B"], cpu),
            TensorType(u32, ["B", "M"], cpu),
            TensorType(u32, ["B1"], cpu),
            TensorType(f32, [4], cpu),
        ]
        with Graph("attention_rope_bad", input_types=types) as g:
            qkv, table, blocks, stride, lengths, lookup, offsets, sinks = g.inputs
            one = ops.constant(np.array([1], np.uint32), u32, device=cpu)
            kv = PagedCacheValues(
                kv_blocks=blocks.buffer, cache_lengths=lengths.tensor, lookup_table=lookup.tensor,
                max_prompt_length=one, max_cache_length=one, page_stride=stride.tensor,
            )  # fmt: skip
            layer = ops.constant(0, u32, device=cpu)
            attention_rope_with_sinks(qkv.tensor, table.tensor, kv, layer, offsets.tensor, sinks.tensor, 4, 0.25, None)

    with pytest.raises(ValueError, match="qkv must be"):
        build(4 * 16, 16)  # q heads only
    with pytest.raises(ValueError, match="freqs_cis must be"):
        build(8 * 16, 8)
    build(8 * 16, 16)  # right shapes build
