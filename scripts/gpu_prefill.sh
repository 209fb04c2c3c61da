#!/bin/bash
# Issue 5 on a GPU with MAX staged (docs/GPU.md): the prefill benchmark
# (correctness of every tile config vs float64, ours / MAX stock / dense bf16
# TFLOP/s, tile sweep, decode-kernel crossover), then the op's GPU tests
# (which take the prefill path wherever T * K / E >= 4 with bf16 activations).
# Fits one 8-minute call. Usage: scripts/gpu_prefill.sh OUT_DIR [bench options]
set -u
out=${1:?usage: scripts/gpu_prefill.sh OUT_DIR [bench options]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
rc=0
timeout 330 python3 bench/moe.py --prefill --out "$out" "$@" 2>&1 | tee "$out/moe_prefill.log"
r=${PIPESTATUS[0]}
[ "$r" -ne 0 ] && { echo "bench/moe.py --prefill: exit $r" >&2; rc=$r; }
(cd tests && timeout 130 python3 -m pytest -q -p no:cacheprovider test_moe_op.py -k "gpu and mxfp4") 2>&1 \
    | tee "$out/test_moe_op_gpu.log"
r=${PIPESTATUS[0]}
[ "$r" -ne 0 ] && { echo "test_moe_op.py (gpu): exit $r" >&2; rc=$r; }
exit "$rc"
