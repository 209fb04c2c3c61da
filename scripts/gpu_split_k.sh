#!/bin/bash
# Issue 4, "v23" in bench/NOTES.md: should the one-token MoE kernels split K across blocks?
# One device call. The probe parts need only CuPy and torch; the op parts need MAX staged
# (docs/GPU.md). Usage: scripts/gpu_split_k.sh OUT_DIR [probe|op|all]
#   probe: the v21 probe's bf16 kernel on mma.sync, K split across blocks, summed by atomics (--epi 0)
#          against the product's last-block sum with self-reset counters (1) and with a memset of
#          the counters before each launch (2);
#   op:    the one-token gate_up with H split across 2 or 3 blocks (GPTOSS_MAX_MOE_SPLIT) and
#          the one-token down as the few-token down_kernel (GPTOSS_MAX_DOWN_ONE=0), against main
#          (split 1, down 1), timed by bench/moe.py in one call, then the op's one-token GPU tests
#          with split 3 and down 0.
set -u
out=${1:?usage: scripts/gpu_split_k.sh OUT_DIR [probe|op|all]}
what=${2:-all}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD/src:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}
rc=0
if [ "$what" != op ]; then
  for e in 0 1 2; do
    timeout 90 python3 scripts/fp8_wgmma_probe.py --only bf16:3:2:4:1 --only bf16:6:2:4:1 \
      --only bf16:2:4:4:1 --mma --epi "$e" --out "$out/epi$e" 2>&1 | grep -E "matvec|rror"
    r=${PIPESTATUS[0]}
    [ "$r" -ne 0 ] && { echo "probe --epi $e: exit $r" >&2; rc=$r; }
  done
fi
if [ "$what" != probe ]; then
  # (split, down): main first and last, so drift shows
  for v in 1:1 3:1 2:1 1:0 3:0 2:0 1:1; do
    echo "GPTOSS_MAX_MOE_SPLIT=${v%:*} GPTOSS_MAX_DOWN_ONE=${v#*:}"
    GPTOSS_MAX_MOE_SPLIT=${v%:*} GPTOSS_MAX_DOWN_ONE=${v#*:} timeout 150 python3 bench/moe.py --models 120b,20b \
      --tokens 1 --no-stock --checks 1 --reps 12 --out "$out/split${v%:*}_down${v#*:}" 2>&1 | grep -E "^ *(120b|20b) |rror"
    r=${PIPESTATUS[0]}
    [ "$r" -ne 0 ] && { echo "bench/moe.py split ${v%:*} down ${v#*:}: exit $r" >&2; rc=$r; }
  done
  (cd tests && GPTOSS_MAX_MOE_SPLIT=3 GPTOSS_MAX_DOWN_ONE=0 timeout 240 python3 -m pytest -q -p no:cacheprovider \
    test_moe_op.py -k "gpu and (one_token or routed)") 2>&1 | tail -4 | tee "$out/test_moe_op_gpu_split3_down0.log"
  r=${PIPESTATUS[0]}
  [ "$r" -ne 0 ] && { echo "test_moe_op.py (gpu, split 3, down 0): exit $r" >&2; rc=$r; }
fi
exit "$rc"
