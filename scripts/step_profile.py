#!/usr/bin/env python3
"""Where one decode step (and one prefill step) of our gpt-oss pipeline spends its GPU time,
kernel by kernel (issue 9: the per-kernel breakdown behind a missed target).

The model runs as `gptoss-max bench` runs it (src/gptoss_max/e2e.py: our architecture through
MAX's pipeline, `synthetic:20b|120b` weights made on the device, `batch` random prompts of
`--context` tokens, greedy, EOS ignored, prefill in waves of `--max-batch-input-tokens`):

  1. an untimed run of the same shapes warms every first-use cost;
  2. a second run is stepped under `torch.profiler` (CUDA activity = CUPTI, whose activity
     records cover every kernel the process launches, MAX's own included; the script says so if
     it gets none): every step from the first prefill step to the last profiled decode step is
     marked with a `record_function` range, and the first prefill step and `--steps` decode
     steps after `--warmup-steps` are reported. A kernel belongs to the step whose range holds
     its launch call (CUPTI's runtime/driver API record with the kernel's correlation id); without
     launch records, the step whose range holds the kernel's start, and if the clocks do not
     line up either, kernels are split at the largest idle gaps (the JSON says which: on an
     H100, 2026-11-21, an earlier version assigned by start time, fell back to the gaps and
     mixed the prefill's kernels into decode steps);
  3. GPU kernel time is summed per kernel name and per category (our MoE decode gate_up/down,
     our MoE prefill, our attention and its merge, MAX's attention, matmul/GEMM, norm, RoPE,
     router/top-k, sampling/logits, KV-cache writes, elementwise, memcpy/memset, other), per
     step (mean over the profiled steps) and per layer (the step's figure / the layer count).
     Each kernel also gets its exposed time: how far it pushed the step's end past the kernels
     that started before it. Under PDL and graph replay kernels overlap and their durations
     include their waits; the exposed times still add up to the span less its idle gaps.

Per step it also gives the step's wall time on the host, the GPU busy time (sum of kernel
durations) and span (first kernel start to last kernel end): wall minus busy is where the GPU
waited for the host (launch overhead, ~540 launches per batch-1 decode step). For decode, the
roofline time is the bytes a step must read (memory.decode_step_bytes) over the measured device
copy bandwidth.

Graph capture: `--graph-capture on` replays decode steps as CUDA graphs (MAX's overlap
pipeline). CUPTI reports kernels run from a CUDA graph as ordinary kernel records, but whether
torch's profiler (Kineto) keeps those of MAX's graphs has not been checked on a GPU yet, and the
overlap pipeline runs a step's kernels while the host prepares the next, so per-step windows
blur. The default is therefore off. With it on, the script warns (and writes
`graph_kernels_visible: false`) when a decode step shows fewer kernels than layers.

Programmatic dependent launch (kernels/pdl.mojo) is off by default here (`--pdl off` sets
GPTOSS_MAX_PDL=0): under PDL a kernel is placed on the SMs while the one before it still runs and
waits there, so its recorded duration includes that wait (20b batch 1, H100: the attention merge
1.85 us per call without PDL, 7.7 with it; the qkv head 12.9 against 16.2) and per-kernel times
stop adding up to the step. `--pdl on` profiles the launches as served.

Also recorded, before the pipeline loads: the device's free memory as CUDA and as MAX's
`Device.stats` report it (docs/GPU.md: MAX plans the KV cache from the latter).

Needs a CUDA GPU, MAX and torch (docs/GPU.md for staging); without one it exits with status 2.
Prints a table and writes <out>/step_profile_<gpu>_<yyyymmdd>.json (device, date, exact
command, rows per phase and category, every kernel name with its category and time).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

STEP_PREFIX = "gptoss_step"
OURS = "gptoss_kernels_"  # our Mojo package: kernel names start <package>_<module>_<function>

# (category, what it holds), in table order.
CATEGORIES = (
    ("moe_decode_gate_up", "our MXFP4 MoE decode kernel, gate_up + SwiGLU"),
    ("moe_decode_down", "our MXFP4 MoE decode kernel, down + combine"),
    ("moe_prefill", "our MXFP4 MoE prefill grouped GEMM (route, gemm, combine)"),
    ("attention_ours", "our sink attention (split-key kernel)"),
    ("attention_merge", "our sink attention, merge of the key splits"),
    ("attention_max", "MAX's flash attention / MHA kernels"),
    ("kv_cache", "writes into the paged KV cache"),
    ("matmul", "dense matmuls / GEMMs (qkv, o_proj, router, LM head)"),
    ("norm", "RMS norms"),
    ("router_fused", "our fused residual add + post-attention norm + router logits"),
    ("rope", "rotary embedding"),
    ("router_topk", "router top-k / softmax / MoE indices"),
    ("sampling", "sampling and logits post-processing"),
    ("ours_other", "other kernels of our package"),
    ("elementwise", "other elementwise kernels"),
    ("memcpy", "memcpy / memset"),
    ("other", "anything else"),
)
PER_LAYER = {
    "moe_decode_gate_up", "moe_decode_down", "moe_prefill", "attention_ours", "attention_merge",
    "attention_max", "kv_cache", "norm", "router_fused", "rope", "router_topk",
}  # fmt: skip

# Name rules for kernels outside our package (MAX's, std's, cuBLAS...), first match wins.
_RULES = (
    ("kv_cache", r"kv_cache_store|store_k_cache|store_v_cache|kv_cache.*(store|write|copy)|paged.*store"),
    ("attention_max", r"\bmha|_mha|mha_|flash_?att|flash_?decod|\bmla_|attention"),
    ("rope", r"rope|rotary"),
    ("norm", r"norm"),
    ("sampling", r"sampl|argmax|gumbel|top_?p\b|top_?p_|min_?p|penalt|logit|temperature"),
    ("router_topk", r"top_?k|moe_create_indices|router|softmax|moe_"),
    ("matmul", r"matmul|gemm|gemv|wgmma|\bmma|_mma|cublas|cutlass|linalg|sm90|tensor_core|tma"),
    ("elementwise", r"elementwise|foreach|vectorized|fill|\bcopy|concat|gather|scatter|cast|add|mul"),
)


@dataclass(frozen=True)
class KernelEvent:
    """One GPU activity from the trace: a kernel, or a memcpy/memset (kind)."""

    name: str
    start_us: float
    dur_us: float
    kind: str = "kernel"  # kernel | memcpy | memset
    block: tuple[int, ...] | None = None
    graph: bool = False  # launched from a CUDA graph (when the trace says so)
    correlation: int | None = None  # CUPTI's id linking it to its host-side launch call


@dataclass(frozen=True)
class Window:
    """One profiled pipeline step on the host's clock."""

    phase: str  # prefill | decode
    index: int
    start_us: float
    end_us: float


def categorize(name: str, kind: str = "kernel", block: tuple[int, ...] | None = None) -> str:
    """The category of one GPU activity (CATEGORIES)."""
    if kind in ("memcpy", "memset"):
        return "memcpy"
    if name.startswith(OURS) or "gptoss_kernels" in name:
        rest = name.split("gptoss_kernels_", 1)[-1]
        if rest.startswith("moe_gpu_gate_up") or rest.startswith("moe_gate_up"):
            return "moe_decode_gate_up"
        if rest.startswith("moe_gpu_down") or rest.startswith("moe_down"):
            return "moe_decode_down"
        if rest.startswith("moe_prefill"):
            return "moe_prefill"
        if rest.startswith("router_topk"):
            return "router_topk"
        if rest.startswith("router_decode"):
            return "router_fused"
        if rest.startswith("attention"):
            # Split and merge names are cut to the same 30 characters; the merge kernel is the
            # one launched with one warp per block (attention_gpu.mojo).
            one_warp = block is not None and tuple(block) in ((32,), (32, 1), (32, 1, 1))
            merge = "merge" in rest or one_warp
            return "attention_merge" if merge else "attention_ours"
        return "ours_other"
    low = name.lower()
    for category, pattern in _RULES:
        if re.search(pattern, low):
            return category
    return "other"


# ---------------------------------------------------------------------------------------------
# The trace


def kernel_events(trace: dict[str, Any]) -> list[KernelEvent]:
    """GPU activities of a Chrome trace as torch.profiler exports it (`cat` kernel, gpu_memcpy,
    gpu_memset; `ts`/`dur` in µs)."""
    kinds = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
    out = []
    for ev in trace.get("traceEvents", []):
        kind = kinds.get(str(ev.get("cat", "")).lower())
        if kind is None or ev.get("ph") != "X":
            continue
        args = ev.get("args") or {}
        block = args.get("block")
        graph = any(args.get(k) not in (None, 0, -1, "") for k in ("graph id", "graph_id", "graph node id"))
        out.append(
            KernelEvent(
                name=str(ev.get("name", "")),
                start_us=float(ev["ts"]),
                dur_us=float(ev.get("dur", 0.0)),
                kind=kind,
                block=tuple(int(b) for b in block) if isinstance(block, list | tuple) else None,
                graph=graph,
                correlation=int(args["correlation"]) if isinstance(args.get("correlation"), int) else None,
            )
        )
    return sorted(out, key=lambda e: e.start_us)


def launch_times(trace: dict[str, Any]) -> dict[int, float]:
    """Host time (µs) of each CUDA runtime / driver API call by CUPTI correlation id: when a GPU
    activity's launch call ran (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync...)."""
    out = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or str(ev.get("cat", "")).lower() not in ("cuda_runtime", "cuda_driver"):
            continue
        corr = (ev.get("args") or {}).get("correlation")
        if isinstance(corr, int):
            out[corr] = float(ev["ts"])
    return out


def step_windows(trace: dict[str, Any], prefix: str = STEP_PREFIX) -> list[Window]:
    """The `record_function(f"{prefix}:{phase}:{index}")` ranges of the trace (host side)."""
    out = []
    for ev in trace.get("traceEvents", []):
        name = str(ev.get("name", ""))
        if ev.get("ph") != "X" or not name.startswith(prefix + ":"):
            continue
        if str(ev.get("cat", "")).lower() == "gpu_user_annotation":
            continue
        _, phase, index = name.split(":")
        start = float(ev["ts"])
        out.append(Window(phase, int(index), start, start + float(ev.get("dur", 0.0))))
    return sorted(out, key=lambda w: w.start_us)


def _window_of(t: float, windows: list[Window]) -> Window | None:
    for w in windows:
        if w.start_us <= t <= w.end_us:
            return w
    return None


def assign_steps(
    events: list[KernelEvent], windows: list[Window], launches: dict[int, float] | None = None
) -> tuple[dict[Window, list[KernelEvent]], str]:
    """Each event to a step window (host clock), the first way that places at least half of the
    events near the windows (from the first window's start to the last one's end plus 1 s):

    - "launch": by the host time of its launch call (`launches`, by correlation id), which lies
      in the step that launched it whatever the GPU clock says and however late the GPU ran it;
    - "windows": by its own start time, if the GPU and host clocks line up;
    - "gaps": the events cut at the largest idle gaps, in window order (`windows` must then hold
      every step that ran while profiling, so that the cuts fall between steps).

    Returns (per window, method)."""
    by_window: dict[Window, list[KernelEvent]] = {w: [] for w in windows}
    if not windows:
        return by_window, "none"
    if not events:
        return by_window, "windows"
    lo, hi = windows[0].start_us, windows[-1].end_us + 1e6
    if launches:
        timed = [(ev, launches[ev.correlation]) for ev in events if ev.correlation in launches]
        if len(timed) >= 0.5 * len(events):
            for ev, t in timed:
                w = _window_of(t, windows)
                if w is not None:
                    by_window[w].append(ev)
            near = [t for _, t in timed if lo <= t <= hi]
            if sum(map(len, by_window.values())) >= 0.5 * max(len(near), 1):
                return by_window, "launch"
            by_window = {w: [] for w in windows}
    placed = 0
    for ev in events:
        w = _window_of(ev.start_us, windows)
        if w is not None:
            by_window[w].append(ev)
            placed += 1
    nearby = [e for e in events if lo <= e.start_us <= hi] or events
    if placed >= 0.5 * len(nearby):
        return by_window, "windows"
    return split_at_gaps(events, windows), "gaps"


def split_at_gaps(events: list[KernelEvent], windows: list[Window]) -> dict[Window, list[KernelEvent]]:
    """The events (sorted by start) cut into len(windows) runs at the largest idle gaps between one
    event's end and the next one's start."""
    events = sorted(events, key=lambda e: e.start_us)
    n = len(windows)
    gaps = sorted(
        range(1, len(events)),
        key=lambda i: events[i].start_us - max(e.start_us + e.dur_us for e in events[:i]),
        reverse=True,
    )[: n - 1]
    cuts = [0, *sorted(gaps), len(events)]
    return {w: events[cuts[i] : cuts[i + 1]] for i, w in enumerate(windows)}


# ---------------------------------------------------------------------------------------------
# Aggregation


BY_CALL_MAX = 64  # calls per step up to which a kernel row lists its mean time per call position


def by_call(steps: list[list[float]], n_steps: int) -> list[float] | None:
    """The mean duration of a kernel's k-th call of a step, over the steps (µs), e.g. layer by
    layer, or sliding-window against full attention layers; None unless every one of the n_steps
    steps made the same number of calls (at most BY_CALL_MAX)."""
    counts = {len(d) for d in steps}
    if len(steps) != n_steps or len(counts) != 1 or counts.pop() > BY_CALL_MAX:
        return None
    return [round(sum(col) / n_steps, 2) for col in zip(*steps, strict=True)]


def exposed(events: list[KernelEvent]) -> list[float]:
    """Per event (in start order): how far it pushes the step's end past every event that started
    before it (µs, >= 0). Kernels that overlap (programmatic dependent launch, graph replay)
    record durations that include their waits, so their durations overlap and over-count; these
    shares do not: they add up to the step's span less its idle gaps, and a kernel whose time
    is hidden behind another's gets ~0."""
    out, frontier = [], None
    for e in sorted(events, key=lambda e: e.start_us):
        end = e.start_us + e.dur_us
        if frontier is None:
            out.append(e.dur_us)
            frontier = end
            continue
        out.append(max(0.0, end - max(frontier, e.start_us)))
        frontier = max(frontier, end)
    return out


def summarize(by_window: dict[Window, list[KernelEvent]], n_layers: int) -> dict[str, Any]:
    """Per phase: per-step figures (means over its profiled steps), rows per category and per
    kernel name. Times in µs."""
    phases: dict[str, Any] = {}
    for phase in sorted({w.phase for w in by_window}, key=lambda p: (p != "decode", p)):
        wins = [w for w in by_window if w.phase == phase]
        n = len(wins)
        per_step = []
        cat_us: dict[str, float] = {}
        cat_calls: dict[str, int] = {}
        names: dict[tuple[str, str], list[float]] = {}
        exposed_us: dict[str, float] = {}  # per kernel name, summed over the steps
        # per kernel name, each step's durations in launch order (the k-th call of a step is the
        # same layer's in every step)
        calls: dict[str, list[list[float]]] = {}
        for w in sorted(wins, key=lambda w: w.index):
            evs = sorted(by_window[w], key=lambda e: e.start_us)
            in_step: dict[str, list[float]] = {}
            busy = sum(e.dur_us for e in evs)
            span = (max(e.start_us + e.dur_us for e in evs) - min(e.start_us for e in evs)) if evs else 0.0
            per_step.append(
                {
                    "index": w.index,
                    "wall_us": round(w.end_us - w.start_us, 1),
                    "gpu_busy_us": round(busy, 1),
                    "gpu_span_us": round(span, 1),
                    "kernels": sum(e.kind == "kernel" for e in evs),
                    "graph_kernels": sum(e.graph for e in evs),
                }
            )
            for e, x in zip(evs, exposed(evs), strict=True):
                exposed_us[e.name] = exposed_us.get(e.name, 0.0) + x
            for e in evs:
                c = categorize(e.name, e.kind, e.block)
                cat_us[c] = cat_us.get(c, 0.0) + e.dur_us
                cat_calls[c] = cat_calls.get(c, 0) + 1
                names.setdefault((e.name, c), []).append(e.dur_us)
                in_step.setdefault(e.name, []).append(e.dur_us)
            for name, durs in in_step.items():
                calls.setdefault(name, []).append(durs)
        busy_total = sum(cat_us.values()) or 1.0
        categories = []
        for c, what in CATEGORIES:
            if c not in cat_us:
                continue
            us = cat_us[c] / n
            categories.append({
                "category": c,
                "what": what,
                "us_per_step": round(us, 2),
                "us_per_layer": round(us / n_layers, 2) if c in PER_LAYER else None,
                "launches_per_step": round(cat_calls[c] / n, 2),
                "share": round(cat_us[c] / busy_total, 4),
            })  # fmt: skip
        kernels = [
            {
                "name": name,
                "category": c,
                "us_per_step": round(sum(d) / n, 2),
                "calls_per_step": round(len(d) / n, 2),
                "mean_us": round(sum(d) / len(d), 2),
                "share": round(sum(d) / busy_total, 4),
                "exposed_us_per_step": round(exposed_us.get(name, 0.0) / n, 2),
                "by_call_us": by_call(calls[name], n),
            }
            for (name, c), d in names.items()
        ]
        kernels.sort(key=lambda r: -r["us_per_step"])

        def mean(key: str, rows: list[dict[str, Any]] = per_step) -> float:
            return round(sum(r[key] for r in rows) / max(1, len(rows)), 1)

        phases[phase] = {
            "steps": n,
            "layers": n_layers,
            "wall_us_per_step": mean("wall_us"),
            "gpu_busy_us_per_step": mean("gpu_busy_us"),
            "gpu_span_us_per_step": mean("gpu_span_us"),
            "kernels_per_step": mean("kernels"),
            "per_step": per_step,
            "categories": categories,
            "kernels": kernels,
        }
    return phases


def format_table(phases: dict[str, Any], top: int = 15) -> str:
    lines = []
    for phase, s in phases.items():
        lines.append(
            f"\n{phase}: {s['steps']} step(s), {s['layers']} layers; "
            f"per step: wall {s['wall_us_per_step'] / 1e3:.3f} ms, "
            f"GPU busy {s['gpu_busy_us_per_step'] / 1e3:.3f} ms, span {s['gpu_span_us_per_step'] / 1e3:.3f} ms, "
            f"{s['kernels_per_step']:.0f} kernels"
            + (f", roofline {s['roofline_us_per_step'] / 1e3:.3f} ms" if s.get("roofline_us_per_step") else "")
        )
        lines.append("| category | µs/step | µs/layer | launches/step | share |")
        lines.append("|---|---|---|---|---|")
        for r in s["categories"]:
            per_layer = "—" if r["us_per_layer"] is None else f"{r['us_per_layer']:.2f}"
            cells = [r["category"], f"{r['us_per_step']:.1f}", per_layer, f"{r['launches_per_step']:.1f}",
                     f"{100 * r['share']:.1f} %"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines.append(f"top {top} kernels:")
        lines.append("| kernel | category | µs/step | calls/step | mean µs | exposed µs/step |")
        lines.append("|---|---|---|---|---|---|")
        for r in s["kernels"][:top]:
            name = r["name"] if len(r["name"]) <= 70 else r["name"][:67] + "..."
            cells = [f"`{name}`", r["category"], f"{r['us_per_step']:.1f}", f"{r['calls_per_step']:.1f}",
                     f"{r['mean_us']:.2f}", f"{r.get('exposed_us_per_step', 0.0):.1f}"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The run (GPU)


class StepProfiler:
    """`run_batch`'s step hook: starts torch.profiler at the first chosen step, marks every step
    from there with a record_function range (the chosen ones are reported; the others keep the
    assignment of kernels to steps honest), stops after the last chosen one."""

    def __init__(self, torch: Any, chosen: set[tuple[str, int]]):
        self.torch = torch
        self.chosen = set(chosen)
        self.left = set(chosen)
        self.prof: Any = None

    @contextlib.contextmanager
    def __call__(self, phase: str, index: int) -> Iterator[None]:
        if (phase, index) not in self.chosen and (self.prof is None or not self.left):
            yield
            return
        from torch.profiler import ProfilerActivity, profile, record_function

        if self.prof is None:
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
        with record_function(f"{STEP_PREFIX}:{phase}:{index}"):
            yield
        self.left.discard((phase, index))
        if not self.left:
            self.prof.__exit__(None, None, None)

    def trace(self) -> dict[str, Any]:
        if self.prof is None:
            raise RuntimeError("no chosen step ran: nothing was profiled")
        if self.left:  # the run ended before every chosen step
            self.prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            self.prof.export_chrome_trace(str(path))
            return json.loads(path.read_text())


def device_memory(torch: Any) -> dict[str, Any]:
    """Free device memory as CUDA and as MAX report it (MAX plans its KV cache from the latter)."""
    from gptoss_max import maxapi

    free, total = torch.cuda.mem_get_info()
    out: dict[str, Any] = {"cuda_free_bytes": int(free), "cuda_total_bytes": int(total)}
    try:
        out["max_free_bytes"] = maxapi.device_free_memory(0)
        out["max_over_cuda_free"] = round(out["max_free_bytes"] / free, 4)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        out["max_error"] = repr(e)[:300]
    out["memory_manager_size_percent_env"] = os.environ.get("MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT")
    return out


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("scripts/step_profile.py needs torch with CUDA (and a CUDA GPU)", file=sys.stderr)
        return 2
    from moe import copy_bandwidth, open_gpu, result_header

    gpu = open_gpu(torch, "scripts/step_profile.py")  # exits 2 without a CUDA GPU
    gpu.session = gpu.dev = gpu.dref = gpu.timer = None  # the pipeline opens its own
    gc.collect()
    copy_tb_s = copy_bandwidth(torch, gib=1.0)
    torch.cuda.empty_cache()

    from gptoss_max import e2e, memory, settings
    from gptoss_max.engine import Engine, EngineOptions

    spec, mxfp4, _ = e2e._spec_of(args.model)
    n_layers = spec.num_hidden_layers
    mem_before = device_memory(torch)
    print(f"device {gpu.gpu_name}; copy {copy_tb_s:.2f} TB/s; memory before load: {mem_before}", flush=True)
    decode_total = args.warmup_steps + args.steps
    output_len = decode_total + 2
    opts = EngineOptions(
        model=args.model,
        device="gpu",
        max_length=args.context + output_len + 16,
        max_batch_size=args.batch,
        kv_memory_fraction=args.kv_memory_fraction,
        encoding=args.encoding,
        graph_capture=args.graph_capture == "on",
        max_batch_input_tokens=args.max_batch_input_tokens,
    )
    t0 = time.perf_counter()
    engine = Engine(opts)
    load_s = time.perf_counter() - t0
    plan = engine.memory_plan
    print(f"loaded in {load_s:.0f} s (capture {engine.capture_seconds:.0f} s)", flush=True)
    budget = args.max_batch_input_tokens or 8192
    batch_prompts = e2e.prompts(args.batch, args.context, args.seed)
    e2e.run_batch(engine, e2e.prompts(args.batch, args.context, args.seed + 1), output_len, budget)  # warm
    chosen = {("decode", i) for i in range(args.warmup_steps, decode_total)}
    if args.prefill:
        chosen.add(("prefill", 0))
    hook = StepProfiler(torch, chosen)
    with e2e.gc_mode(args.gc):
        timing = e2e.run_batch(engine, batch_prompts, output_len, budget, step_hook=hook)
    trace = hook.trace()

    events = kernel_events(trace)
    by_window, method = assign_steps(events, step_windows(trace), launch_times(trace))
    by_window = {w: evs for w, evs in by_window.items() if (w.phase, w.index) in chosen}
    phases = summarize(by_window, n_layers)
    context = args.context + args.warmup_steps + args.steps / 2
    step_bytes = memory.decode_step_bytes(spec, mxfp4, args.batch, context)
    if "decode" in phases:
        phases["decode"]["roofline_us_per_step"] = round(step_bytes["total"] / (copy_tb_s * 1e12) * 1e6, 1)
        phases["decode"]["bytes_per_step"] = int(step_bytes["total"])
    warnings = []
    visible = None
    if args.graph_capture == "on" and "decode" in phases:
        visible = phases["decode"]["kernels_per_step"] >= n_layers
        if not visible:
            warnings.append(
                f"graph capture on: only {phases['decode']['kernels_per_step']:.0f} kernels per decode step were seen "
                f"(< {n_layers} layers): the profiler does not see the kernels of MAX's device graphs; "
                "use --graph-capture off for the breakdown"
            )
    if not events:
        warnings.append(
            "the profiler saw no GPU activity at all (CUPTI reported no kernel of MAX's in this process); "
            "nothing to break down: profile with nsys instead"
        )
    if method == "gaps":
        warnings.append(
            "kernels were assigned to steps at idle gaps (no launch records, and the trace's host and GPU clocks "
            "did not line up)"
        )

    print(format_table(phases, args.top))
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    result = {
        **result_header("scripts/step_profile.py", args.argv, gpu, copy_tb_s),
        "model": args.model,
        "batch": args.batch,
        "context": args.context,
        "warmup_steps": args.warmup_steps,
        "graph_capture": args.graph_capture == "on",
        "graph_kernels_visible": visible,
        "pdl": args.pdl == "on",
        "gc": args.gc,
        "attention": settings.attention_impl(),
        "moe_path": os.environ.get("GPTOSS_MAX_MOE_PATH", "auto"),
        "router": settings.router_impl(),
        "topk": settings.topk_impl(),
        "layers": n_layers,
        "step_assignment": method,
        "kernel_events": len(events),
        "unassigned_kernel_events": len(events) - sum(len(v) for v in by_window.values()),
        "device_memory_before_load": mem_before,
        "memory_plan": {
            "kv_cache_bytes": getattr(plan, "available_cache_memory", None),
            "footprint_bytes": getattr(plan, "footprint", None),
        },
        "load_seconds": round(load_s, 1),
        "capture_seconds": round(engine.capture_seconds, 1),
        "run": timing,
        "warnings": warnings,
        "categories": {c: what for c, what in CATEGORIES},
        "phases": phases,
    }
    path = gpu.result_path(args.out, "step_profile")
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    if args.keep_trace:
        tpath = gpu.result_path(args.out, "step_profile_trace", "json.gz")
        with gzip.open(tpath, "wt") as f:
            json.dump(trace, f)
        print(f"wrote {tpath}")
    return 0 if events else 1


def parser() -> argparse.ArgumentParser:
    from gptoss_max.e2e import GC_MODES

    p = argparse.ArgumentParser(
        prog="scripts/step_profile.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="synthetic:20b", help="synthetic:<20b|120b>[,layers=N] or a local checkpoint dir")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence (default 1024)")
    p.add_argument("--steps", type=int, default=5, help="decode steps profiled (default 5)")
    p.add_argument("--warmup-steps", type=int, default=8, help="decode steps run before the profiled ones (default 8)")
    p.add_argument("--no-prefill", dest="prefill", action="store_false", help="do not profile the first prefill step")
    p.add_argument(
        "--graph-capture",
        choices=["off", "on"],
        default="off",
        help="decode steps replay MAX's captured device graphs (default off: see above)",
    )
    p.add_argument(
        "--pdl",
        choices=["off", "on"],
        default="off",
        help="programmatic dependent launch of one-token steps (default off: durations then exclude the wait)",
    )
    p.add_argument("--encoding", default=None, help="MAX encoding of the dense weights (default bfloat16)")
    p.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=None,
        help="MAX's device_memory_utilization (default 0.9; 120b at batch 64 on an 80 GB GPU needs ~0.97, docs/GPU.md)",
    )
    p.add_argument(
        "--max-batch-input-tokens", type=int, default=None, help="prompt tokens per prefill step (MAX default 8192)"
    )
    p.add_argument(
        "--gc",
        choices=GC_MODES,
        default="default",
        help="Python's garbage collector around the profiled run, as bench/e2e.py's --gc (collect: the warm-up's "
        "garbage freed first; the memcpy rows then show whether host copies stay pinned)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--top", type=int, default=15, help="kernels listed per phase in the printed table")
    p.add_argument("--out", default="bench/results", help="directory for step_profile_<gpu>_<yyyymmdd>.json")
    p.add_argument("--keep-trace", action="store_true", help="also write the raw Chrome trace (.json.gz) under --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = argv
    # Read by our kernels' launchers on the host at every launch (kernels/pdl.mojo).
    os.environ["GPTOSS_MAX_PDL"] = "1" if args.pdl == "on" else "0"
    if args.steps < 1 or args.batch < 1 or args.context < 1:
        raise SystemExit("--steps, --batch and --context must be positive")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
