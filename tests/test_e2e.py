"""`gptoss-max bench` (e2e.py): its pieces, its failure handling, and a CPU smoke run on synthetic:tiny."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptoss_max import e2e, memory
from gptoss_max.config import PRESETS
from gptoss_max.synthetic import SyntheticModel


def test_prefill_waves_respect_the_token_budget():
    assert e2e.waves([1024] * 64, 8192) == [list(range(k, k + 8)) for k in range(0, 64, 8)]
    assert e2e.waves([1024], 8192) == [[0]]
    assert e2e.waves([9000, 10, 10], 8192) == [[0], [1, 2]]  # an oversized prompt still goes, alone


def test_step_spread_separates_a_few_stalled_steps_from_the_median():
    # ten 2 ms steps, one of them 30 ms: the mean moves, the median does not
    start = 100.0
    ends, t = [], start
    for k in range(10):
        t += 0.030 if k == 6 else 0.002
        ends.append(t)
    s = e2e.step_spread(start, [start - 0.1, *ends])  # a prefill-time return before the start is ignored
    assert s["tpot_p50_ms"] == pytest.approx(2.0) and s["tpot_max_ms"] == pytest.approx(30.0)
    assert s["slow_steps"] == 1 and 2.0 < s["tpot_p90_ms"] <= 30.0
    assert s["step_ms"] == pytest.approx([2.0] * 6 + [30.0] + [2.0] * 3, abs=1e-3)
    assert s["tpot_quarters_ms"] == pytest.approx([2.0, 2.0, 16.0, 2.0], abs=1e-3)  # 3, 3, 2, 2 steps
    assert e2e.step_spread(start, [])["tpot_p50_ms"] is None


def test_step_spread_quarters_show_a_mode_switch_within_a_run():
    # 8 steps at 1.66 ms, then 8 at 2.14 ms (the two modes of bench/NOTES.md's twelfth session)
    start, t, ends = 5.0, 5.0, []
    for k in range(16):
        t += 0.00166 if k < 8 else 0.00214
        ends.append(t)
    s = e2e.step_spread(start, ends)
    assert s["tpot_quarters_ms"] == pytest.approx([1.66, 1.66, 2.14, 2.14], abs=1e-3)
    assert s["slow_steps"] == 0 and len(s["step_ms"]) == 16


def test_cpu_spread_gives_each_quarters_cpu_time_per_step():
    # 9 returns, so 8 steps: the process spends 1 ms a step, then 3 ms in the second half;
    # the stepping thread 0.5 ms throughout
    cpu, proc, thread = [], 10.0, 4.0
    for k in range(9):
        cpu.append((proc, thread))
        proc += 0.001 if k < 4 else 0.003
        thread += 0.0005
    s = e2e.cpu_spread(cpu)
    assert s["cpu_quarters_ms"] == pytest.approx([1.0, 1.0, 3.0, 3.0])
    assert s["thread_cpu_quarters_ms"] == pytest.approx([0.5] * 4)
    assert e2e.cpu_spread(cpu[:1]) == {"cpu_quarters_ms": [], "thread_cpu_quarters_ms": []}


def test_wait_spread_gives_each_steps_wait_for_the_gpu():
    # a GPU-bound first half (the host waits 0.4 ms a step), then a host-bound second (no wait)
    waits = [0.0004] * 4 + [0.0] * 4
    s = e2e.wait_spread(waits, overlapped=True)
    assert s["sync_wait_quarters_ms"] == pytest.approx([0.4, 0.4, 0.0, 0.0])
    assert s["sync_wait_ms"] == pytest.approx([0.4] * 4 + [0.0] * 4)
    # no overlap pipeline (no device graphs): nothing was measured, not zero waits
    assert e2e.wait_spread([0.0] * 8, overlapped=False) == {"sync_wait_quarters_ms": [], "sync_wait_ms": []}


def test_host_bound_spread_tells_the_hosts_steps_from_the_gpus():
    # 12 steps at 1.63 ms that waited 0.3 ms for the GPU, then 4 at 1.95 ms that did not wait
    # (the sync's own 0.006 ms): a host stretch (bench/NOTES.md, "Twenty-fifth session")
    steps = [1.63] * 12 + [1.95] * 4
    waits = [0.3] * 12 + [0.006] * 4
    s = e2e.host_bound_spread(steps, waits)
    assert s == {"host_bound_share": 0.25, "gpu_step_p50_ms": 1.63}
    # a run the stretch covers: every step the host's, no GPU step to report
    assert e2e.host_bound_spread([1.95] * 16, [0.006] * 16) == {"host_bound_share": 1.0, "gpu_step_p50_ms": None}
    # fewer than 8 waiting steps are too few for a median
    assert e2e.host_bound_spread([1.6] * 7 + [2.0], [0.3] * 7 + [0.0])["gpu_step_p50_ms"] is None
    # no device graphs: no waits were measured
    assert e2e.host_bound_spread([1.6] * 8, []) == {"host_bound_share": None, "gpu_step_p50_ms": None}


def test_host_state_reads_this_machine():
    state = e2e.host_state()
    assert state["cpus_allowed"] >= 1
    assert len(state["load_avg"]) == 3
    if Path("/proc/cpuinfo").exists() and "cpu MHz" in Path("/proc/cpuinfo").read_text():
        mhz = state["cpu_mhz"]
        assert 0 < mhz["min"] <= mhz["mean"] <= mhz["max"]


def test_gc_mode_sets_the_collector_and_puts_it_back():
    import gc

    assert gc.isenabled()
    garbage = []
    garbage.append(garbage)  # a cycle only the collector frees
    del garbage
    with e2e.gc_mode("collect"):
        assert gc.isenabled() and gc.get_count()[0] < 50  # just collected
    frozen_before = gc.get_freeze_count()
    with e2e.gc_mode("freeze"):
        assert gc.get_freeze_count() > frozen_before and gc.isenabled()
    assert gc.get_freeze_count() == frozen_before
    with e2e.gc_mode("off"):
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), e2e.gc_mode("off"):  # put back after an error too
        raise RuntimeError("step failed")
    assert gc.isenabled()
    with e2e.gc_mode("default"):
        assert gc.isenabled()
    with pytest.raises(ValueError, match="gc mode"), e2e.gc_mode("sometimes"):
        pass


def test_gpu_state_reads_clocks_and_throttle_reasons(monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "1980 MHz, 3201 MHz, 0x0000000000000000, 41, 120.5 W, P0\n", "")

    monkeypatch.setattr(e2e.shutil, "which", lambda name: "/bin/" + name)
    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    state = e2e.gpu_state()
    assert state == {
        "clocks.sm": "1980 MHz",
        "clocks.mem": "3201 MHz",
        "clocks_throttle_reasons.active": "0x0000000000000000",
        "temperature.gpu": "41",
        "power.draw": "120.5 W",
        "pstate": "P0",
    }
    assert (
        "--query-gpu=clocks.sm,clocks.mem,clocks_throttle_reasons.active,temperature.gpu,power.draw,pstate" in calls[0]
    )
    # a driver that knows the throttle reasons only as clock event reasons: asked again by that name
    calls.clear()

    def newer_driver(cmd, **kw):
        calls.append(cmd)
        if "throttle" in cmd[1]:
            return subprocess.CompletedProcess(cmd, 2, "Field clocks_throttle_reasons.active is not valid\n", "")
        return subprocess.CompletedProcess(cmd, 0, "1980 MHz, 3201 MHz, 0x0000000000000001, 40, 99.0 W, P0\n", "")

    monkeypatch.setattr(e2e.subprocess, "run", newer_driver)
    assert e2e.gpu_state()["clocks_throttle_reasons.active"] == "0x0000000000000001"
    assert len(calls) == 2 and "clocks_event_reasons.active" in calls[1][1]
    # a field neither knows comes back as an error line: no state rather than a wrong one
    monkeypatch.setattr(
        e2e.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, "Field error\n", "")
    )
    assert e2e.gpu_state() is None
    monkeypatch.setattr(e2e.shutil, "which", lambda name: None)
    assert e2e.gpu_state() is None


@pytest.mark.parametrize("poll", [False, True])
def test_peak_memory_samples_around_a_timed_run_unless_polling(monkeypatch, poll):
    calls = []
    readings = iter([5, 9, 7, 7, 7, 7, 7, 7, 7, 7])

    def used(self):
        calls.append(time.perf_counter())
        return next(readings, 7) << 20

    monkeypatch.setattr(e2e.PeakMemory, "_used", used)
    monitor = e2e.PeakMemory(gpu=True, poll=poll)
    with monitor:
        # without polling nothing runs beside the timed work: exactly one sample before it
        assert (monitor._thread is None) == (not poll)
        if not poll:
            assert len(calls) == 1
        time.sleep(0.05)
    assert monitor._thread is None
    if not poll:
        assert len(calls) == 2 and monitor.peak == 9 << 20  # the sample on exit counts
    else:
        assert len(calls) >= 1 and monitor.peak >= 5 << 20


def test_device_names_and_rows_merge():
    assert e2e.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert e2e.device_slug("NVIDIA H200") == "h200"
    assert e2e.device_slug(None) == "cpu"
    old = [{"model": "m", "batch": 1, "graph_capture": False, "ours_tok_s": 1.0},
           {"model": "m", "batch": 8, "graph_capture": False, "ours_tok_s": 2.0}]  # fmt: skip
    new = [{"model": "m", "batch": 1, "graph_capture": False, "ours_tok_s": 3.0},
           {"model": "m", "batch": 1, "graph_capture": True, "ours_tok_s": 4.0, "tpot_ms": 2.3,
            "tpot_p50_ms": 1.984, "slow_steps": 7, "host_bound_share": 0.25, "gpu_step_p50_ms": 1.63}]  # fmt: skip
    merged = e2e.merge_rows(old, new)
    assert [(r["batch"], r["graph_capture"], r["ours_tok_s"]) for r in merged] == [(1, False, 3.0), (8, False, 2.0),
                                                                                  (1, True, 4.0)]  # fmt: skip
    table = e2e.markdown_table({"device": "NVIDIA H100", "date": "2026-11-21", "rows": merged})
    assert "NVIDIA H100, 2026-11-21" in table and table.count("\n| m |") == 3
    assert "| 2.3 | 1.984 | 7 | 25 % | 1.63 |" in table  # mean TPOT, median, slow steps, host-bound, GPU step
    assert "| m | 8 | no | 2.0 | n/a |" + " — |" * 8 in table  # a row without waits: no host-bound share


def test_the_plan_takes_the_memory_the_device_reported():
    """A run plans for the GPU it runs on (a 141 GB H200 was once planned as an 80 GB H100);
    --gpu-memory-gib overrides it, --plan alone falls back to an idle H100; a CPU plans its host."""
    gpu = argparse.Namespace(gpu=True, gpu_memory_gib=None)
    assert e2e.plan_memory(gpu, 150 << 30) == 150 << 30
    assert e2e.plan_memory(gpu, None) == int(e2e.DEFAULT_GPU_FREE_GIB * 2**30)
    gpu.gpu_memory_gib = 40.0
    assert e2e.plan_memory(gpu, 150 << 30) == 40 << 30
    assert e2e.plan_memory(argparse.Namespace(gpu=False, gpu_memory_gib=40.0), 150 << 30) == e2e._host_memory()


def test_stock_variants():
    args = argparse.Namespace(gpu=True, model="synthetic:20b")
    assert e2e._stock_variants(args, SyntheticModel("20b"), True) == [
        ("float4_e2m1fnx2", "synthetic:20b"),
        ("bfloat16", "synthetic:20b,seed=0,experts=bf16"),
    ]
    args.model = "synthetic:120b"
    assert e2e._stock_variants(args, SyntheticModel("120b"), True) == [("float4_e2m1fnx2", "synthetic:120b")]
    args.gpu = False
    assert e2e._stock_variants(args, SyntheticModel("120b"), True) == [("float32", "synthetic:120b")]


def _args(**kw):
    base = dict(device="cpu", prompt_len=8, output_len=2, warmup_tokens=0, batch=[1], max_length=None,
                max_batch_input_tokens=None, kv_memory_fraction=None, memory_poll="outside", gc="default",
                worker_env=None)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_a_failing_pipeline_is_a_null_row_with_its_reason(tmp_path):
    """What the stock pipeline gets on Hopper: the worker fails (or hangs past its timeout); the row
    keeps our numbers and says why MAX's are missing."""
    args = _args(worker_env=["GPTOSS_MAX_TEST_WORKER_ENV=a=b", "GPTOSS_MAX_TEST_EMPTY="])
    res = e2e.run_worker(args, "stock", str(tmp_path / "no-such-model"), None, False, 120, tmp_path)
    assert res["error"].startswith("exit 1: ") and "no-such-model" in res["error"], res["error"]
    # --worker-env reached the worker, which said what it found before it failed
    assert res["worker_env"] == {"GPTOSS_MAX_TEST_WORKER_ENV": "a=b", "GPTOSS_MAX_TEST_EMPTY": ""}
    hung = e2e.run_worker(_args(), "stock", "synthetic:tiny", None, False, 0.4, tmp_path)
    assert hung["error"].startswith("timed out after 0 s")
    args = _args(batch=[1, 8], gpu=True, encoding=None)
    ours = {False: {"batches": [{"batch": 1, "decode_tok_s": 10.0, "ttft_ms": 5.0, "tpot_ms": 0.1}]}}
    rows = e2e._rows("synthetic:20b", PRESETS["20b"], True, args, 3e12, ours, {"float4_e2m1fnx2": res})
    assert [set(e2e.ROW_FIELDS) <= set(r) for r in rows] == [True, True]
    assert rows[0]["ours_tok_s"] == 10.0 and rows[0]["max_stock_tok_s"] is None
    assert rows[0]["max_stock_error"].startswith("float4_e2m1fnx2: exit 1")
    assert rows[0]["roofline_tok_s"] == pytest.approx(
        3e12 / memory.decode_step_bytes(PRESETS["20b"], True, 1, 1)["total"], rel=0.02
    )
    assert rows[1]["ours_tok_s"] is None


def _pids_whose_command_has(text: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{name}/cmdline", "rb").read().decode(errors="replace")
            state = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(name))
    return pids


def test_a_stopped_bench_takes_its_worker_with_it(tmp_path):
    """`timeout N bench/e2e.py ...` sends SIGTERM to the bench only; its worker (its own session, so
    a worker timeout can kill its whole group) used to live on and hold the GPU's memory."""
    code = (
        "import argparse; from pathlib import Path; from gptoss_max import e2e; "
        "a = argparse.Namespace(device='cpu', prompt_len=8, output_len=2, warmup_tokens=0, batch=[1], "
        "max_length=None, max_batch_input_tokens=None, kv_memory_fraction=None, memory_poll='outside', gc='default'); "
        f"e2e.run_worker(a, 'stock', 'synthetic:tiny', None, False, 600, Path({str(tmp_path)!r}))"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(e2e.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL)
    marker = str(tmp_path / "worker_stock.json")  # only the worker's command line holds it
    deadline = time.monotonic() + 60
    workers: list[int] = []
    while not workers and time.monotonic() < deadline and parent.poll() is None:
        workers = _pids_whose_command_has(marker)
        time.sleep(0.05)
    assert workers, "the worker never started"
    parent.send_signal(signal.SIGTERM)
    rc = parent.wait(timeout=60)
    deadline = time.monotonic() + 10
    while _pids_whose_command_has(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _pids_whose_command_has(marker)
    for pid in left:  # never leave one behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, "the worker outlived the stopped bench"
    assert rc == 128 + signal.SIGTERM


@pytest.mark.slow
def test_bench_smoke_on_cpu(tmp_path):
    """`gptoss-max bench` as a user runs it, at CI size: synthetic:tiny on the CPU, batch 1 and 2."""
    cmd = [sys.executable, "-m", "gptoss_max.cli", "bench", "--model", "synthetic:tiny", "--device", "cpu",
           "--batch", "1", "2", "--prompt-len", "40", "--output-len", "6", "--max-length", "1024", "--stock", "off",
           "--out", str(tmp_path), "--keep-logs", "--gc", "freeze", "--isolate-main-thread"]  # fmt: skip
    env = dict(os.environ, GPTOSS_MAX_ROUTER="fused")  # a run-changing setting: the command records it
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    path = tmp_path / f"e2e_cpu_{datetime.date.today():%Y%m%d}.json"
    result = json.loads(path.read_text())
    assert result["device"] == "cpu" and "bench --model synthetic:tiny" in result["command"]
    assert result["command"].startswith("GPTOSS_MAX_ROUTER=fused ")
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert set(e2e.ROW_FIELDS) <= set(r)
        assert r["ours_tok_s"] > 0 and r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and r["roofline_tok_s"] > 0
        assert r["max_stock_tok_s"] is None and r["max_stock_error"] == "not run" and r["graph_capture"] is False
    (run,) = result["runs"].values()
    worker = run["workers"]["ours"]
    assert [b["tokens_per_row_min"] for b in worker["batches"]] == [6, 6]  # EOS ignored: every row runs out
    for b, r in zip(worker["batches"], rows, strict=True):
        # 5 decode steps each; their median and maximum bracket the mean TPOT
        assert 0 < b["tpot_p50_ms"] <= b["tpot_max_ms"] and b["tpot_p50_ms"] <= b["tpot_p90_ms"] <= b["tpot_max_ms"]
        assert b["tpot_max_ms"] >= b["tpot_ms"] * 0.999 and 0 <= b["slow_steps"] <= 5
        assert len(b["gc_collections"]) == 3 and r["tpot_p50_ms"] == round(b["tpot_p50_ms"], 3)
        # every step kept, each quarter's median; CPU per step from the second step; no GPU state here
        assert len(b["step_ms"]) == 5 and sum(b["step_ms"]) <= 1e3 * b["seconds"]
        assert len(b["tpot_quarters_ms"]) == 4 and len(r["tpot_quarters_ms"]) == 4
        assert len(b["cpu_quarters_ms"]) == 4 and all(q > 0 for q in b["cpu_quarters_ms"])
        assert b["gpu_state"] == {"before": None, "after": None} and b["host_state"]["after"]["cpus_allowed"] >= 1
        # the busiest threads of the timed batch, the main thread's isolation, no graphs to replay
        assert b["busiest_threads"] and b["busiest_threads"][0][2] > 0 and b["replayed"] == {}
        iso = b["isolated_main_thread"]
        assert iso["isolated"] or "no allowed CPU outside" in iso["reason"]
    assert worker["gc"] == "freeze" and "--gc freeze" in result["command"] and worker["isolate_main_thread"]
    assert worker["kv_bytes_per_token"] == memory.kv_bytes_per_token(PRESETS["tiny"], 4)  # MAX's cache = our plan
    assert worker["memory_plan"]["kv_cache_bytes"] > 0
    assert run["memory_plan"]["per_batch"]["1"]["weights_bytes"] == sum(
        memory.weight_bytes(PRESETS["tiny"], True, 4).values()
    )
    assert "| synthetic:tiny | 2 | no |" in proc.stdout
    (logs,) = tmp_path.glob("e2e_logs_cpu_*.tar.gz")  # --keep-logs: one file
    assert logs.stat().st_size > 0


def test_worker_env_takes_name_value_pairs_only():
    parser = e2e.add_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--worker-env", "A_1=x=y", "--worker-env", "B="]).worker_env == ["A_1=x=y", "B="]
    for bad in ("NOEQUALS", "=v", "1A=v", "A-B=v"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--worker-env", bad])


def test_merge_only_folds_device_calls_into_one_file(tmp_path, capsys):
    def run_file(name: str, rows: list[dict]) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-22", "prompt_len": 1024,
                                    "output_len": 256, "command": name, "rows": rows, "runs": {name: {}}}))  # fmt: skip
        return str(path)

    a = run_file("a.json", [{"model": "synthetic:20b", "batch": 1, "graph_capture": False, "ours_tok_s": 1.0}])
    b = run_file("b.json", [{"model": "synthetic:120b", "batch": 1, "graph_capture": False, "ours_tok_s": 2.0}])
    assert e2e.main(["--merge-only", "--merge", a, b, "--out", str(tmp_path / "out")]) == 0
    merged = json.loads((tmp_path / "out" / "e2e_h100_20261122.json").read_text())
    assert [r["model"] for r in merged["rows"]] == ["synthetic:120b", "synthetic:20b"]
    assert merged["commands"] == ["a.json", "b.json"] and set(merged["runs"]) == {"a.json", "b.json"}
    assert "NVIDIA H100 80GB HBM3, 2026-11-22" in capsys.readouterr().out
    # merging a merged file again keeps its commands, and a later file's row replaces an earlier one's
    c = run_file("c.json", [{"model": "synthetic:120b", "batch": 1, "graph_capture": False, "ours_tok_s": 3.0}])
    again = str(tmp_path / "out" / "e2e_h100_20261122.json")
    assert e2e.main(["--merge-only", "--merge", again, c, "--out", str(tmp_path / "out2")]) == 0
    merged = json.loads((tmp_path / "out2" / "e2e_h100_20261122.json").read_text())
    assert merged["commands"] == ["a.json", "b.json", "c.json"]
    assert [(r["model"], r["ours_tok_s"]) for r in merged["rows"]] == [("synthetic:120b", 3.0), ("synthetic:20b", 1.0)]
