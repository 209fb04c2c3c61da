#!/bin/bash
# A/B of a kernel patch against the tree it applies to, in one device call (docs/GPU.md; MAX
# staged). With the patch applied: the MoE op's one-token GPU tests, then bench/moe.py at T = 1
# (120b and 20b), alternating patched and unpatched ROUNDS times (the compile cache makes every
# round after the first two quick). The tree is left as it was found.
# Usage: scripts/gpu_patch_ab.sh PATCH OUT_DIR [ROUNDS (3)] [TESTS (-k expression, "" to skip)]
# TOKENS (default 1) and CHECKS (default 1; 0 for an ablation whose values are wrong on purpose) in
# the environment are bench/moe.py's --tokens and --checks. BENCH, if set, replaces bench/moe.py's
# arguments (not --out) for a prefill A/B, e.g.
#   BENCH="--prefill --models 120b,20b --tokens 4096 --sweep-tokens=4096,8192,16384 --cross-tokens= \
#     --configs 10 --reps 5 --no-stock --deadline 150" BENCH_TIMEOUT=200 scripts/gpu_patch_ab.sh ...
# Each run's figures are printed from its JSON: decode rows (us per layer), prefill sweep (TFLOP/s),
# prefill crossover (ms per layer, the decode kernel's and each config's); at the end, the medians
# over the rounds (scripts/ab_summary.py, also $OUT_DIR/ab_summary.json).
set -u
patch_file=${1:?usage: scripts/gpu_patch_ab.sh PATCH OUT_DIR [ROUNDS] [TESTS]}
out=${2:?usage: scripts/gpu_patch_ab.sh PATCH OUT_DIR [ROUNDS] [TESTS]}
rounds=${3:-3}
tests=${4-gpu and (one_token or t64)}
cd "$(dirname "$0")/.." || exit 1
patch_file=$(realpath "$patch_file")
mkdir -p "$out"
patch -s -p1 --dry-run < "$patch_file" || { echo "the patch does not apply"; exit 1; }
patch -s --no-backup-if-mismatch -p1 < "$patch_file"
applied=1
trap '[ "$applied" = 1 ] && patch -s --no-backup-if-mismatch -R -p1 < "$patch_file"' EXIT
t0=$(date +%s)
rc=0
if [ -n "$tests" ]; then
  (cd tests && timeout 330 python3 -m pytest -q -p no:cacheprovider -s test_moe_op.py -k "$tests") > "$out/tests_patched.log" 2>&1 || rc=1
  echo "tests (patched): $(tail -1 "$out/tests_patched.log")  $(( $(date +%s) - t0 )) s"
fi
for r in $(seq 1 "$rounds"); do
  for side in patched main; do
    if [ "$side" = main ] && [ "$applied" = 1 ]; then patch -s --no-backup-if-mismatch -R -p1 < "$patch_file"; applied=0; fi
    if [ "$side" = patched ] && [ "$applied" = 0 ]; then patch -s --no-backup-if-mismatch -p1 < "$patch_file"; applied=1; fi
    # shellcheck disable=SC2086  # BENCH is a list of arguments
    timeout "${BENCH_TIMEOUT:-150}" python3 bench/moe.py ${BENCH:---models 120b,20b --tokens ${TOKENS:-1} --no-stock \
      --checks ${CHECKS:-1} --reps 12} --out "$out/${side}_$r" 2>&1 | grep -E "rror|FAIL"
    python3 scripts/ab_summary.py --round "$out/${side}_$r"
    echo "$side round $r: $(( $(date +%s) - t0 )) s"
  done
done
# medians over the rounds, patched against main (the decode kernel's rows of a prefill A/B: a control)
python3 scripts/ab_summary.py "$out" --json "$out/ab_summary.json"
exit "$rc"
