#!/bin/bash
# Issue 4 on a GPU with MAX staged (docs/GPU.md): where the MoE kernels of one step spend
# their time; by default the one-token ones (the lean gate_up and the one-token down, 120b,
# T = 1, PDL off). Nsight Compute with the clocks left alone, two passes over the same bench run:
#  1. PmSampling, WarpStateStats and the stall ratios: active warps and throughput
#     over the kernel's time (is a quarter of it ramp and tail?), saved as a report
#     and as a raw CSV of every sampled value, its DRAM / L2 / issue series printed
#     by scripts/ncu_pm_series.py;
#  2. the full set with source counters, saved, then its SASS page as CSV and the
#     lines that collect the most stall samples (scripts/ncu_sass_hotspots.py).
# About 4 minutes. Usage: scripts/gpu_moe_profile.sh OUT_DIR
# Environment: MODEL (120b | 20b, default 120b), TOKENS (default 1), KERNELS (ncu's kernel-name
# regex over names as Mojo mangles them, the module and a hash: default "gate_up|down";
# "moe_prefill_gpu" with COUNT=7 for a whole MoE call of the prefill path that larger steps run),
# COUNT (kernels profiled, default 2). Files are named moe_t<TOKENS>_<MODEL>_*, except at the
# defaults: moe_t1_*, as before.
set -u
out=${1:?usage: scripts/gpu_moe_profile.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
scratch=$(mktemp -d)
model=${MODEL:-120b}
tokens=${TOKENS:-1}
tag=moe_t$tokens
[ "$model/$tokens" = 120b/1 ] || tag=moe_t${tokens}_$model
bench=(python3 bench/moe.py --models "$model" --tokens "$tokens" --reps 2 --chain 2 --sets 2 --checks 1 --no-stock --out "$scratch")
ncu_run=(ncu --clock-control none --target-processes all -k "regex:${KERNELS:-gate_up|down}" -s 2 -c "${COUNT:-2}")
rc=0
GPTOSS_MAX_PDL=0 timeout 200 "${ncu_run[@]}" --section PmSampling --section WarpStateStats --section Occupancy \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    -o "$out/${tag}_pm" "${bench[@]}" > "$out/${tag}_pm.log" 2>&1 || rc=$?
ncu -i "$out/${tag}_pm.ncu-rep" --print-details all > "$out/${tag}_pm.txt" 2>&1
ncu -i "$out/${tag}_pm.ncu-rep" --page raw --csv --print-metric-instances values > "$out/${tag}_pm_raw.csv" 2>&1
python3 scripts/ncu_pm_series.py "$out/${tag}_pm_raw.csv" | tee "$out/${tag}_pm_series.txt"
GPTOSS_MAX_PDL=0 timeout 240 "${ncu_run[@]}" --set full --import-source no \
    -o "$out/${tag}_full" "${bench[@]}" > "$out/${tag}_full.log" 2>&1 || rc=$?
ncu -i "$out/${tag}_full.ncu-rep" --page source --csv --print-source sass > "$out/${tag}_sass.csv" 2>&1
python3 scripts/ncu_sass_hotspots.py "$out/${tag}_sass.csv" --top 30 --segments | tee "$out/${tag}_hotspots.txt"
rm -rf "$scratch"
exit "$rc"
