"""scripts/ab_summary.py: the medians of scripts/gpu_patch_ab.sh's rounds, patched against main."""

from __future__ import annotations

import json

from script_loader import load_script


def _cross(c7_ms: float, decode_ms: float) -> dict:
    return {
        "crossover": {
            "120b": {
                "points": [{"tokens": 64, "decode_ms": decode_ms, "prefill_ms_by_config": {"7": c7_ms, "5": None}}]
            }
        }
    }


def _write(root, side: str, r: int, name: str, d: dict) -> None:
    folder = root / f"{side}_{r}"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(d))


def test_medians_changes_and_paired_wins(tmp_path, capsys):
    ab = load_script("scripts/ab_summary.py", "ab_summary")
    # three rounds: patched c7 0.50 / 0.60 / 0.40 (median 0.50), main 0.70 / 0.50 / 0.80 (median 0.70)
    for r, (p, m) in enumerate([(0.50, 0.70), (0.60, 0.50), (0.40, 0.80)], start=1):
        _write(tmp_path, "patched", r, "moe_prefill_h200_20261201.json", _cross(p, 1.0))
        _write(tmp_path, "main", r, "moe_prefill_h200_20261201.json", _cross(m, 1.0 + 0.1 * r))
    # a decode JSON beside it in one round, and folders the script must skip
    _write(
        tmp_path,
        "patched",
        1,
        "moe_decode_h200_20261201.json",
        {"rows": [{"model": "20b", "tokens": 1, "ours_us": 30.0}]},
    )
    _write(
        tmp_path, "main", 1, "moe_decode_h200_20261201.json", {"rows": [{"model": "20b", "tokens": 1, "ours_us": 40.0}]}
    )
    (tmp_path / "tests_patched.log").write_text("38 passed")
    (tmp_path / "other_x").mkdir()

    rows = {(r["kind"], r["model"], r["tokens"], r["what"]): r for r in ab.summarize(ab.load(str(tmp_path)))}
    assert set(rows) == {("cross", "120b", 64, "c7"), ("cross", "120b", 64, "decode"), ("decode", "20b", 1, "ours")}
    c7 = rows[("cross", "120b", 64, "c7")]
    assert (c7["patched"], c7["main"]) == (0.50, 0.70)
    assert abs(c7["change"] - (0.50 / 0.70 - 1)) < 1e-12
    assert c7["rounds"] == 3 and c7["patched_better"] == 2  # lower is better; round 2 lost
    assert abs(c7["spread_patched"] - 0.5) < 1e-12  # 0.60 / 0.40 - 1
    dec = rows[("cross", "120b", 64, "decode")]
    assert dec["patched"] == 1.0 and abs(dec["main"] - 1.2) < 1e-12 and dec["patched_better"] == 3
    one = rows[("decode", "20b", 1, "ours")]
    assert one["rounds"] == 1 and one["unit"] == "us" and one["patched_better"] == 1

    # one round's print (gpu_patch_ab.sh, as each round ends): its points, then its checks
    lines = ab.round_lines(str(tmp_path / "patched_1"))
    assert any("decode" in ln and "T=1" in ln and "30.0000 us" in ln for ln in lines)
    assert any("c7" in ln and "0.5000 ms" in ln for ln in lines)
    assert sum(ln.startswith("  correctness:") for ln in lines) == 2  # one per JSON file

    out = tmp_path / "summary.json"
    assert ab.main([str(tmp_path), "--json", str(out)]) == 0
    assert "-28.6%" in capsys.readouterr().out  # c7: 0.50 against 0.70
    assert len(json.loads(out.read_text())) == 3


def test_sweep_rows_count_higher_as_better(tmp_path):
    ab = load_script("scripts/ab_summary.py", "ab_summary")
    for side, tf in (("patched", 430.0), ("main", 420.0)):
        _write(
            tmp_path,
            side,
            1,
            "moe_prefill_h200_20261201.json",
            {"sweep": [{"model": "120b", "tokens": 4096, "config": 10, "tflops": tf}]},
        )
    (row,) = ab.summarize(ab.load(str(tmp_path)))
    assert row["higher_is_better"] and row["patched_better"] == 1 and row["change"] > 0


def test_no_paired_points_is_an_error(tmp_path, capsys):
    ab = load_script("scripts/ab_summary.py", "ab_summary")
    _write(tmp_path, "patched", 1, "moe_prefill_h200_20261201.json", _cross(0.5, 1.0))
    assert ab.main([str(tmp_path)]) == 1
    assert "no paired points" in capsys.readouterr().err
