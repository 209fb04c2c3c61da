"""scripts/ncu_pm_series.py reads a kernel's PM-sampling series out of ncu's raw CSV page, cut to
the samples where the kernel ran."""

from __future__ import annotations

from script_loader import load_script

HDR = (
    '"ID","Kernel Name","FBSP.TriageCompute.dramc__throughput.avg.pct_of_peak_sustained_elapsed",'
    '"FE_B.TriageCompute.gr__ctas_launched_realtime.sum","TPC.TriageCompute.sm__cycles_active.avg","dram__bytes.sum"'
)
UNITS = '"","","%","","cycle","byte"'
# before the kernel: idle samples; the kernel launches its blocks at sample 2 and runs to sample 5
ROW_A = ",".join(
    [
        '"0","gate_up","(0.00; 0.01; 17.5; 63; 8.6; 1,071.5; 0; 0)"',
        '"1,440 (0; 0; 1,440; 0; 0; 0; 0; 0)"',
        '"27,259 (0; 0; 2,471; 2,924; 2,615; 864; 0; 0)","36,000,000"',
    ]
)
ROW_B = '"1","down","(0; 11.9; 29.4; 0)","(0; 160; 0; 0)","(0; 2,636; 2,937; 0)","17,000,000"'


def test_series_cut_to_the_kernels_samples(capsys, tmp_path):
    mod = load_script("scripts/ncu_pm_series.py", "ncu_pm_series")
    found = mod.series("\n".join(["==PROF== noise", HDR, UNITS, ROW_A, ROW_B]))
    assert list(found) == ["gate_up", "down"]
    gate = found["gate_up"]
    assert gate["dram %"] == [17.5, 63.0, 8.6, 1071.5]  # thousands separators read, idle ends cut
    assert gate["ctas"][0] == 1440.0 and len(gate["sm cyc"]) == 4
    assert found["down"]["dram %"] == [11.9, 29.4]
    assert "l2 %" not in gate  # a series the report lacks is left out, not invented
    f = tmp_path / "raw.csv"
    f.write_text("\n".join([HDR, UNITS, ROW_A]))
    assert mod.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "DRAM busy 11.61 of 4 samples" in out
    empty = tmp_path / "none.csv"
    empty.write_text('"ID","Kernel Name","dram__bytes.sum"\n"0","k","5"\n')
    assert mod.main([str(empty)]) == 1
