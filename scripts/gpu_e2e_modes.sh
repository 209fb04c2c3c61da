#!/bin/bash
# Why do 20b batch-1 e2e runs on the H200 sit at ~1.66 or ~2.14 ms a step, whichever the tree?
# (bench/NOTES.md, "Twelfth session"). One device call (docs/GPU.md; MAX staged for the e2e part):
#   1. scripts/pdl_prewait_probe.py --soak: a MAX-free chain of stand-in kernels replayed back to
#      back with the GPU's clocks sampled; bimodal replay times there put the cause below MAX;
#   2. bench/e2e.py, 20b batch 1 with graphs, RUNS times while the call's time allows (the first
#      compiles, ~4 min; later ones reuse the cache), alternating Python's collector as is and
#      `--gc freeze` (every slow run so far had a generation-1 collection in its timed batch, every
#      fast one none), each printing its collections, quarters' median step and CPU time, and the
#      GPU's clocks and throttle reasons before and after.
# Usage: scripts/gpu_e2e_modes.sh OUT_DIR [RUNS (4)] [OUTPUT_LEN (1024)] [BUDGET_S (560)]
set -u
out=${1:?usage: scripts/gpu_e2e_modes.sh OUT_DIR [RUNS] [OUTPUT_LEN] [BUDGET_S]}
runs=${2:-4}
output_len=${3:-1024}
budget=${4:-560}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out"
t0=$(date +%s)
export PATH="$PATH:/usr/local/cuda/bin"
if command -v nvcc > /dev/null; then
  PYTHONPATH="$PWD/src:${PYTHONPATH:-}" timeout 120 python3 scripts/pdl_prewait_probe.py --out "$out" --soak 30000 2>&1 | tail -3
else
  echo "no nvcc: the soak probe skipped"
fi
echo "soak: $(( $(date +%s) - t0 )) s"
for r in $(seq 1 "$runs"); do
  left=$(( budget - ($(date +%s) - t0) ))
  # the first run compiles (~250 s); later ones need ~90 s
  need=$([ "$r" = 1 ] && echo 270 || echo 100)
  if [ "$left" -lt "$need" ]; then echo "run $r: ${left} s left, stopping"; break; fi
  gc_flag=$([ $((r % 2)) = 1 ] && echo default || echo freeze)
  timeout "$left" python3 bench/e2e.py --model synthetic:20b --batch 1 --stock off --graph-capture on \
    --output-len "$output_len" --gc "$gc_flag" --out "$out/e2e_$r" > "$out/e2e_$r.log" 2>&1
  echo "run $r (--gc $gc_flag) rc=$? at $(( $(date +%s) - t0 )) s"
  python3 - "$out/e2e_$r" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/e2e_*.json"):
    d = json.load(open(f))
    for name, run in d["runs"].items():
        for w, res in run["workers"].items():
            for b in res.get("batches", []):
                print(f"  {w}: gc {b.get('gc_collections')}; tok/s {b['decode_tok_s']:.1f}; step p50 {b['tpot_p50_ms']:.3f} ms, quarters "
                      f"{b.get('tpot_quarters_ms')}; CPU quarters {b.get('cpu_quarters_ms')}, thread "
                      f"{b.get('thread_cpu_quarters_ms')}")
                print(f"  gpu {b.get('gpu_state')}\n  host {b.get('host_state')}")
PY
done
python3 scripts/e2e_modes.py "$out"
echo "all: $(( $(date +%s) - t0 )) s"
