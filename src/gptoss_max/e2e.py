"""`gptoss-max bench` (also `bench/e2e.py`): end-to-end decode throughput of our pipeline, MAX's
stock gpt_oss pipeline on the same checkpoint, and the bytes-per-token roofline.

For each batch size: `batch` prompts of `--prompt-len` random tokens, `--output-len` tokens each,
EOS ignored, greedy. Prompts are prefilled in waves of at most `--max-batch-input-tokens`
tokens (as MAX's scheduler chunks them), then every row decodes together:

- TTFT: mean time from the start to each row's first token (batch 1: the prompt's TTFT);
- decode tok/s (`ours_tok_s`): tokens generated after every row has its first token, over that
  time; TPOT: that time over `output-len - 1` steps. Beside it each step's own time (median, 90th
  percentile, maximum), the steps that took over twice the median, and Python's garbage
  collections during the batch: a mean above the median means host stalls, not slower kernels,
  so A/B comparisons read the median;
- peak GPU memory (nvidia-smi, else MAX's device stats) while the batch runs;
- roofline: batch / (bytes one decode step reads, memory.decode_step_bytes) x the device's
  measured copy bandwidth.

Each pipeline runs in its own process (`--worker-out`, internal) so one's device memory is gone
before the next loads, and so MAX's stock pipeline, which does not compile on Hopper (docs/GPU.md),
can fail or hang under a timeout: its row then says `max_stock_tok_s: null` and why. Results go
to `<out>/e2e_<gpu>_<yyyymmdd>.json`, rewritten after every pipeline so a run cut short keeps what
it measured; `--merge` folds earlier result files in (rows of the same model, batch and graph
capture are replaced by this run's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

from gptoss_max import affinity, memory, settings
from gptoss_max.config import ModelSpec
from gptoss_max.synthetic import SyntheticModel

ROW_FIELDS = (
    "model",
    "batch",
    "ours_tok_s",
    "max_stock_tok_s",
    "roofline_tok_s",
    "ttft_ms",
    "tpot_ms",
    "graph_capture",
)
STOCK_ENCODINGS = {"mxfp4": "float4_e2m1fnx2", "bf16": "bfloat16"}
# CUDA's free memory on an idle 80 GB H100 as MAX found it on 2026-11-21: MAX's planner saw
# 0.9 of it, 76.77 GB (maxapi.memory_manager_share; docs/GPU.md, "The KV plan at 0.9").
DEFAULT_GPU_FREE_GIB = 79.44


# ---------------------------------------------------------------------------------------------
# The device


def gpu_name() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"], capture_output=True, text=True
    )
    return out.stdout.strip() or None if out.returncode == 0 else None


def device_slug(name: str | None) -> str:
    """`NVIDIA H100 80GB HBM3` -> `h100`; no GPU -> `cpu`."""
    if not name:
        return "cpu"
    known = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name.replace("NVIDIA", ""))
    return (known.group(1) if known else re.sub(r"[^A-Za-z0-9]+", "-", name)).lower()


class PeakMemory:
    """Peak device memory in use while it runs: nvidia-smi every 0.2 s, else MAX's device stats.

    With `poll=False` it samples once on entry and once on exit instead: nvidia-smi calls during a
    timed decode were suspected of stalls that cost some runs up to 20 % (bench/NOTES.md, "The e2e
    noise"). Stalls of 10-16 ms steps were later seen without polling too ("Host stalls"): the
    rows' median TPOT and slow-step count tell them from slower kernels."""

    def __init__(self, gpu: bool, poll: bool = True):
        self.gpu = gpu
        self.poll = poll
        self.peak: int | None = None
        self.source: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _used(self) -> int | None:
        if shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
            )
            if out.returncode == 0 and out.stdout.strip():
                return int(float(out.stdout.strip()) * 2**20)
        from max.driver import Accelerator

        self.source = "max device stats"
        stats = Accelerator(0).stats
        return int(stats["total_memory"] - stats["free_memory"])

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(0.2)

    def _sample(self) -> None:
        used = self._used()
        if used is not None:
            self.peak = max(self.peak or 0, used)

    def __enter__(self) -> PeakMemory:
        if self.gpu:
            self.peak = None
            if not self.poll:
                self._sample()
                return self
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread:
            self._stop.set()
            self._thread.join()
            self._thread = None
        elif self.gpu:
            self._sample()


def plan_memory(args: argparse.Namespace, measured_free: int | None) -> int:
    """The memory the printed plan assumes: --gpu-memory-gib, else what the device reported,
    else an idle 80 GB H100's; on a CPU, the host's."""
    if not args.gpu:
        return _host_memory()
    if args.gpu_memory_gib:
        return int(args.gpu_memory_gib * 2**30)
    return measured_free or int(DEFAULT_GPU_FREE_GIB * 2**30)


def measure_bandwidth(gpu: bool, nbytes: int = 1 << 30, iters: int = 20) -> dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + written per second): torch if importable,
    else MAX buffers; on a CPU, a NumPy copy."""
    if not gpu:
        a = np.ones(nbytes // 4, dtype=np.uint8)
        b = np.empty_like(a)
        np.copyto(b, a)
        t0 = time.perf_counter()
        for _ in range(iters // 4):
            np.copyto(b, a)
        return {"bytes_per_s": 2 * a.nbytes * (iters // 4) / (time.perf_counter() - t0), "method": "numpy copy"}
    try:
        import torch

        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        return {"bytes_per_s": 2 * nbytes * iters / (start.elapsed_time(end) / 1e3), "method": "torch cuda copy_"}
    except ImportError:
        from max.driver import Accelerator, Buffer
        from max.dtype import DType

        dev = Accelerator(0)
        src, dst = Buffer(DType.uint8, [nbytes], device=dev), Buffer(DType.uint8, [nbytes], device=dev)
        dst.inplace_copy_from(src)
        dev.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.inplace_copy_from(src)
        dev.synchronize()
        return {"bytes_per_s": 2 * nbytes * iters / (time.perf_counter() - t0), "method": "max Buffer copy"}


# ---------------------------------------------------------------------------------------------
# One batch through a pipeline


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    """Random ordinary tokens (no Harmony specials, which start at 199998)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 199_990, size=length)] for _ in range(batch)]


def waves(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices grouped so each group's prompt tokens fit `budget` (one row at least)."""
    groups: list[list[int]] = [[]]
    total = 0
    for row, n in enumerate(lengths):
        if groups[-1] and total + n > budget:
            groups.append([])
            total = 0
        groups[-1].append(row)
        total += n
    return groups


def run_batch(
    engine: Any,
    batch_prompts: list[list[int]],
    output_len: int,
    budget: int,
    step_hook: Callable[[str, int], AbstractContextManager[Any]] | None = None,
) -> dict[str, Any]:
    """Prefill in waves, then decode every row together; times of each row's first and last token.

    Drives the pipeline one `execute` at a time as MAX's GenerateIterator.step does, which cannot
    split a batch's prefill. `step_hook(phase, index)`, if given, wraps each step (phase
    "prefill" for the waves, "decode" after; index counts within the phase): scripts/step_profile.py
    profiles chosen steps through it."""
    from gptoss_max import maxapi

    pipeline = engine.pipeline
    kv = pipeline.kv_manager
    params = maxapi.SamplingParams(top_k=1, max_new_tokens=output_len, ignore_eos=True, detokenize=False)
    contexts = []
    for p in batch_prompts:
        request = maxapi.TextGenerationRequest(
            request_id=maxapi.RequestID(), prompt=list(p), model_name="model", sampling_params=params
        )
        contexts.append(asyncio.run(engine.tokenizer.new_context(request)))
    index = {c.request_id: row for row, c in enumerate(contexts)}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    count = [0] * len(contexts)
    live: dict[int, Any] = {}

    def release(row: int) -> None:
        c = live.pop(row)
        if kv.contains(c):
            kv.release(c)
        pipeline.release(c.request_id)

    steps = {"prefill": 0, "decode": 0}
    decode_ends: list[float] = []  # when each decode step returned (its tokens on the host)
    decode_cpu: list[tuple[float, float]] = []  # the process's and this thread's CPU time then
    waits: list[float] = []  # every wait of the host for the GPU's outputs (overlap pipeline only)
    decode_waits: list[float] = []  # their sum in each decode step

    def step(rows: list[int], phase: str) -> None:
        k = steps[phase]
        steps[phase] += 1
        with step_hook(phase, k) if step_hook else contextlib.nullcontext():
            batch = []
            for row in rows:
                kv.alloc(live[row]).synchronize()
                batch.append(live[row])
            seen = len(waits)
            outputs = pipeline.execute(maxapi.TextGenerationInputs(batches=[batch]))
        now = time.perf_counter()
        if phase == "decode":
            decode_ends.append(now)
            decode_cpu.append((time.process_time(), time.thread_time()))
            decode_waits.append(sum(waits[seen:]))
        for rid, out in outputs.items():
            hit = index.get(rid)
            if hit is None or hit not in live:
                continue
            row = hit
            n = len(out.tokens)
            if n:
                first.setdefault(row, now)
                last[row] = now
                count[row] += n
            if out.is_done:
                release(row)

    collections = [0, 0, 0]  # Python's garbage collections by generation while the batch ran

    def count_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections[info["generation"]] += 1

    gc.callbacks.append(count_gc)
    try:
        for row, c in enumerate(contexts):
            kv.claim(c, replica_idx=0)
            live[row] = c
        with maxapi.overlap_sync_waits(waits):
            t0 = time.perf_counter()
            for group in waves([len(p) for p in batch_prompts], budget):
                step([r for r in group if r in live], "prefill")
            while live:
                step(list(live), "decode")
            t_end = time.perf_counter()
    finally:
        gc.callbacks.remove(count_gc)
        for row in list(live):
            release(row)
    rows = len(contexts)
    decode_start = max(first.values())  # every row has its first token: decode steps follow
    spread = step_spread(decode_start, decode_ends)
    waited = wait_spread([w for t, w in zip(decode_ends, decode_waits, strict=True) if t > decode_start], bool(waits))
    decode_s = t_end - decode_start
    return {
        "batch": rows,
        "tokens": sum(count),
        "tokens_per_row_min": min(count),
        "ttft_ms": 1e3 * float(np.mean([first[r] - t0 for r in range(rows)])),
        "ttft_ms_max": 1e3 * (decode_start - t0),
        "tpot_ms": 1e3 * decode_s / max(1, output_len - 1),
        "decode_tok_s": (sum(count) - rows) / decode_s if decode_s > 0 else None,
        "e2e_output_tok_s": sum(count) / (t_end - t0),
        "seconds": t_end - t0,
        **spread,
        **cpu_spread([c for t, c in zip(decode_ends, decode_cpu, strict=True) if t > decode_start]),
        **waited,
        **host_bound_spread(spread["step_ms"], waited["sync_wait_ms"]),
        "gc_collections": collections,
    }


def cpu_spread(cpu: list[tuple[float, float]]) -> dict[str, Any]:
    """CPU time per decode step (from (process_time, thread_time) at each step's return, the
    first step left out): the median of each quarter of the run, for the whole process and for
    the thread that runs the steps. Set beside `tpot_quarters_ms`: a slow quarter whose CPU time
    grew as much as its wall time points at the host; one whose CPU time did not, at waiting
    (the GPU, or a thread that sleeps)."""
    if len(cpu) < 2:
        return {"cpu_quarters_ms": [], "thread_cpu_quarters_ms": []}
    arr = 1e3 * np.diff(np.array(cpu), axis=0)
    return {"cpu_quarters_ms": quarter_medians(arr[:, 0]), "thread_cpu_quarters_ms": quarter_medians(arr[:, 1])}


def wait_spread(waits: list[float], overlapped: bool) -> dict[str, Any]:
    """How long each decode step's host waited for the GPU (s, from maxapi.overlap_sync_waits;
    the overlap pipeline only, so empty without device graphs): every step's wait in ms
    (`sync_wait_ms`, beside `step_ms`) and each quarter's median. A step's time less its wait is
    the host's own work: slow steps that waited as long as fast ones were the host's, slow steps
    that waited longer, the GPU's."""
    if not overlapped:
        return {"sync_wait_quarters_ms": [], "sync_wait_ms": []}
    arr = 1e3 * np.array(waits)
    return {"sync_wait_quarters_ms": quarter_medians(arr), "sync_wait_ms": [round(float(x), 4) for x in arr]}


# A decode step whose host waited less than this for the GPU did not wait at all: the sync's own
# cost is ~0.006 ms on the H200, and a GPU-bound 20b batch-1 step waits 0.08-0.4 ms there.
HOST_BOUND_WAIT_MS = 0.02


def host_bound_spread(step_ms: list[float], sync_wait_ms: list[float]) -> dict[str, Any]:
    """Who set the decode steps' time: the share of steps whose host never waited for the GPU
    (`host_bound_share`; such a step is the host's own work, MAX's overlap pipeline and ours) and
    the median of the other steps (`gpu_step_p50_ms`, the GPU's step, None with fewer than 8 of
    them). On the H200 the host's work per step grows ~1.5x in stretches of a few to over a
    thousand steps (bench/NOTES.md, "Fourteenth session"); a run that a stretch covers reads as
    slower code. Both None without waits (no device graphs)."""
    if not sync_wait_ms or len(sync_wait_ms) != len(step_ms):
        return {"host_bound_share": None, "gpu_step_p50_ms": None}
    waits = np.array(sync_wait_ms)
    gpu = np.array(step_ms)[waits >= HOST_BOUND_WAIT_MS]
    return {
        "host_bound_share": round(float((waits < HOST_BOUND_WAIT_MS).mean()), 4),
        "gpu_step_p50_ms": round(float(np.median(gpu)), 4) if len(gpu) >= 8 else None,
    }


def quarter_medians(values: np.ndarray) -> list[float]:
    """The median of each quarter of `values`, in order (fewer than four when they are fewer)."""
    return [round(float(np.median(q)), 4) for q in np.array_split(values, 4) if len(q)]


def host_state() -> dict[str, Any]:
    """The host now: its CPUs' clock (the min, mean and max `cpu MHz` of /proc/cpuinfo, where it
    exists), the load average, and the CPUs this process may run on."""
    state: dict[str, Any] = {"cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    with contextlib.suppress(OSError):
        state["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    with contextlib.suppress(OSError, ValueError):
        mhz = [
            float(ln.split(":")[1]) for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("cpu MHz")
        ]
        if mhz:
            state["cpu_mhz"] = {
                "min": round(min(mhz), 1),
                "mean": round(sum(mhz) / len(mhz), 1),
                "max": round(max(mhz), 1),
            }
    return state


def step_spread(decode_start: float, decode_ends: list[float]) -> dict[str, Any]:
    """The decode steps' own times (each from the previous step's return, the first from the
    last first token): median, 90th percentile and maximum in ms, and how many took more than
    twice the median. tpot_ms is their mean; a mean well above the median says a few slow steps
    (host stalls) moved it, not the kernels.

    Also every step's time (`step_ms`) and the median of each quarter of the run
    (`tpot_quarters_ms`): on the H200 a 20b batch-1 run's steps sat at ~1.66 ms or at ~2.14 ms,
    the same tree in either, and sometimes switched within one run (bench/NOTES.md, "Twelfth
    session"); these show which, and when."""
    ends = [t for t in decode_ends if t > decode_start]
    if not ends:
        return {
            "tpot_p50_ms": None,
            "tpot_p90_ms": None,
            "tpot_max_ms": None,
            "slow_steps": 0,
            "tpot_quarters_ms": [],
            "step_ms": [],
        }
    dt = 1e3 * np.diff(np.array([decode_start, *ends]))
    p50 = float(np.median(dt))
    return {
        "tpot_p50_ms": p50,
        "tpot_p90_ms": float(np.percentile(dt, 90)),
        "tpot_max_ms": float(dt.max()),
        "slow_steps": int((dt > 2 * p50).sum()),
        "tpot_quarters_ms": quarter_medians(dt),
        "step_ms": [round(float(x), 4) for x in dt],
    }


GPU_STATE_FIELDS = (
    "clocks.sm",
    "clocks.mem",
    "clocks_throttle_reasons.active",
    "temperature.gpu",
    "power.draw",
    "pstate",
)


def gpu_state() -> dict[str, str] | None:
    """The GPU's clocks, active throttle reasons, temperature, power and P-state now (nvidia-smi;
    None without it), recorded around each timed batch: a run in the slow mode above with the same
    clocks as one in the fast mode rules clocks out."""
    if not shutil.which("nvidia-smi"):
        return None
    # newer drivers call the throttle reasons "clock event reasons"; one name or the other
    for fields in (GPU_STATE_FIELDS, tuple(f.replace("throttle", "event") for f in GPU_STATE_FIELDS)):
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
        )
        values = [v.strip() for v in out.stdout.strip().split(",")]
        if out.returncode == 0 and len(values) == len(GPU_STATE_FIELDS):
            return dict(zip(GPU_STATE_FIELDS, values, strict=True))
    return None


GC_MODES = ("default", "collect", "freeze", "off")


@contextlib.contextmanager
def gc_mode(mode: str):
    """Python's garbage collector while a timed batch runs (`--gc`): `default` leaves it alone;
    `collect` collects first; `freeze` collects, then moves every object into the permanent
    generation (gc.freeze), undone after; `off` disables it, re-enabled after."""
    if mode not in GC_MODES:
        raise ValueError(f"gc mode must be one of {', '.join(GC_MODES)}, not {mode!r}")
    was_enabled = gc.isenabled()
    if mode in ("collect", "freeze"):
        gc.collect()
    if mode == "freeze":
        gc.freeze()
    if mode == "off":
        gc.disable()
    try:
        yield
    finally:
        if mode == "freeze":
            gc.unfreeze()
        if mode == "off" and was_enabled:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# A worker: one pipeline, every batch size


def worker(args: argparse.Namespace) -> int:
    from gptoss_max.engine import Engine, EngineOptions, uses_gpu

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("max.pipelines").setLevel(logging.INFO)  # compile times and the memory plan, in the log
    out = Path(args.worker_out)
    replay = args.replay_small_graphs if args.worker_graph_capture else "off"  # it wraps the graphs' pipeline
    result: dict[str, Any] = {
        "arch": args.arch,
        "encoding": args.encoding,
        "graph_capture": args.worker_graph_capture,
        "replay_small_graphs": replay,
        "isolate_main_thread": args.isolate_main_thread,
        # what each --worker-env name holds in this process (the parent set them)
        "worker_env": {name: os.environ.get(name) for name, _ in map(_env_pair, args.worker_env or [])},
        "batches": [],
    }

    def save() -> None:
        out.write_text(json.dumps(result, indent=2))

    gpu = uses_gpu(args.device)
    if args.arch == "bandwidth":
        if gpu:  # CUDA's free figure, as the plan takes it, before the copy's buffers
            from gptoss_max import maxapi

            result["device_free_bytes"] = int(maxapi.device_free_memory() / maxapi.memory_manager_share())
        result["bandwidth"] = measure_bandwidth(gpu)
        save()
        return 0
    opts = EngineOptions(
        model=args.model,
        device="gpu" if gpu else "cpu",
        max_length=args.max_length or args.prompt_len + args.output_len + 16,
        max_batch_size=max(args.batch),
        kv_memory_fraction=args.kv_memory_fraction,
        encoding=args.encoding,
        graph_capture=args.worker_graph_capture,
        replay_small_graphs=replay,
        max_batch_input_tokens=args.max_batch_input_tokens,
        arch_module="gptoss_max.stock" if args.arch == "stock" else "gptoss_max.arch",
    )
    monitor = PeakMemory(gpu)
    save()
    with monitor:
        engine = Engine(opts)
    plan = engine.memory_plan
    result.update(
        load_seconds=round(engine.load_seconds, 1),
        capture_seconds=round(engine.capture_seconds, 1),
        peak_memory_load_bytes=monitor.peak,
        memory_source=monitor.source,
        memory_plan={
            "kv_cache_bytes": getattr(plan, "available_cache_memory", None),
            "footprint_bytes": getattr(plan, "footprint", None),
            "max_batch_size": getattr(plan, "planned_max_batch_size", None),
            "max_length": getattr(plan, "planned_max_length", None),
        },
        kv_bytes_per_token=_kv_bytes_per_token(engine),
    )
    save()
    budget = args.max_batch_input_tokens or 8192
    result["memory_poll"] = args.memory_poll
    result["gc"] = args.gc
    for b in args.batch:
        warm_peak = None
        if args.warmup_tokens:  # first-use costs; a full-length prompt only where TTFT is the figure (batch 1)
            warm_len = args.prompt_len if b == 1 else min(args.prompt_len, 64)
            with monitor:
                run_batch(engine, prompts(b, warm_len, 1000 + b), args.warmup_tokens, budget)
            warm_peak = monitor.peak
        # "outside": the timed run is only sampled before and after (MAX plans its memory up front,
        # and the warm-up above, polled, runs the same shapes); "during": polled as it runs.
        timed = PeakMemory(gpu, poll=args.memory_poll == "during")
        isolation = affinity.isolate_main_thread() if args.isolate_main_thread else None
        before, host_before = gpu_state() if gpu else None, host_state()
        threads_before = affinity.thread_cpu_seconds()
        with timed, gc_mode(args.gc):
            row = run_batch(engine, prompts(b, args.prompt_len, b), args.output_len, budget)
        row["busiest_threads"] = affinity.busiest_threads(threads_before, affinity.thread_cpu_seconds())
        row["isolated_main_thread"] = isolation
        row["gpu_state"] = {"before": before, "after": gpu_state() if gpu else None}
        row["host_state"] = {"before": host_before, "after": host_state()}
        row["replayed"] = {m.name: dict(m.counts) for m in engine.replayed}  # cumulative, warm-up included
        row["peak_memory_bytes"] = max((p for p in (warm_peak, timed.peak) if p is not None), default=None)
        result["batches"].append(row)
        if row["replayed"]:
            print(f"replayed small graphs: {row['replayed']}", flush=True)
        print(
            f"[{args.arch}{' graph-capture' if args.worker_graph_capture else ''}] batch {b}: "
            f"{row['decode_tok_s'] or 0:.1f} tok/s decode, TTFT {row['ttft_ms']:.1f} ms, TPOT {row['tpot_ms']:.2f} ms"
            f" (median {row['tpot_p50_ms'] or 0:.2f}, max {row['tpot_max_ms'] or 0:.2f}, {row['slow_steps']} steps"
            f" over twice the median, garbage collections {row['gc_collections']}; quarters' median step"
            f" {row['tpot_quarters_ms']} ms, CPU {row['cpu_quarters_ms']} ms, waiting for the GPU"
            f" {row['sync_wait_quarters_ms'] or '-'} ms)",
            flush=True,
        )
        save()
    return 0


def _env_pair(text: str) -> tuple[str, str]:
    name, _, value = text.partition("=")
    return name, value


def _env_arg(text: str) -> str:
    """`--worker-env`'s NAME=VALUE, checked."""
    name, eq, _ = text.partition("=")
    if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return text


def _kv_bytes_per_token(engine: Any) -> float | None:
    try:
        params = engine.pipeline.kv_manager.params
        return params.bytes_per_block / params.page_size
    except AttributeError:
        return None


# ---------------------------------------------------------------------------------------------
# The run: workers under timeouts, rows, file, table


def _spec_of(model: str) -> tuple[ModelSpec, bool, SyntheticModel | None]:
    if SyntheticModel.is_spec(model):
        s = SyntheticModel.parse(model)
        return s.spec, s.mxfp4_experts, s
    path = Path(model)
    if not (path / "config.json").exists():
        raise SystemExit(f"bench needs a synthetic:<preset> model or a local checkpoint dir, not {model!r}")
    cfg = json.loads((path / "config.json").read_text())
    mxfp4 = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    return ModelSpec.from_hf(cfg), mxfp4, SyntheticModel.from_hf_config(cfg)


def _tail_reason(text: str) -> str:
    """The most telling lines of a failed worker's output (a compiler's failed constraint and its
    final error, or the exception), at most 400 characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    picked: list[str] = []
    for pattern in (r"constraint failed", r"^error:", r"\w+(Error|Exception)\b:", r"[Ee]rror"):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits and hits[-1] not in picked:
            picked.append(hits[-1])
        if len(picked) == 2:
            break
    return " | ".join(picked or lines[-1:] or ["no output"])[:400]


@contextlib.contextmanager
def _worker_dies_with_us(proc: subprocess.Popen):
    """While waiting for a worker (its own session): whatever ends the wait early (its timeout, or
    this process told to stop by SIGTERM, SIGHUP or Ctrl-C) kills the worker's whole group first.
    Without the signals, `timeout 300 bench/e2e.py ...` left the worker running and holding the
    GPU's memory, and the next run failed with MAX's "Model size exceeds available memory"."""

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, stop)
    try:
        yield
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run_worker(
    args: argparse.Namespace,
    arch: str,
    model: str,
    encoding: str | None,
    graph_capture: bool,
    timeout: float | None,
    log_dir: Path,
) -> dict[str, Any]:
    """One worker process; its result, or `{"error": ...}` (also a partial result when it died)."""
    tag = f"{arch}{'-' + encoding if encoding else ''}{'-graphs' if graph_capture else ''}"
    out = log_dir / f"worker_{tag}.json"
    log = log_dir / f"worker_{tag}.log"
    cmd = [
        sys.executable,
        "-m",
        "gptoss_max.e2e",
        "--worker-out",
        str(out),
        "--arch",
        arch,
        "--model",
        model,
        "--device",
        args.device,
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--warmup-tokens",
        str(args.warmup_tokens),
        "--memory-poll",
        args.memory_poll,
        "--gc",
        args.gc,
        "--batch",
        *map(str, args.batch),
    ]
    for flag, value in [
        ("--encoding", encoding),
        ("--max-length", args.max_length),
        ("--max-batch-input-tokens", args.max_batch_input_tokens),
        ("--kv-memory-fraction", args.kv_memory_fraction),
    ]:
        if value:
            cmd += [flag, str(value)]
    if graph_capture:
        cmd.append("--worker-graph-capture")
    if getattr(args, "isolate_main_thread", False):
        cmd.append("--isolate-main-thread")
    worker_env = getattr(args, "worker_env", None) or []
    for pair in worker_env:
        cmd += ["--worker-env", pair]
    if getattr(args, "replay_small_graphs", "off") != "off":  # (callers that build their own Namespace)
        cmd += ["--replay-small-graphs", args.replay_small_graphs]
    print(f"--> {tag}: {shlex.join(cmd[1:])}  (log: {log})", flush=True)
    t0 = time.perf_counter()
    error = None
    with open(log, "w") as fh:
        env = dict(os.environ)  # the package as this process found it (bench/e2e.py runs uninstalled)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
        env.update(map(_env_pair, worker_env))
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            with _worker_dies_with_us(proc):
                rc = proc.wait(timeout=timeout)
            if rc != 0:
                error = f"exit {rc}: {_tail_reason(log.read_text(errors='replace'))}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s; last output: {_tail_reason(log.read_text(errors='replace'))}"
    result = json.loads(out.read_text()) if out.exists() and out.stat().st_size else {}
    result["wall_seconds"] = round(time.perf_counter() - t0, 1)
    result["log"] = log.name
    if error:
        result["error"] = error
        tail = log.read_text(errors="replace").splitlines()[-25:]
        print(f"<-- {tag} failed: {error}\n    " + "\n    ".join(tail), flush=True)
    return result


def _rows(
    model: str,
    spec: ModelSpec,
    mxfp4: bool,
    args: argparse.Namespace,
    bandwidth: float | None,
    ours: dict[bool, dict[str, Any]],
    stock: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    def by_batch(res: dict[str, Any]) -> dict[int, dict[str, Any]]:
        return {r["batch"]: r for r in res.get("batches", [])}

    stock_rows = {enc: by_batch(res) for enc, res in stock.items()}
    stock_errors = {enc: res["error"] for enc, res in stock.items() if res.get("error")}
    rows = []
    dense = memory.dtype_bytes(args.encoding or ("bfloat16" if args.gpu else "float32"))
    for capture, res in ours.items():
        measured = by_batch(res)
        for b in args.batch:
            r = measured.get(b, {})
            step = memory.decode_step_bytes(spec, mxfp4, b, args.prompt_len + args.output_len / 2, dense, dense)
            st = {enc: rows_.get(b, {}).get("decode_tok_s") for enc, rows_ in stock_rows.items()}
            best = st.get("float4_e2m1fnx2") or st.get("bfloat16") or st.get("float32")
            row = {
                "model": model,
                "batch": b,
                "ours_tok_s": _round(r.get("decode_tok_s")),
                "max_stock_tok_s": _round(best),
                "roofline_tok_s": _round(b * bandwidth / step["total"]) if bandwidth else None,
                "ttft_ms": _round(r.get("ttft_ms")),
                "tpot_ms": _round(r.get("tpot_ms"), 3),
                "graph_capture": capture,
                "tpot_p50_ms": _round(r.get("tpot_p50_ms"), 3),
                "tpot_p90_ms": _round(r.get("tpot_p90_ms"), 3),
                "tpot_quarters_ms": [_round(q, 3) for q in r.get("tpot_quarters_ms", [])],
                "cpu_quarters_ms": [_round(q, 3) for q in r.get("cpu_quarters_ms", [])],
                "sync_wait_quarters_ms": [_round(q, 3) for q in r.get("sync_wait_quarters_ms", [])],
                "tpot_max_ms": _round(r.get("tpot_max_ms"), 3),
                "slow_steps": r.get("slow_steps"),
                "host_bound_share": r.get("host_bound_share"),
                "gpu_step_p50_ms": _round(r.get("gpu_step_p50_ms"), 3),
                "peak_gpu_memory_bytes": r.get("peak_memory_bytes"),
                "e2e_output_tok_s": _round(r.get("e2e_output_tok_s")),
                "ttft_ms_last_row": _round(r.get("ttft_ms_max")),
                "bytes_per_decode_step": int(step["total"]),
                "experts_touched_per_layer": round(step["experts_touched_per_layer"], 2),
            }
            for enc, v in st.items():
                row[f"max_stock_{enc}_tok_s"] = _round(v)
            if best is None and stock_errors:
                row["max_stock_error"] = "; ".join(f"{enc}: {e}" for enc, e in stock_errors.items())
            elif best is None:
                row["max_stock_error"] = "not run" if not stock else "no measurement for this batch"
            if res.get("error") and not r:
                row["ours_error"] = res["error"]
            rows.append(row)
    return rows


def _round(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    key = lambda r: (r["model"], r["batch"], r["graph_capture"])  # noqa: E731
    merged = {key(r): r for r in old}
    merged.update({key(r): r for r in new})
    return sorted(merged.values(), key=lambda r: (r["model"], r["graph_capture"], r["batch"]))


def markdown_table(result: dict[str, Any]) -> str:
    head = (
        f"{result.get('device', '?')}, {result.get('date', '?')} (prompt {result.get('prompt_len')}, "
        f"output {result.get('output_len')} tokens, EOS ignored; tok/s = decode output tokens/s; TPOT = mean "
        "decode step, its median beside it; slow steps: over twice the median, host stalls when the two differ; "
        "host-bound: the share of decode steps whose host never waited for the GPU, where the host's own work "
        "set the step, and GPU step: the median of the others)\n\n"
    )
    cols = [
        "model",
        "batch",
        "graph capture",
        "ours tok/s",
        "MAX stock tok/s",
        "roofline tok/s",
        "TTFT ms",
        "TPOT ms",
        "TPOT median ms",
        "slow steps",
        "host-bound",
        "GPU step ms",
        "peak GPU GB",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in result.get("rows", []):
        peak = r.get("peak_gpu_memory_bytes")
        stock = r.get("max_stock_tok_s")
        cells = [
            r["model"],
            r["batch"],
            "yes" if r["graph_capture"] else "no",
            r.get("ours_tok_s"),
            stock if stock is not None else "n/a",
            r.get("roofline_tok_s"),
            r.get("ttft_ms"),
            r.get("tpot_ms"),
            r.get("tpot_p50_ms"),
            r.get("slow_steps"),
            None if r.get("host_bound_share") is None else f"{100 * r['host_bound_share']:.0f} %",
            r.get("gpu_step_p50_ms"),
            f"{peak / 1e9:.1f}" if peak else "—",
        ]
        lines.append("| " + " | ".join("—" if c is None else str(c) for c in cells) + " |")
    return head + "\n".join(lines)


def print_plans(spec: ModelSpec, mxfp4: bool, args: argparse.Namespace, device_free: int) -> dict[str, Any]:
    plans = {}
    encoding = args.encoding or ("bfloat16" if args.gpu else "float32")
    for b in args.batch:
        p = memory.plan(
            spec,
            mxfp4,
            device_free=device_free,
            encoding=encoding,
            utilization=args.kv_memory_fraction or (0.9 if args.gpu else 0.05),
            batch=b,
            max_length=args.max_length or args.prompt_len + args.output_len + 16,
            gpu=args.gpu,
        )
        plans[b] = p.as_dict()
        if b == args.batch[0]:
            print(f"memory plan for {args.model} ({encoding}, {'MXFP4' if mxfp4 else 'bf16'} experts):")
            print("\n".join("  " + ln for ln in p.lines()[:-1]))
        print("  " + p.lines()[-1])
    step1 = memory.decode_step_bytes(spec, mxfp4, 1, args.prompt_len + args.output_len / 2)
    print(
        f"  bytes per decoded token at batch 1: {step1['total'] / 1e9:.2f} GB "
        f"(dense {step1['dense'] / 1e9:.2f}, experts {step1['experts'] / 1e9:.2f}, KV {step1['kv_read'] / 1e9:.3f})"
    )
    return {"per_batch": plans, "batch1_decode_step_bytes": step1}


def merge_only(args: argparse.Namespace) -> int:
    """Several runs' files (e.g. one device call each) -> one e2e_<gpu>_<date>.json and its table."""
    files = [json.loads(Path(f).read_text()) for f in args.merge]
    result = {k: files[0].get(k) for k in ("device", "date", "prompt_len", "output_len")}
    # a merged file lists its runs' commands under "commands": keep them, not a None
    commands = [c for f in files for c in (f.get("commands") or [f.get("command")]) if c]
    result.update(commands=list(dict.fromkeys(commands)), rows=[], runs={})
    for f in files:
        result["rows"] = merge_rows(result["rows"], f.get("rows", []))
        result["runs"].update(f.get("runs", {}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = str(result["date"]).replace("-", "")
    path = out / f"e2e_{device_slug(None if result['device'] == 'cpu' else result['device'])}_{date}.json"
    path.write_text(json.dumps(result, indent=2))
    print(markdown_table(result))
    print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    from gptoss_max.engine import uses_gpu

    if args.merge_only:
        return merge_only(args)

    spec, mxfp4, synthetic = _spec_of(args.model)
    if args.plan:  # a GPU's plan unless --device cpu; no device is touched
        args.gpu = args.device != "cpu"
        print_plans(spec, mxfp4, args, plan_memory(args, None))
        return 0
    args.gpu = uses_gpu(args.device)
    name = gpu_name() if args.gpu else None
    date = datetime.date.today()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"e2e_{device_slug(name)}_{date:%Y%m%d}.json"
    log_dir = Path(tempfile.mkdtemp(prefix="e2e_"))
    t_start = time.perf_counter()

    def budget(timeout: float | None) -> float | None:
        """A worker's timeout: its own, cut to what --deadline leaves (minus time to write up)."""
        if args.deadline is None:
            return timeout
        left = max(1.0, args.deadline - (time.perf_counter() - t_start) - 15)
        return left if timeout is None else min(timeout, left)

    argv = ["gptoss-max", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else sys.argv
    result: dict[str, Any] = {
        "device": name or "cpu",
        "date": date.isoformat(),
        "command": shlex.join([*settings.run_setting_env(), *argv]),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rows": [],
        "runs": {},
    }
    for old in args.merge or []:
        prev = json.loads(Path(old).read_text())
        result["rows"] = merge_rows(result["rows"], prev.get("rows", []))
        result["runs"].update(prev.get("runs", {}))
    bw = run_worker(args, "bandwidth", args.model, None, False, budget(300), log_dir)
    bandwidth = (bw.get("bandwidth") or {}).get("bytes_per_s")
    run_key = f"{args.model} {args.encoding or 'default'}"
    run_info: dict[str, Any] = {"bandwidth": bw.get("bandwidth"), "workers": {}}
    run_info["memory_plan"] = print_plans(spec, mxfp4, args, plan_memory(args, bw.get("device_free_bytes")))

    def save(ours: dict[bool, dict[str, Any]], stock: dict[str, dict[str, Any]]) -> None:
        rows = _rows(args.model, spec, mxfp4, args, bandwidth, ours, stock)
        result["rows"] = merge_rows(result["rows"], rows)
        result["runs"][run_key] = run_info
        path.write_text(json.dumps(result, indent=2))

    ours: dict[bool, dict[str, Any]] = {}
    stock: dict[str, dict[str, Any]] = {}
    for capture in {"off": [False], "on": [True], "both": [False, True]}[args.graph_capture]:
        res = run_worker(args, "ours", args.model, args.encoding, capture, budget(args.timeout), log_dir)
        ours[capture] = res
        run_info["workers"][f"ours{'-graphs' if capture else ''}"] = res
        save(ours, stock)
    if args.stock == "on" or (args.stock == "auto" and args.gpu):
        for enc, model in _stock_variants(args, synthetic, mxfp4):
            res = run_worker(args, "stock", model, enc, False, budget(args.stock_timeout), log_dir)
            stock[enc] = res
            run_info["workers"][f"stock-{enc}"] = res
            save(ours, stock)
    save(ours, stock)
    print(markdown_table(result))
    print(f"wrote {path}")
    if args.keep_logs:  # one file: a device machine may return only a few
        logs = out_dir / f"e2e_logs_{device_slug(name)}_{date:%Y%m%d}_{int(time.time())}.tar.gz"
        with tarfile.open(logs, "w:gz") as tar:
            tar.add(log_dir, arcname=logs.name.removesuffix(".tar.gz"))
        print(f"wrote {logs}")
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _host_memory() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _stock_variants(args: argparse.Namespace, synthetic: SyntheticModel | None, mxfp4: bool) -> list[tuple[str, str]]:
    """MAX's stock pipeline: its MXFP4 encoding on the same checkpoint; for a 20b (or any model
    with bf16 experts) its BF16 encoding on the bf16-experts twin; float32 on a CPU."""
    if not args.gpu:
        return [("float32", args.model)]
    variants = []
    if mxfp4:
        variants.append(("float4_e2m1fnx2", args.model))
    if synthetic and (synthetic.preset in ("20b", "tiny") or not mxfp4):
        twin = SyntheticModel(synthetic.preset, synthetic.seed, "bf16", synthetic.layers)
        variants.append(("bfloat16", twin.name))
    elif not mxfp4:
        variants.append(("bfloat16", args.model))
    return variants


# ---------------------------------------------------------------------------------------------
# Command line


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--model",
        default="synthetic:20b",
        help="synthetic:<tiny|20b|120b>[,seed=N][,experts=mxfp4|bf16][,layers=N] or a local checkpoint dir",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="batch sizes (default: 1 8 64)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256, help="tokens generated per row, EOS ignored")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument(
        "--encoding", default=None, help="our pipeline's MAX encoding (default: bfloat16 on GPU, float32 on CPU)"
    )
    p.add_argument(
        "--graph-capture",
        choices=["off", "on", "both"],
        default="off",
        help="our decode steps replay captured device graphs (MAX's overlap pipeline); both = two runs",
    )
    p.add_argument(
        "--replay-small-graphs",
        choices=settings.REPLAY_MODES,
        default="off",
        help="with graphs: the overlap pipeline's per-step samplers (GPTOSS_MAX_REPLAY_GRAPHS: and token scatter) "
        "replay device graphs too, "
        "instead of running eagerly each step (maxapi.ReplayedModel); check: and each replay's outputs are "
        "compared with an eager call's (slow; the counts go into the result)",
    )
    p.add_argument(
        "--isolate-main-thread",
        action="store_true",
        help="before each timed batch, pin the worker's main thread to a CPU of its own (its other threads "
        "moved off that CPU and its hyperthread siblings; gptoss_max.affinity)",
    )
    p.add_argument(
        "--worker-env",
        action="append",
        type=_env_arg,
        metavar="NAME=VALUE",
        help="set in the workers' environment (repeatable), e.g. MODULAR_USE_LEGACY_KV_CACHE=1; each worker "
        "records what it found (`worker_env`)",
    )
    p.add_argument(
        "--stock",
        choices=["auto", "on", "off"],
        default="auto",
        help="also run MAX's stock gpt_oss pipeline (auto: on a GPU)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds for our pipeline's worker (default: none)")
    p.add_argument("--stock-timeout", type=float, default=600, help="seconds for each stock pipeline worker")
    p.add_argument("--warmup-tokens", type=int, default=4, help="an untimed batch of this many tokens first (0: none)")
    p.add_argument(
        "--memory-poll",
        choices=["outside", "during"],
        default="outside",
        help="peak GPU memory: polled during the warm-up batch and sampled around the timed one (default), "
        "or polled during the timed batch too (once suspected of stalling its decode)",
    )
    p.add_argument(
        "--gc",
        choices=GC_MODES,
        default="default",
        help="Python's garbage collector around each timed batch: as is (default); `collect` first; `freeze`: "
        "collect, then gc.freeze() (what vLLM and SGLang do after start-up); `off` while it runs. On the H200 "
        "every slow-mode run so far had a generation-1 collection in its timed batch (bench/NOTES.md)",
    )
    p.add_argument(
        "--max-length", type=int, default=None, help="context the pipeline plans for (default: prompt + output + 16)"
    )
    p.add_argument(
        "--max-batch-input-tokens", type=int, default=None, help="prompt tokens per prefill step (MAX default 8192)"
    )
    p.add_argument(
        "--kv-memory-fraction", type=float, default=None, help="MAX's device_memory_utilization (default 0.9 on GPU)"
    )
    p.add_argument("--out", default="bench/results", help="directory for e2e_<gpu>_<yyyymmdd>.json")
    p.add_argument("--merge", nargs="*", default=None, help="earlier e2e JSON files whose rows this run's file keeps")
    p.add_argument("--merge-only", action="store_true", help="only merge the --merge files into --out (no run)")
    p.add_argument("--keep-logs", action="store_true", help="also write the workers' logs as one .tar.gz under --out")
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the whole run: workers are cut (keeping what they measured) to end in time",
    )
    p.add_argument(
        "--plan", action="store_true", help="print the memory plan and roofline bytes only (no device needed)"
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="free device memory (CUDA's figure) the plan assumes (default: what the device reports in a run; "
        f"{DEFAULT_GPU_FREE_GIB}, an idle 80 GB H100, with --plan); MAX's planner sees 0.9 of it (its memory "
        "manager's pool), then applies --kv-memory-fraction",
    )
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--arch", choices=["ours", "stock", "bandwidth"], default="ours", help=argparse.SUPPRESS)
    p.add_argument("--worker-graph-capture", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="gptoss-max bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
    )
    args = parser.parse_args(argv)
    return worker(args) if args.worker_out else run(args)


if __name__ == "__main__":
    sys.exit(main())
