"""scripts/step_profile.py without a GPU: kernel names to categories, the Chrome trace torch's
profiler exports to kernel events and step windows, events to steps, and the per-step sums."""

from __future__ import annotations

import os

import pytest

from script_loader import load_script

sp = load_script("scripts/step_profile.py", "step_profile")

# Names as the GPU shows them: our Mojo kernels are cut to 30 characters, then a parameter code
# and a hash (bench/results/moe_decode_ncu_h100_20261121_v5.txt); the others are plausible.
GATE_UP = "gptoss_kernels_moe_gpu_gate_up6A6A6A6A_759b8e13d786772a"
DOWN = "gptoss_kernels_moe_gpu_down_ke6A6A6A6A_ba6c3d3022833976"
PREFILL = "gptoss_kernels_moe_prefill_gpu6A6A_0011aa"
ATTN = "gptoss_kernels_attention_gpu_a6A6A_12ab"
MERGE = "gptoss_kernels_attention_gpu_a6A6A_34cd"


@pytest.mark.parametrize(
    ("name", "kind", "block", "category"),
    [
        (GATE_UP, "kernel", (64, 1, 1), "moe_decode_gate_up"),
        (DOWN, "kernel", (32, 1, 1), "moe_decode_down"),
        (PREFILL, "kernel", (256, 1, 1), "moe_prefill"),
        (ATTN, "kernel", (256, 1, 1), "attention_ours"),
        (MERGE, "kernel", (32, 1, 1), "attention_merge"),
        ("gptoss_kernels_router_topk_rou6A6A_56ef", "kernel", (128, 1, 1), "router_topk"),
        ("gptoss_kernels_router_decode_6A6A_12ab", "kernel", (128, 1, 1), "router_fused"),
        ("gptoss_kernels_mxfp4_whatever", "kernel", None, "ours_other"),
        ("nn_mha_mha_sm90_flash_attention_ragged", "kernel", None, "attention_max"),
        ("kv_cache_store_ragged_kernel", "kernel", None, "kv_cache"),
        ("linalg_matmul_gpu_sm90_matmul_kernels_hopper", "kernel", None, "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", None, "matmul"),
        ("nn_normalization_rms_norm_gpu_block", "kernel", None, "norm"),
        ("nn_rope_fused_qk_rope_ragged", "kernel", None, "rope"),
        ("nn_topk_topk_gpu_stage1", "kernel", None, "router_topk"),
        ("nn_sampling_apply_penalties", "kernel", None, "sampling"),
        ("std_algorithm_functional_elementwise", "kernel", None, "elementwise"),
        ("Memcpy DtoH (Device -> Pinned)", "memcpy", None, "memcpy"),
        ("Memset (Device)", "memset", None, "memcpy"),
        ("something_unheard_of", "kernel", None, "other"),
    ],
)
def test_categories(name, kind, block, category):
    assert sp.categorize(name, kind, block) == category
    assert category in dict(sp.CATEGORIES)


def _kernel(name, ts, dur, block=None, cat="kernel", graph=None):
    args = {"device": 0, "stream": 7}
    if block is not None:
        args["block"] = list(block)
    if graph is not None:
        args["graph id"] = graph
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": "stream 7", "ts": ts, "dur": dur, "args": args}


def _step(phase, index, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"gptoss_step:{phase}:{index}", "ts": ts, "dur": dur}


def _decode_layer(t0):
    """One fake decode layer's kernels from t0 (µs): 10 + 5 + 3 + 1 + 1 + 4 = 24 µs busy."""
    return [
        _kernel("nn_normalization_rms_norm_gpu", t0, 1.0),
        _kernel("linalg_matmul_gpu_qkv", t0 + 1, 4.0),
        _kernel(ATTN, t0 + 5, 3.0, block=(256, 1, 1)),
        _kernel(MERGE, t0 + 8, 1.0, block=(32, 1, 1)),
        _kernel(GATE_UP, t0 + 9, 10.0, block=(64, 1, 1)),
        _kernel(DOWN, t0 + 19, 5.0, block=(32, 1, 1)),
    ]


def _trace(shift=0.0):
    """Two layers per step; decode steps 8 and 9 (profiled) and one prefill step; events outside
    every window (an unprofiled step) and host-side noise. `shift` moves the GPU clock."""
    ev = [_step("prefill", 0, 0, 5000), _step("decode", 8, 10_000, 1000), _step("decode", 9, 12_000, 1000)]
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 1, "dur": 1})
    ev.append({"ph": "i", "cat": "kernel", "name": GATE_UP, "ts": 2})  # not a complete event
    gpu = [_kernel(PREFILL, 100, 400.0), _kernel("linalg_matmul_gpu_lm_head", 600, 50.0)]
    for start in (10_100, 12_100):
        gpu += _decode_layer(start) + _decode_layer(start + 30)
        gpu.append(_kernel("nn_sampling_fused_token_sampling", start + 60, 2.0))
        gpu.append(_kernel("Memcpy DtoH (Device -> Pinned)", start + 70, 3.0, cat="gpu_memcpy"))
    gpu.append(_kernel(GATE_UP, 11_500, 10.0))  # between the windows: an unprofiled step
    for g in gpu:
        g["ts"] += shift
    return {"traceEvents": ev + gpu}


def test_trace_to_events_and_windows():
    trace = _trace()
    events = sp.kernel_events(trace)
    assert len(events) == 2 + 2 * 14 + 1
    assert [e.start_us for e in events] == sorted(e.start_us for e in events)
    assert sum(e.kind == "memcpy" for e in events) == 2
    merge = next(e for e in events if e.name == MERGE)
    assert merge.block == (32, 1, 1) and not merge.graph
    assert sp.kernel_events({"traceEvents": [_kernel(GATE_UP, 0, 1.0, graph=3)]})[0].graph
    windows = sp.step_windows(trace)
    assert [(w.phase, w.index) for w in windows] == [("prefill", 0), ("decode", 8), ("decode", 9)]
    assert windows[1].start_us == 10_000 and windows[1].end_us == 11_000


def _check_summary(phases):
    dec = phases["decode"]
    assert list(phases) == ["decode", "prefill"]
    assert dec["steps"] == 2 and dec["layers"] == 2
    cats = {r["category"]: r for r in dec["categories"]}
    # per step: 2 layers x (gate_up 10, down 5, attention 3, merge 1, norm 1, matmul 4) + sampling 2 + memcpy 3
    expect = {"moe_decode_gate_up": 20, "moe_decode_down": 10, "attention_ours": 6, "attention_merge": 2,
              "norm": 2, "matmul": 8, "sampling": 2, "memcpy": 3}  # fmt: skip
    assert {c: r["us_per_step"] for c, r in cats.items()} == expect
    assert cats["moe_decode_gate_up"]["us_per_layer"] == 10 and cats["matmul"]["us_per_layer"] is None
    assert cats["moe_decode_gate_up"]["launches_per_step"] == 2 and cats["memcpy"]["launches_per_step"] == 1
    assert sum(r["share"] for r in dec["categories"]) == pytest.approx(1.0, abs=1e-3)
    assert [r["category"] for r in dec["categories"]] == [c for c, _ in sp.CATEGORIES if c in expect]
    assert dec["gpu_busy_us_per_step"] == 53.0 and dec["kernels_per_step"] == 13
    assert [s["index"] for s in dec["per_step"]] == [8, 9]
    assert all(s["gpu_busy_us"] == 53.0 and s["gpu_span_us"] == 73.0 for s in dec["per_step"])
    top = dec["kernels"][0]
    assert (top["name"], top["category"], top["us_per_step"]) == (GATE_UP, "moe_decode_gate_up", 20)
    assert top["calls_per_step"] == 2 and top["mean_us"] == 10
    assert top["by_call_us"] == [10, 10]  # layer 0's call, then layer 1's, averaged over the steps
    pre = phases["prefill"]
    assert {r["category"]: r["us_per_step"] for r in pre["categories"]} == {"moe_prefill": 400, "matmul": 50}
    assert pre["gpu_span_us_per_step"] == 550 and pre["wall_us_per_step"] == 5000


def test_steps_by_host_windows():
    trace = _trace()
    by_window, method = sp.assign_steps(sp.kernel_events(trace), sp.step_windows(trace))
    assert method == "windows"
    assert sum(len(v) for v in by_window.values()) == 2 + 2 * 14  # the unprofiled step's kernel is left out
    phases = sp.summarize(by_window, n_layers=2)
    _check_summary(phases)
    table = sp.format_table(phases, top=3)
    assert "| moe_decode_gate_up | 20.0 | 10.00 | 2.0 | 37.7 % |" in table and GATE_UP in table


def test_steps_by_gaps_when_clocks_disagree():
    """GPU timestamps an hour off the host's: nothing falls in a window, so the kernels are cut at
    the largest idle gaps, in window order (the unprofiled step's kernel is part of the shift too,
    so leave it out here)."""
    trace = _trace(shift=3.6e9)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not (e["name"] == GATE_UP and e["ts"] == 11_500 + 3.6e9)]
    by_window, method = sp.assign_steps(sp.kernel_events(trace), sp.step_windows(trace))
    assert method == "gaps"
    phases = sp.summarize(by_window, n_layers=2)
    dec = phases["decode"]
    assert [s["gpu_busy_us"] for s in dec["per_step"]] == [53.0, 53.0]
    prefill = {r["category"]: r["us_per_step"] for r in phases["prefill"]["categories"]}
    assert prefill == {"moe_prefill": 400, "matmul": 50}


def _with_launches(trace, gpu_shift):
    """Give every GPU activity a correlation id and a host-side launch call 1 µs before its GPU
    start (in the host's clock), then move the GPU clock by `gpu_shift`."""
    extra = []
    for i, ev in enumerate(e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy")):
        if ev.get("ph") != "X":
            continue
        ev["args"]["correlation"] = 1000 + i
        cat = "cuda_driver" if i % 2 else "cuda_runtime"  # MAX launches through the driver API
        extra.append({"ph": "X", "cat": cat, "name": "cuLaunchKernelEx", "ts": ev["ts"] - 1, "dur": 0.5,
                      "args": {"correlation": 1000 + i}})  # fmt: skip
        ev["ts"] += gpu_shift
    trace["traceEvents"] += extra
    return trace


def test_steps_by_launch_calls_whatever_the_gpu_clock():
    """Launch records place each kernel in the step that launched it, even with the GPU clock an
    hour off (where start times place nothing and the gaps would have to be guessed)."""
    trace = _with_launches(_trace(), gpu_shift=3.6e9)
    assert len(sp.launch_times(trace)) == 2 + 2 * 14 + 1
    events = sp.kernel_events(trace)
    assert all(e.correlation is not None for e in events)
    by_window, method = sp.assign_steps(events, sp.step_windows(trace), sp.launch_times(trace))
    assert method == "launch"
    assert sum(len(v) for v in by_window.values()) == 2 + 2 * 14  # the unprofiled step's launch is outside
    _check_summary(sp.summarize(by_window, n_layers=2))


def test_gaps_cut_between_every_step_that_ran():
    """Without launch records or aligned clocks, the cuts fall between all the steps the profiler
    saw: the unprofiled step between the two decode steps has its own window, so its kernel is
    not mixed into a reported step."""
    trace = _trace(shift=3.6e9)
    trace["traceEvents"].append(_step("decode", 7, 11_400, 200))  # the unprofiled step, marked too
    by_window, method = sp.assign_steps(sp.kernel_events(trace), sp.step_windows(trace), sp.launch_times(trace))
    assert method == "gaps"
    counts = {(w.phase, w.index): len(v) for w, v in by_window.items()}
    assert counts == {("prefill", 0): 2, ("decode", 8): 14, ("decode", 7): 1, ("decode", 9): 14}


def test_profiler_marks_every_step_from_the_first_chosen_one():
    """torch's profiler on the CPU: the chosen steps and the unchosen ones between them get a range
    (the gaps fallback needs them), nothing before the first chosen step or after the last."""
    torch = pytest.importorskip("torch")
    hook = sp.StepProfiler(torch, {("prefill", 0), ("decode", 2), ("decode", 3)})
    for phase, index in [("prefill", 0), *(("decode", i) for i in range(6))]:
        with hook(phase, index):
            torch.ones(4).sum()
    assert hook.prof is not None and not hook.left
    windows = sp.step_windows(hook.trace())
    assert [(w.phase, w.index) for w in windows] == [("prefill", 0), ("decode", 0), ("decode", 1), ("decode", 2),
                                                     ("decode", 3)]  # fmt: skip


def test_help_and_no_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        sp.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model",
        "--batch",
        "--context",
        "--steps",
        "--graph-capture",
        "--kv-memory-fraction",
        "--gc",
        "--out",
    ):
        assert flag in out
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(SystemExit) as e:
        sp.main(["--model", "synthetic:20b", "--out", "/nonexistent"])
    assert e.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "env"), [([], "0"), (["--pdl", "off"], "0"), (["--pdl", "on"], "1")])
def test_pdl_is_off_unless_asked(monkeypatch, flag, env):
    # the launchers read GPTOSS_MAX_PDL at each launch: it must be set before the model runs
    monkeypatch.setenv("GPTOSS_MAX_PDL", "unset")
    seen = {}
    monkeypatch.setattr(sp, "run", lambda args: seen.update(env=os.environ["GPTOSS_MAX_PDL"], pdl=args.pdl) or 0)
    assert sp.main(flag) == 0
    assert seen["env"] == env and seen["pdl"] == ("on" if env == "1" else "off")


def test_by_call_averages_each_call_position_over_the_steps():
    # a full-attention layer (3 us, 5 us) then a sliding one (1 us, 2 us) in each of two steps
    assert sp.by_call([[3.0, 1.0], [5.0, 2.0]], 2) == [4.0, 1.5]
    # a step that ran the kernel a different number of times, or not at all, has no positions
    assert sp.by_call([[3.0, 1.0], [5.0]], 2) is None
    assert sp.by_call([[3.0, 1.0]], 2) is None
    assert sp.by_call([[1.0] * (sp.BY_CALL_MAX + 1)], 1) is None


def test_exposed_time_counts_each_kernel_once_past_the_ones_before_it():
    ev = sp.KernelEvent
    # a (0-10), b launched early under PDL (4-14: its first 6 us wait for a), c after a gap
    # (20-25), d hidden inside c (21-23)
    events = [ev("a", 0.0, 10.0), ev("b", 4.0, 10.0), ev("c", 20.0, 5.0), ev("d", 21.0, 2.0)]
    assert sp.exposed(events) == [10.0, 4.0, 5.0, 0.0]
    # the shares add up to the span less the idle gap (14-20)
    assert sum(sp.exposed(events)) == 25.0 - 6.0
    phases = sp.summarize({sp.Window("decode", 0, 0.0, 30.0): events}, n_layers=1)
    rows = {k["name"]: k for k in phases["decode"]["kernels"]}
    assert rows["b"]["mean_us"] == 10.0 and rows["b"]["exposed_us_per_step"] == 4.0
    assert rows["d"]["exposed_us_per_step"] == 0.0


def test_gc_modes_are_the_e2e_benchs(monkeypatch):
    from gptoss_max import e2e

    seen = {}
    monkeypatch.setattr(sp, "run", lambda args: seen.update(gc=args.gc) or 0)
    for mode in e2e.GC_MODES:
        assert sp.main(["--gc", mode]) == 0 and seen["gc"] == mode
    with pytest.raises(SystemExit):
        sp.main(["--gc", "sometimes"])
