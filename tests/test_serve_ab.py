"""scripts/serve_ab.py: on the CPU, one real server (the tiny model) started, probed through
GET /bench and stopped, with a flag that must reach its worker (the script is for the GPU, where a
failed run costs device time); and, with the servers stood in for, the variants alternating round
by round, the deadline's skips and the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from script_loader import ROOT, load_script


@pytest.mark.slow
def test_a_server_starts_answers_its_probes_and_stops_with_its_flags_in_the_worker(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "serve_ab.py"), "--out", str(tmp_path), "--model", "synthetic:tiny",
           "--devices", "cpu", "--tokens", "4", "--repeats", "2", "--max-batch-size", "1", "--max-length", "2048",
           "--deadline", "900", "--start-s", "10", "--", "--isolate-scheduler-thread"]  # fmt: skip
    env = {**os.environ, "GPTOSS_MAX_DATA": str(tmp_path / "data")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1000, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = tmp_path.glob("serve_ab_cpu_*.json")
    result = json.loads(path.read_text())
    (row,) = result["rows"]
    assert result["device"] == "cpu" and row["flags"] == "--isolate-scheduler-thread" and row["ready_s"] > 0
    assert "--store" in row["command"]  # its own response store, not the data dir's
    assert len(row["probes"]) == 2
    assert all(p["n"] == 1 and p["output_tokens"] == 4 and p["decode_tok_per_s_per_seq"] > 0 for p in row["probes"])
    assert any("scheduler thread isolated" in line for line in row["log_notes"])  # the flag reached the worker
    assert result["summary"][0]["probes"] == 2 and "| --isolate-scheduler-thread | 1.0 | 2 |" in out.stdout


def test_variants_alternate_round_by_round_and_a_late_start_is_skipped(tmp_path, monkeypatch, capsys):
    ab = load_script("scripts/serve_ab.py", "serve_ab_script")
    clock = [0.0]
    started = []

    def run_variant(args, flags, log, deadline):
        started.append(flags)
        clock[0] += 100  # each server's start and probes
        speed = {"": 500.0, "--x": 550.0}[flags]
        probes = [
            {"decode_tok_per_s_per_seq": speed + len(started) + 10 * t, "temperature": t} for t in args.temperatures
        ]
        return {"flags": flags, "probes": probes, "ready_s": 1.0}

    monkeypatch.setattr(ab, "run_variant", run_variant)
    monkeypatch.setattr(ab, "clock", lambda: clock[0])
    code = ab.main(["--out", str(tmp_path), "--devices", "cpu", "--rounds", "3", "--deadline", "450",
                    "--start-s", "100", "--temperatures", "1,0", "--", "", "--x"])  # fmt: skip
    assert code == 0 and started == ["", "--x", "", "--x"]  # the 5th start would leave less than --start-s
    result = json.loads(next(tmp_path.glob("serve_ab_cpu_*.json")).read_text())
    assert [r["round"] for r in result["rows"]] == [1, 1, 2, 2]
    rows = [(s["flags"], s["temperature"], s["probes"], s["median_decode_tok_s_per_seq"], s["all"])
            for s in result["summary"]]  # fmt: skip
    assert rows == [  # per variant and temperature
        ("(none)", 1.0, 2, 512.0, [511.0, 513.0]),
        ("(none)", 0.0, 2, 502.0, [501.0, 503.0]),
        ("--x", 1.0, 2, 563.0, [562.0, 564.0]),
        ("--x", 0.0, 2, 553.0, [552.0, 554.0]),
    ]
    printed = capsys.readouterr().out
    assert "round 3, variant '': 50 s left, skipped" in printed and "| --x | 0.0 | 2 | 553.0 |" in printed
    with pytest.raises(SystemExit):
        ab.main(["--out", str(tmp_path), "--temperatures", "1,3", "--", ""])


def test_the_notes_keep_what_the_flags_did(tmp_path):
    ab = load_script("scripts/serve_ab.py", "serve_ab_script")
    log = tmp_path / "server.log"
    log.write_text("\n".join([
        "INFO: Model worker ready",
        "INFO: replaying device graphs for: sampler, sampler_bitmask",
        "INFO: sampler: captured graph 1 (input shapes [(1, 201088)]; host values [[], 255, 1.0])",
        "INFO: sampler: after 1024 calls: {'replay': 1022, 'capture': 1, 'eager': 2}, 0 signatures counted",
        "INFO: Enqueued TG batch with 1 reqs",
    ]))  # fmt: skip
    notes, tail = ab.notes_and_tail(log, n=3)
    assert [n.split(": ", 1)[1][:16] for n in notes] == ["replaying device", "sampler: capture", "sampler: after 1"]
    assert tail[-1] == "INFO: Enqueued TG batch with 1 reqs" and len(tail) == 3


def test_a_variant_may_set_its_servers_environment():
    ab = load_script("scripts/serve_ab.py", "serve_ab_script")
    assert ab.split_env("") == ({}, [])
    assert ab.split_env("GPTOSS_MAX_REPLAY_GRAPHS=all X=a=b --replay-small-graphs on") == (
        {"GPTOSS_MAX_REPLAY_GRAPHS": "all", "X": "a=b"},
        ["--replay-small-graphs", "on"],
    )
    assert ab.split_env("--flag A=1") == ({}, ["--flag", "A=1"])  # only leading words
