#!/bin/bash
# A kernel constant swept on the GPU in one call (docs/GPU.md; MAX staged): for each value, the
# one-token MoE GPU tests once (TESTS, a pytest -k expression; "" to skip), then bench/moe.py at
# T = 1 (120b, 20b) for every value in turn, ROUNDS times (alternating, so drift hits all alike).
# The constant is a line `comptime NAME = VALUE` in FILE; the file is restored at the end.
# Usage: scripts/gpu_const_sweep.sh FILE NAME "V1 V2 ..." OUT_DIR [ROUNDS (2)] [TESTS]
# e.g.   scripts/gpu_const_sweep.sh src/gptoss_max/kernels/moe_gpu.mojo LEAN_TPB "1 4 3" $OUT
set -u
file=${1:?usage: scripts/gpu_const_sweep.sh FILE NAME VALUES OUT_DIR [ROUNDS] [TESTS]}
name=${2:?}
values=${3:?}
out=${4:?}
rounds=${5:-2}
tests=${6-gpu and one_token}
cd "$(dirname "$0")/.." || exit 1
grep -q "^comptime $name = " "$file" || { echo "no line 'comptime $name = ...' in $file"; exit 1; }
mkdir -p "$out"
cp "$file" "$out/.orig"
trap 'cp "$out/.orig" "$file"; rm -f "$out/.orig"' EXIT
set_value() { sed -i "s/^comptime $name = .*/comptime $name = $1/" "$file"; }
t0=$(date +%s)
rc=0
if [ -n "$tests" ]; then
  for v in $values; do
    set_value "$v"
    (cd tests && timeout 300 python3 -m pytest -q -p no:cacheprovider -s test_moe_op.py -k "$tests") \
      > "$out/tests_${name}_$v.log" 2>&1 || rc=1
    echo "$name=$v tests: $(tail -1 "$out/tests_${name}_$v.log")  $(( $(date +%s) - t0 )) s"
  done
fi
for r in $(seq 1 "$rounds"); do
  for v in $values; do
    set_value "$v"
    timeout 200 python3 bench/moe.py --models 120b,20b --tokens 1 --no-stock --checks 1 --reps 12 \
      --out "$out/${name}_${v}_$r" 2>&1 | grep -E "^ *(120b|20b) |rror|FAIL" | sed "s/^/$name=$v r$r /"
  done
  echo "round $r: $(( $(date +%s) - t0 )) s"
done
exit "$rc"
