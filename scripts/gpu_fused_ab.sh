#!/bin/bash
# v27 on the GPU in one call (docs/GPU.md; MAX staged): the fused one-token MoE's GPU tests, then
# bench/moe.py at T = 1 with the two-kernel path and with --fused, alternating ROUNDS times (the
# compile cache makes every round after the first quick). Then, if nvcc is there,
# scripts/pdl_prewait_probe.py (does a load before griddepcontrol.wait cost time in graph replay?).
# Usage: scripts/gpu_fused_ab.sh OUT_DIR [ROUNDS (2)]
set -u
out=${1:?usage: scripts/gpu_fused_ab.sh OUT_DIR [ROUNDS]}
rounds=${2:-2}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out"
t0=$(date +%s)
rc=0
(cd tests && timeout 300 python3 -m pytest -q -p no:cacheprovider -s test_moe_op.py -k "gpu and (fused or one_token)") \
  > "$out/tests_fused.log" 2>&1 || rc=1
echo "tests: $(tail -1 "$out/tests_fused.log")  $(( $(date +%s) - t0 )) s"
for r in $(seq 1 "$rounds"); do
  for side in two fused; do
    flag=()
    [ "$side" = fused ] && flag=(--fused)
    timeout 200 python3 bench/moe.py --models 120b,20b --tokens 1 --no-stock --checks 2 --reps 12 "${flag[@]}" \
      --out "$out/${side}_$r" 2>&1 | grep -E "^ *(120b|20b) |rror|FAIL"
    echo "$side round $r: $(( $(date +%s) - t0 )) s"
  done
done
export PATH="$PATH:/usr/local/cuda/bin"
if command -v nvcc > /dev/null; then
  timeout 120 python3 scripts/pdl_prewait_probe.py --out "$out" --runs 3 > "$out/pdl_prewait_probe.log" 2>&1
  tail -30 "$out/pdl_prewait_probe.log"
else
  echo "no nvcc: pdl_prewait_probe skipped"
fi
echo "all: $(( $(date +%s) - t0 )) s"
exit "$rc"
