"""scripts/pyspy_steps.py: a decode step's host time by frame, from py-spy's raw output."""

from __future__ import annotations

import gzip

from script_loader import load_script

steps = load_script("scripts/pyspy_steps.py", "pyspy_steps")

_EXEC = "thread (11): MainThread;main (e2e.py:9);step (e2e.py:20);OverlapTextGenerationPipeline._execute (lib/o.py:{})"
RAW = "\n".join(
    [
        _EXEC.format(1) + ";run (lib/o.py:5);execute (engine/api.py:145) 6",
        _EXEC.format(2) + ";run (lib/o.py:6) 2",
        _EXEC.format(3) + ";sample (lib/s.py:7) 2",
        "thread (11): MainThread;main (e2e.py:9);load (e2e.py:30) 50",
        "thread (12): ThreadPoolExecutor-0_0;step (e2e.py:20);work (w.py:1) 40",
    ]
)


def test_keeps_the_main_threads_step_and_merges_a_functions_lines(tmp_path, capsys):
    path = tmp_path / "prof.txt.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(RAW)
    assert steps.main([str(path), "--within", "step (e2e.py)", "--step-ms", "2.0", "--min", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "10 samples of the main thread inside step (e2e.py)"
    assert out[1:] == [
        "100.0 %  2.000 ms  OverlapTextGenerationPipeline._execute (o.py)",
        " 80.0 %  1.600 ms    run (o.py)",
        " 60.0 %  1.200 ms      execute (api.py)",
        " 20.0 %  0.400 ms    sample (s.py)",
    ]


def test_min_leaves_small_frames_out_and_no_samples_is_an_error(tmp_path, capsys):
    path = tmp_path / "prof.txt"
    path.write_text(RAW)
    assert steps.main([str(path), "--within", "step (e2e.py)", "--min", "70"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "100.0 %  OverlapTextGenerationPipeline._execute (o.py)",
        " 80.0 %    run (o.py)",
    ]
    assert steps.main([str(path), "--within", "nowhere"]) == 1
    assert "no main-thread samples through 'nowhere'" in capsys.readouterr().err
