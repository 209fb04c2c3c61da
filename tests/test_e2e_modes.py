"""scripts/e2e_modes.py: e2e runs sorted into the two step-time modes, with what came with each."""

from __future__ import annotations

import json
import textwrap

from script_loader import load_script

modes = load_script("scripts/e2e_modes.py", "e2e_modes")


def _write(path, p50, collections, gc="default", clocks=None):
    batch = {"batch": 1, "decode_tok_s": 1000 / p50, "tpot_p50_ms": p50, "gc_collections": collections,
             "tpot_quarters_ms": [p50] * 4, "gpu_state": {"before": clocks, "after": clocks}}  # fmt: skip
    worker = {"gc": gc, "batches": [batch]}
    path.write_text(json.dumps({"runs": {"synthetic:20b default": {"workers": {"ours-graphs": worker}}}}))


def test_runs_split_at_the_geometric_mean_and_keep_their_collections(tmp_path, capsys):
    clocks = {"clocks.sm": "1980 MHz", "clocks.mem": "3201 MHz", "clocks_throttle_reasons.active": "0x0"}
    _write(tmp_path / "e2e_a.json", 1.66, [4, 0, 0], clocks=clocks)
    _write(tmp_path / "e2e_b.json", 2.14, [3, 1, 0], gc="freeze")
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "e2e_c.json", 1.70, [4, 0, 0])
    rows = modes.label(modes.runs([tmp_path]), 1.15)
    by_file = {r["file"]: r for r in rows}
    assert [by_file[f]["mode"] for f in ("e2e_a.json", "e2e_b.json", "e2e_c.json")] == ["fast", "slow", "fast"]
    assert by_file["e2e_b.json"]["gc_mode"] == "freeze" and by_file["e2e_b.json"]["gc_collections"] == [3, 1, 0]
    assert by_file["e2e_a.json"]["clocks"] == ["1980 MHz/3201 MHz 0x0"] * 2
    # within the spread: no labels
    assert {r["mode"] for r in modes.label(modes.runs([tmp_path / "e2e_a.json", tmp_path / "sub"]), 1.15)} == {"-"}
    assert modes.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and out[0].startswith("| file |")
    assert [ln for ln in out if "| slow |" in ln] == [ln for ln in out if "e2e_b.json" in ln]


def test_no_runs_is_an_error(tmp_path, capsys):
    assert modes.main([str(tmp_path)]) == 1
    assert "no e2e runs" in capsys.readouterr().err


def test_slow_stretches_within_a_run_and_who_waited(tmp_path, capsys):
    # 40 fast steps (GPU-bound: the host waits 0.3 ms of 1.66), a 20-step stretch at 2.14 ms whose
    # wait stayed put (the host's own work grew), 40 fast again, and one lone slow step (not a stretch)
    step = [1.66] * 40 + [2.14] * 20 + [1.66] * 40
    step[90] = 4.0
    wait = [0.3] * 100
    slow, found = modes.stretches(step, 1.15)
    assert found == [(40, 59, 42.8)] and sum(slow) == 20
    split = modes.split_waits(step, wait, slow)
    assert split == {"wait_fast_ms": 0.3, "host_fast_ms": 1.36, "wait_slow_ms": 0.3, "host_slow_ms": 1.84}
    assert modes.stretches([], 1.15) == ([], [])

    batch = {"batch": 1, "decode_tok_s": 590.0, "tpot_p50_ms": 1.66, "gc_collections": [4, 0, 0],
             "step_ms": step, "sync_wait_ms": wait}  # fmt: skip
    doc = {"runs": {"synthetic:20b default": {"workers": {"ours-graphs": {"gc": "default", "batches": [batch]}}}}}
    (tmp_path / "e2e_s.json").write_text(json.dumps(doc))
    (r,) = modes.add_stretches(modes.label(modes.runs([tmp_path]), 1.15), 1.15)
    assert r["slow_share"] == 0.2 and r["stretches"] == 1 and r["longest_ms"] == 42.8
    assert modes.main([str(tmp_path)]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert "| 20 % | 1 (43) | 0.3 / 0.3 | 1.36 / 1.84 |" in row


def test_gpu_e2e_modes_sh_cycles_variants_and_passes_common_flags(tmp_path):
    """scripts/gpu_e2e_modes.sh with a stand-in python3 that records its arguments: every e2e run
    gets E2E_ARGS, and VARIANTS' flag sets in turn ("|" between them; an empty one is no flags)."""
    import os
    import stat
    import subprocess

    from script_loader import ROOT

    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\ncat > /dev/null\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", SOAK="0",
               E2E_ARGS="--isolate-main-thread", VARIANTS="|--replay-small-graphs on")  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_e2e_modes.sh"), str(tmp_path / "out"), "3", "16", "1000"],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = [line.split() for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("bench/e2e.py")]
    assert len(runs) == 3
    for r, args in enumerate(runs, 1):
        assert "--isolate-main-thread" in args and args[-2:] == ["--out", str(tmp_path / "out" / f"e2e_{r}")]
        assert ("--replay-small-graphs" in args) == (r == 2)
    assert runs[1][runs[1].index("--replay-small-graphs") + 1] == "on"
    assert "run 2 (--gc default --replay-small-graphs on) rc=0" in proc.stdout


def test_setup_names_replay_check_mismatches_isolation_and_worker_env(tmp_path, capsys):
    batch = {"batch": 1, "decode_tok_s": 600.0, "tpot_p50_ms": 1.6, "gc_collections": [1, 0, 0],
             "replayed": {"sampler": {"replay": 9, "checked": 9, "mismatch": 1},
                          "realize_future_token": {"replay": 8, "checked": 8, "mismatch": 0}},
             "isolated_main_thread": {"isolated": True, "cpu": 15}}  # fmt: skip
    worker = {"gc": "default", "replay_small_graphs": "check", "worker_env": {"MODULAR_X": "1"}, "batches": [batch]}
    plain = {"gc": "default", "replay_small_graphs": "off", "batches": [dict(batch, isolated_main_thread=None)]}
    for name, w in (("e2e_a.json", worker), ("e2e_b.json", plain)):
        (tmp_path / name).write_text(json.dumps({"runs": {"synthetic:20b default": {"workers": {"ours-graphs": w}}}}))
    assert modes.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    setup = "replay check; mismatch 1 of 17; main thread on CPU 15; MODULAR_X=1"
    assert f"| e2e_a.json | synthetic:20b | {setup} | 1 |" in out
    assert "| e2e_b.json | synthetic:20b | - | 1 |" in out


def test_gpu_replay_diag_sh_runs_the_server_suite_per_case_and_keeps_the_notes(tmp_path):
    """scripts/gpu_replay_diag.sh with a stand-in python3 (a pytest that writes a server log with
    device asserts): each case runs the suite with its replay mode and graphs, and keeps the
    summary and the log's notes with the asserts counted."""
    import os
    import stat
    import subprocess

    from script_loader import ROOT

    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        while [ $# -gt 0 ]; do [ "$1" = --basetemp ] && base=$2; shift; done
        rm -rf "$base"  # as pytest empties its basetemp (once, the suite's log with it)
        echo "graphs=${{GPTOSS_MAX_REPLAY_GRAPHS:-all}} args=$GPTOSS_MAX_TEST_SERVE_ARGS" >> {tmp_path / "calls"}
        mkdir -p "$base/e2e0"
        printf 'ready\\nAt: gather_scatter.mojo:729: Assert Error: Gather index out of bounds.\\n%.0s' 1 2 \\
          > "$base/e2e0/server.log"
        echo "sampler: replay of graph 1 differs from an eager call" >> "$base/e2e0/server.log"
        echo "=== short test summary info ==="; echo "FAILED test_server_e2e.py::test_x"; echo "1 failed, 30 passed"
        """))  # fmt: skip
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_replay_diag.sh"), str(out), "1000"],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "calls").read_text().splitlines() == [
        "graphs=all args=--graph-capture --replay-small-graphs check",  # all: the scatter too
        "graphs=sampler,sampler_bitmask args=--graph-capture --replay-small-graphs on",
        "graphs=realize_future_token args=--graph-capture --replay-small-graphs on",
    ]
    names = ["check_all", "on_sampler+sampler_bitmask", "on_realize_future_token"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"suite_{n}.log" for n in names] + [f"server_{n}.txt" for n in names]
    )
    notes = (out / "server_check_all.txt").read_text()
    assert "device asserts: 2" in notes and notes.count("differs from an eager call") == 2  # the notes, the tail
    assert "Gather index" not in notes and "1 failed, 30 passed" in (out / "suite_check_all.log").read_text()
    assert "check:all: rc=0" in proc.stdout
