"""scripts/ncu_sass_hotspots.py ranks SASS lines by stall samples from ncu's source-page CSV,
reading the column names it is given (they move between ncu versions)."""

from __future__ import annotations

from script_loader import load_script

ALL = '"Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"'
CSV = f"""==PROF== Connected to process 1
"Kernel Name","Address","Source",{ALL},"stall_long_sb","stall_wait"
"gate_up","0x10","LDG.E.128 R4, [R2.64]","120","110","100","0"
"gate_up","0x20","HMMA.16816.F32.BF16 R8, R4, R6, RZ","30","20","0","15"
"gate_up","0x30","NOP","0","0","0","0"
"down","0x10","LDS.128 R4, [R2]","8","8","0","0","9"
"""


def test_ranks_lines_per_kernel_by_all_samples():
    mod = load_script("scripts/ncu_sass_hotspots.py", "ncu_sass_hotspots")
    fields, found = mod.hotspots(CSV, top=5)
    assert "stall_long_sb" in fields
    gate = found["gate_up"]
    assert [i["address"] for i in gate] == ["0x10", "0x20"]  # the unsampled NOP is left out
    # the Not-issued sample total is not a stall reason
    assert gate[0]["share"] == 0.8 and gate[0]["stalls"] == {"stall_long_sb": 100.0}
    assert gate[1]["stalls"]["stall_wait"] == 15.0
    # a row with a cell past the header (ncu has written such rows) is read, the extra cell dropped
    assert found["down"][0]["source"].startswith("LDS.128") and None not in fields


def test_falls_back_to_any_sample_column_and_reports_none(capsys, tmp_path):
    mod = load_script("scripts/ncu_sass_hotspots.py", "ncu_sass_hotspots")
    assert mod.sample_column(["Address", "Sampling Data (All)"]) == "Sampling Data (All)"
    assert mod.sample_column(["Address", "Samples"]) == "Samples"
    assert mod.sample_column(["Address", "Source"]) is None
    empty = tmp_path / "none.csv"
    empty.write_text('"Address","Source"\n"0x10","NOP"\n')
    assert mod.main([str(empty)]) == 1
    full = tmp_path / "sass.csv"
    full.write_text(CSV)
    assert mod.main([str(full), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "80.0%" in out and "0x20" not in out


# ncu 2025's layout: a `"Kernel Name","<name>",` line before each kernel's own table, reason
# columns twinned by "(Not Issued)" ones
HEADER = f'"Address","Source",{ALL},"# Samples","stall_long_sb","stall_long_sb (Not Issued)"'
SECTIONED = f""""Kernel Name","gate_up",
{HEADER}
"0x10","SHF.L.W.U32.HI R28, R20, 0x16, R20","277","270","277","275","270"
"0x20","EXIT","0","0","0","0","0"
"Kernel Name","down",
{HEADER}
"0x10","LDS.128 R4, [R2]","9","9","9","9","9"
"""


def test_reads_one_table_per_kernel():
    mod = load_script("scripts/ncu_sass_hotspots.py", "ncu_sass_hotspots")
    fields, found = mod.hotspots(SECTIONED, top=5)
    assert "Kernel Name" not in fields and "stall_long_sb" in fields
    assert list(found) == ["gate_up", "down"]
    assert [i["address"] for i in found["gate_up"]] == ["0x10"]
    assert found["gate_up"][0]["stalls"] == {"stall_long_sb": 275.0}  # not its "(Not Issued)" twin
    assert found["down"][0]["samples"] == 9.0


def test_splits_instructions_and_samples_at_the_loops():
    mod = load_script("scripts/ncu_sass_hotspots.py", "ncu_sass_hotspots")
    header = f'"Address","Source",{ALL},"Instructions Executed"'
    # 4 warps: the entry line runs once per warp, the loop line 10 times, the exit once
    text = f""""Kernel Name","k",
{header}
"0x10","LDC R1, c[0x0][0x28]","2","2","4"
"0x20","HMMA.16816.F32.BF16 R8, R4, R6, RZ","6","5","40"
"0x30","EXIT","2","2","4"
"""
    got = mod.loop_split(text)["k"]
    assert got == {
        "warps": 4.0,
        "instructions": 48.0,
        "outside_instructions": 8.0,
        "samples": 10.0,
        "outside_samples": 4.0,
    }
    assert mod.loop_split(CSV) == {}  # no "Instructions Executed" column: nothing to split


def test_cuts_each_kernel_into_runs_of_one_execution_count(capsys, tmp_path):
    mod = load_script("scripts/ncu_sass_hotspots.py", "ncu_sass_hotspots")
    header = f'"Address","Source",{ALL},"Instructions Executed"'
    # 4 warps: a prologue run once per warp (2 lines), a loop of 3 lines run 10 times, an
    # unexecuted branch target, an epilogue line; ncu profiled the kernel twice
    table = f"""{header}
"0x10","LDC R1, c[0x0][0x28]","2","2","4"
"0x20","@!P0 LDG.E R2, desc[UR4][R2.64]","6","6","4"
"0x30","LOP3.LUT R5, R2, 0xf, RZ, 0xc0, !PT","10","9","40"
"0x40","HMUL2.BF16_V2 R6, R5, R7","10","9","40"
"0x50","LOP3.LUT R8, R2, 0xf0, RZ, 0xc0, !PT","20","19","40"
"0x60","CALL.REL.NOINC 0x100","0","0","0"
"0x70","EXIT","2","2","4"
"""
    text = f'"Kernel Name","k",\n{table}"Kernel Name","k",\n{table}'
    runs = mod.segments(text, min_lines=1)
    assert list(runs) == ["k", "k #2"]  # one entry per profiled launch, not summed
    got = [(r["first"], r["lines"], r["count"]) for r in runs["k"]]
    assert got == [(0, 2, 4.0), (2, 3, 40.0), (6, 1, 4.0)]  # the unexecuted line splits the prologue
    loop = runs["k"][1]
    assert loop["instructions_share"] == 120 / 132 and loop["samples_share"] == 40 / 50
    assert loop["opcodes"] == [("LOP3", 2), ("HMUL2", 1)]  # by line, modifiers and predicates dropped
    # with the default min_lines, short runs stay only when they hold >= 2 % of the samples
    assert [r["first"] for r in mod.segments(text)["k"]] == [0, 2, 6]
    mix = dict((op, (a, b)) for op, a, b in mod.opcode_mix(text)["k"])
    assert mix["LOP3"] == (80 / 132, 30 / 50) and mix["LDG"] == (4 / 132, 6 / 50)
    assert mod.segments(CSV) == {} and mod.opcode_mix(CSV) == {}  # no "Instructions Executed" column
    f = tmp_path / "sass.csv"
    f.write_text(text)
    assert mod.main([str(f), "--top", "1", "--segments"]) == 0
    out = capsys.readouterr().out
    assert "runs of equal execution count" in out and "LOP3 60.6% 60.0%" in out
