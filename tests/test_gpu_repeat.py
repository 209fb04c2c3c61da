"""scripts/gpu_repeat.py: its bookkeeping, and a CPU run that must find greedy decoding repeatable."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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


def test_summary_counts_logits_that_differ_as_not_repeatable():
    runs = [{"prompt": "A", "tokens": [1]}, {"prompt": "B", "tokens": [2]}, {"prompt": "A", "tokens": [1]}]
    assert repeat.summarize({"runs": runs, "logits": {"bitwise_equal": True}})["logits_repeatable"] is True
    assert repeat.summarize({"runs": runs, "logits": {"bitwise_equal": False}})["logits_repeatable"] is False
    prefill = {"passes": 3, "differ": [{"pass": 2, "first_step": 0, "max_abs_diff": 0.5}]}
    s = repeat.summarize({"runs": runs, "logits": {"bitwise_equal": True}, "prefill": prefill})
    assert s["repeatable"] is True and s["logits_repeatable"] is False


def test_compare_passes_names_the_first_step_that_differs():
    a = np.zeros((3, 4), np.float32)
    b, c = a.copy(), a.copy()
    c[1, 2], c[2, 0] = 0.25, -1.0
    out = repeat.compare_passes([a, b, c])
    assert out == {"passes": 3, "differ": [{"pass": 2, "first_step": 1, "max_abs_diff": 1.0}]}
    assert repeat.compare_passes([a, b])["differ"] == []
    marked = repeat.compare_passes([a, b, c], after_other=[False, False, True])
    assert marked["differ"] == [{"pass": 2, "first_step": 1, "max_abs_diff": 1.0, "after_other": True}]
    assert marked["after_other"] == [2]


def test_parse_variant():
    assert repeat.parse_variant("default") == ("default", {})
    assert repeat.parse_variant("moe_decode:GPTOSS_MAX_MOE_PATH=decode,GPTOSS_MAX_PDL=0") == (
        "moe_decode",
        {"GPTOSS_MAX_MOE_PATH": "decode", "GPTOSS_MAX_PDL": "0"},
    )
    # the planned call's variants (docs/GPU.md, "Greedy repeatability")
    assert repeat.parse_variant("attn_ours_poison:GPTOSS_MAX_ATTENTION=ours,GPTOSS_MAX_POISON=nan")[1] == {
        "GPTOSS_MAX_ATTENTION": "ours",
        "GPTOSS_MAX_POISON": "nan",
    }
    assert repeat.parse_variant("s:GPTOSS_MAX_ROUTE_ORDER=stable")[1] == {"GPTOSS_MAX_ROUTE_ORDER": "stable"}
    assert repeat.parse_variant("scrub:GPTOSS_MAX_ATTENTION=ours,GPTOSS_MAX_SCRUB=zero")[1] == {
        "GPTOSS_MAX_ATTENTION": "ours",
        "GPTOSS_MAX_SCRUB": "zero",
    }
    assert repeat.parse_variant("det:GPTOSS_MAX_DETERMINISTIC=on")[1] == {"GPTOSS_MAX_DETERMINISTIC": "on"}
    # MAX's debug switches: `+` for the comma of its list
    assert repeat.parse_variant("d:GPTOSS_MAX_ATTENTION=ours,MODULAR_DEBUG=device-sync-mode+assert-level=all")[1] == {
        "GPTOSS_MAX_ATTENTION": "ours",
        "MODULAR_DEBUG": "device-sync-mode,assert-level=all",
    }
    for bad in ["x:HOME=/", "x:GPTOSS_MAX_DENSE", ":GPTOSS_MAX_DENSE=max", "a/b"]:
        with pytest.raises(ValueError):
            repeat.parse_variant(bad)


def test_variants_run_with_their_settings_and_the_deadline_skips(tmp_path, monkeypatch):
    """Each variant's worker gets its settings in its environment; past the deadline a mode is skipped."""
    seen = []

    def fake_run(cmd, stdout, stderr, timeout, env):
        seen.append(({k: v for k, v in env.items() if k in repeat.VARIANT_SETTINGS}, timeout))
        save = cmd[cmd.index("--save") + 1]
        runs = [{"prompt": "A", "seed": 0, "tokens": [1]}, {"prompt": "B", "seed": 1, "tokens": [2]},
                {"prompt": "A", "seed": 2, "tokens": [1]}]  # fmt: skip
        Path(save).write_text(json.dumps({"graph_capture": False, "runs": runs,
                                          "logits": {"bitwise_equal": True, "max_abs_diff": 0.0}}))  # fmt: skip
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(repeat.subprocess, "run", fake_run)
    for k in repeat.VARIANT_SETTINGS:
        monkeypatch.delenv(k, raising=False)
    rc = repeat.main(["--device", "cpu", "--capture", "off", "--timeout", "50", "--out", str(tmp_path),
                      "--variant", "default", "--variant", "dense:GPTOSS_MAX_DENSE=max"])  # fmt: skip
    assert rc == 0
    assert seen == [({}, 50), ({"GPTOSS_MAX_DENSE": "max"}, 50)]
    (path,) = tmp_path.glob("repeat_cpu_*.json")
    result = json.loads(path.read_text())
    assert result["variants"]["dense"]["settings"] == {"GPTOSS_MAX_DENSE": "max"}
    assert result["variants"]["dense"]["modes"]["off"]["logits_repeatable"] is True
    assert (tmp_path / "dense" / "repeat_off.json").exists()

    rc = repeat.main(["--device", "cpu", "--capture", "off", "--deadline", "10", "--out", str(tmp_path / "late")])
    assert rc == 1, "a skipped mode is not a pass"
    (path,) = (tmp_path / "late").glob("repeat_cpu_*.json")
    assert "skipped" in json.loads(path.read_text())["variants"]["default"]["modes"]["off"]


def test_graph_capture_on_a_cpu_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        repeat.main(["--device", "cpu", "--capture", "on", "--out", str(tmp_path)])


@pytest.mark.slow
def test_greedy_decoding_repeats_on_the_cpu(tmp_path):
    """The CPU's float32 graph: every run of A equal, B between them included, logits bitwise equal.
    With GPTOSS_MAX_TAP on (kernels/tap.mojo), so the taps' hashes of the prompt's passes agree too."""
    rc = repeat.main(["--device", "cpu", "--model", "synthetic:tiny", "--capture", "off", "--repeats", "2",
                      "--tokens", "6", "--prompt-len", "40", "--forced-runs", "3", "--prefills", "3",
                      "--timeout", "1200", "--variant", "default:GPTOSS_MAX_TAP=on",
                      "--out", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("repeat_cpu_*.json")
    result = json.loads(path.read_text())
    mode = result["variants"]["default"]["modes"]["off"]
    assert rc == 0, mode.get("log_tail")
    assert [r["prompt"] for r in mode["runs"]] == ["A", "A", "B", "A"]
    assert all(len(r["tokens"]) == 6 for r in mode["runs"])
    assert mode["runs"][2]["tokens"] != mode["runs"][0]["tokens"], "another prompt, another answer"
    assert mode["repeatable"] is True and [d["after_b"] for d in mode["differences"]] == [False, True]
    assert mode["logits"]["bitwise_equal"] is True and mode["logits"]["max_abs_diff"] == 0.0
    assert len(mode["logits"]["top2_margin"]) == 6 and min(mode["logits"]["top2_margin"]) >= 0
    assert mode["logits"]["passes"] == 3 and mode["logits"]["differ"] == []
    assert mode["prefill"] == {"passes": 3, "differ": [], "after_other": [2]} and mode["logits_repeatable"] is True
    # five taps a layer (qkv, attention, moe input, router logits, moe output), every prompt pass the same
    taps = mode["taps"]
    assert taps["labels"] >= 10 and taps["labels"] % 5 == 0, taps
    assert taps["compared"] >= 4 and taps["first_differing"] == {}, taps
    assert all(p["first_tap"] is None for p in taps["passes"])


def test_taps_summary_finds_the_first_differing_tap():
    """A GPTOSS_MAX_TAP worker log: four taps per step; three passes of a 100-element prompt step
    (the third differs from tap 2 on), another prompt of that size, and one-token steps."""
    labels = "".join(
        f"gptoss_tap_label {t} {lab}\n" for t, lab in enumerate(["l0 qkv", "l0 attn", "moe in", "moe out"])
    )

    def step(n, hashes):
        return "".join(f"gptoss_tap {t} {n} {h}\n" for t, h in enumerate(hashes))

    log = (labels + "some warning\n" + step(100, [1, 2, 3, 4]) + step(10, [5, 6, 7, 8]) + step(100, [1, 2, 3, 4])
           + step(100, [9, 9, 9, 9]) + step(10, [5, 6, 7, 8]) + step(100, [1, 2, 30, 40]))  # fmt: skip
    got = repeat.taps_summary(log)
    assert got["steps"] == 6 and got["labels"] == 4 and got["compared"] == 3
    assert got["first_taps_by_size"] == {"10": 1, "100": 2}
    assert got["passes"] == [
        {"pass": 1, "first_tap": None, "label": None},
        {"pass": 2, "first_tap": 2, "label": "moe in"},
    ]
    assert got["first_differing"] == {"moe in": 1}
    assert repeat.taps_summary("no taps here")["steps"] == 0


def test_taps_summary_reads_steps_whose_taps_ran_out_of_order_and_weights():
    """A GPU graph may run independent taps in another order than they were built (router logits
    before the MoE input): steps end where a tag comes again, and are compared in tag order. With
    GPTOSS_MAX_TAP=weights, weight and bias taps are not activations: they do not group the steps,
    and `weights.changed` names any whose hash moved between steps."""
    names = ["weight 8x4", "bias 8", "l0 qkv", "moe in", "router logits", "weight 2x4"]
    labels = "".join(f"gptoss_tap_label {t} {lab}\n" for t, lab in enumerate(names))

    def step(n, hashes, order):  # hashes by tag, printed in `order`
        return "".join(f"gptoss_tap {t} {n} {hashes[t]}\n" for t in order)

    order = [1, 0, 2, 4, 3, 5]
    log = (labels + step(100, [7, 8, 1, 2, 3, 9], order) + step(10, [7, 8, 5, 6, 6, 9], order)
           + step(100, [7, 8, 1, 2, 30, 9], order) + step(100, [7, 8, 1, 2, 3, 99], order))  # fmt: skip
    got = repeat.taps_summary(log)
    assert got["steps"] == 4 and got["compared"] == 3
    assert got["first_taps_by_size"] == {"10": 1, "100": 1}
    assert got["passes"] == [
        {"pass": 1, "first_tap": 4, "label": "router logits"},
        {"pass": 2, "first_tap": 5, "label": "weight 2x4"},
    ]
    assert got["weights"] == {"tapped": 3, "changed": ["weight 2x4"]}
    assert "weights" not in repeat.taps_summary(labels.replace("weight", "w").replace("bias", "b"))
