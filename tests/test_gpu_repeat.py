"""scripts/gpu_repeat.py: its bookkeeping, and a CPU run that must find greedy decoding repeatable."""

from __future__ import annotations

import json

import numpy as np
import pytest

from script_loader import load_script

repeat = load_script("scripts/gpu_repeat.py", "gpu_repeat")


def test_first_difference():
    assert repeat.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert repeat.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert repeat.first_difference([1, 2], [1, 2, 3]) == 2  # a prefix ends where the shorter one does
    assert repeat.first_difference([], []) is None


def test_top2_margins():
    logits = np.array([[0.0, 3.0, 2.5], [1.0, 1.0, -4.0]], np.float32)
    assert repeat.top2_margins(logits) == [0.5, 0.0]


def test_summary_places_each_difference_and_its_margin():
    runs = [{"prompt": "A", "tokens": [1, 2, 3]}, {"prompt": "A", "tokens": [1, 2, 3]},
            {"prompt": "B", "tokens": [9, 9, 9]}, {"prompt": "A", "tokens": [1, 7, 7]}]  # fmt: skip
    s = repeat.summarize({"runs": runs, "logits": {"top2_margin": [4.0, 0.01, 2.0, 1.0]}})
    assert s["repeatable"] is False
    assert s["differences"] == [
        {"run": 1, "after_b": False, "first_difference": None, "top2_margin_there": None},
        {"run": 3, "after_b": True, "first_difference": 1, "top2_margin_there": 0.01},
    ]
    same = repeat.summarize({"runs": runs[:3], "logits": {"error": "no logits"}})
    assert same["repeatable"] is True and [d["run"] for d in same["differences"]] == [1]


def test_graph_capture_on_a_cpu_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        repeat.main(["--device", "cpu", "--capture", "on", "--out", str(tmp_path)])


@pytest.mark.slow
def test_greedy_decoding_repeats_on_the_cpu(tmp_path):
    """The CPU's float32 graph: every run of A equal, B between them included, logits bitwise equal."""
    rc = repeat.main(["--device", "cpu", "--model", "synthetic:tiny", "--capture", "off", "--repeats", "2",
                      "--tokens", "6", "--prompt-len", "40", "--timeout", "1200", "--out", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("repeat_cpu_*.json")
    result = json.loads(path.read_text())
    mode = result["modes"]["off"]
    assert rc == 0, mode.get("log_tail")
    assert [r["prompt"] for r in mode["runs"]] == ["A", "A", "B", "A"]
    assert all(len(r["tokens"]) == 6 for r in mode["runs"])
    assert mode["runs"][2]["tokens"] != mode["runs"][0]["tokens"], "another prompt, another answer"
    assert mode["repeatable"] is True and [d["after_b"] for d in mode["differences"]] == [False, True]
    assert mode["logits"]["bitwise_equal"] is True and mode["logits"]["max_abs_diff"] == 0.0
    assert len(mode["logits"]["top2_margin"]) == 6 and min(mode["logits"]["top2_margin"]) >= 0
