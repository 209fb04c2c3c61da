#!/bin/bash
# Kernel constants swept on the GPU in one call (docs/GPU.md; MAX staged): for each value, the
# one-token MoE GPU tests once (TESTS, a pytest -k expression; "" to skip), then bench/moe.py
# (120b, 20b) for every value in turn, ROUNDS times (alternating, so drift hits all alike).
# Each constant is a line `comptime NAME = VALUE` in FILE; the file is restored at the end.
# Several constants at once: NAME is a comma list and each value a comma list as long.
# TOKENS (default 1) and CHECKS (default 1) in the environment are bench/moe.py's --tokens, --checks.
# Usage: scripts/gpu_const_sweep.sh FILE NAME "V1 V2 ..." OUT_DIR [ROUNDS (2)] [TESTS]
# e.g.   scripts/gpu_const_sweep.sh src/gptoss_max/kernels/moe_gpu.mojo LEAN_TPB "1 4 3" $OUT
#        TOKENS=2,64 scripts/gpu_const_sweep.sh src/gptoss_max/kernels/moe_gpu.mojo \
#          DEPTH,MIN_WARPS_PER_SM_MANY "2,16 4,12" $OUT 2 ""
set -u
file=${1:?usage: scripts/gpu_const_sweep.sh FILE NAME VALUES OUT_DIR [ROUNDS] [TESTS]}
name=${2:?}
values=${3:?}
out=${4:?}
rounds=${5:-2}
tests=${6-gpu and one_token}
cd "$(dirname "$0")/.." || exit 1
IFS=, read -ra names <<< "$name"
for n in "${names[@]}"; do
  grep -q "^comptime $n = " "$file" || { echo "no line 'comptime $n = ...' in $file"; exit 1; }
done
mkdir -p "$out"
cp "$file" "$out/.orig"
trap 'cp "$out/.orig" "$file"; rm -f "$out/.orig"' EXIT
set_value() {
  local vals i
  IFS=, read -ra vals <<< "$1"
  [ "${#vals[@]}" = "${#names[@]}" ] || { echo "value '$1' does not match '$name'"; exit 1; }
  for i in "${!names[@]}"; do
    sed -i "s/^comptime ${names[$i]} = .*/comptime ${names[$i]} = ${vals[$i]}/" "$file"
  done
}
t0=$(date +%s)
rc=0
if [ -n "$tests" ]; then
  for v in $values; do
    set_value "$v"
    (cd tests && timeout 300 python3 -m pytest -q -p no:cacheprovider -s test_moe_op.py -k "$tests") \
      > "$out/tests_${name//,/-}_${v//,/-}.log" 2>&1 || rc=1
    echo "$name=$v tests: $(tail -1 "$out/tests_${name//,/-}_${v//,/-}.log")  $(( $(date +%s) - t0 )) s"
  done
fi
for r in $(seq 1 "$rounds"); do
  for v in $values; do
    set_value "$v"
    timeout 200 python3 bench/moe.py --models 120b,20b --tokens "${TOKENS:-1}" --no-stock --checks "${CHECKS:-1}" --reps 12 \
      --out "$out/${name//,/-}_${v//,/-}_$r" 2>&1 | grep -E "^ *(120b|20b) |rror|FAIL" | sed "s/^/$name=$v r$r /"
  done
  echo "round $r: $(( $(date +%s) - t0 )) s"
done
exit "$rc"
