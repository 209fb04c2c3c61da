"""scripts/serve_ab.py on the CPU: two variants of `serve` flags, each server started, probed
through GET /bench and stopped, every answer in the JSON (the script is for the GPU, where a
failed run costs device time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_variants_each_start_answer_their_probes_and_stop(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "serve_ab.py"), "--out", str(tmp_path), "--model", "synthetic:tiny",
           "--devices", "cpu", "--tokens", "4", "--repeats", "2", "--max-batch-size", "1", "--max-length", "2048",
           "--deadline", "900", "--start-s", "10", "--", "", "--isolate-scheduler-thread"]  # fmt: skip
    env = {**os.environ, "GPTOSS_MAX_DATA": str(tmp_path / "data")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1000, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = tmp_path.glob("serve_ab_cpu_*.json")
    result = json.loads(path.read_text())
    assert result["device"] == "cpu" and [r["flags"] for r in result["rows"]] == ["", "--isolate-scheduler-thread"]
    for row in result["rows"]:
        assert row["ready_s"] > 0 and len(row["probes"]) == 2
        assert all(p["n"] == 1 and p["output_tokens"] == 4 and p["decode_tok_per_s_per_seq"] > 0 for p in row["probes"])
    notes = ["\n".join(row["log_notes"]) for row in result["rows"]]  # the flag reached the worker
    assert "scheduler thread isolated" not in notes[0] and "scheduler thread isolated" in notes[1]
    assert [s["probes"] for s in result["summary"]] == [2, 2]
    assert result["summary"][0]["flags"] == "(none)" and "| --isolate-scheduler-thread | 2 |" in out.stdout
