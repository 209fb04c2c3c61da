#!/bin/bash
# Issue 4 on a GPU with MAX staged (docs/GPU.md): where the one-token MoE kernels
# (the lean gate_up and the one-token down, 120b, T = 1, PDL off) spend their time.
# Nsight Compute with the clocks left alone, two passes over the same bench run:
#  1. PmSampling, WarpStateStats and the stall ratios: active warps and throughput
#     over the kernel's time (is a quarter of it ramp and tail?), saved as a report
#     and as a raw CSV of every sampled value, its DRAM / L2 / issue series printed
#     by scripts/ncu_pm_series.py;
#  2. the full set with source counters, saved, then its SASS page as CSV and the
#     lines that collect the most stall samples (scripts/ncu_sass_hotspots.py).
# About 4 minutes. Usage: scripts/gpu_moe_profile.sh OUT_DIR
set -u
out=${1:?usage: scripts/gpu_moe_profile.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
scratch=$(mktemp -d)
bench=(python3 bench/moe.py --models 120b --tokens 1 --reps 2 --chain 2 --sets 2 --checks 1 --no-stock --out "$scratch")
ncu_run=(ncu --clock-control none --target-processes all -k "regex:gate_up|down" -s 2 -c 2)
rc=0
GPTOSS_MAX_PDL=0 timeout 200 "${ncu_run[@]}" --section PmSampling --section WarpStateStats --section Occupancy \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    -o "$out/moe_t1_pm" "${bench[@]}" > "$out/moe_t1_pm.log" 2>&1 || rc=$?
ncu -i "$out/moe_t1_pm.ncu-rep" --print-details all > "$out/moe_t1_pm.txt" 2>&1
ncu -i "$out/moe_t1_pm.ncu-rep" --page raw --csv --print-metric-instances values > "$out/moe_t1_pm_raw.csv" 2>&1
python3 scripts/ncu_pm_series.py "$out/moe_t1_pm_raw.csv" | tee "$out/moe_t1_pm_series.txt"
GPTOSS_MAX_PDL=0 timeout 240 "${ncu_run[@]}" --set full --import-source no \
    -o "$out/moe_t1_full" "${bench[@]}" > "$out/moe_t1_full.log" 2>&1 || rc=$?
ncu -i "$out/moe_t1_full.ncu-rep" --page source --csv --print-source sass > "$out/moe_t1_sass.csv" 2>&1
python3 scripts/ncu_sass_hotspots.py "$out/moe_t1_sass.csv" --top 30 | tee "$out/moe_t1_hotspots.txt"
rm -rf "$scratch"
exit "$rc"
