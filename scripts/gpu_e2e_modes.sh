#!/bin/bash
# Why do 20b batch-1 e2e steps on the H200 sit at ~1.63 ms or, in stretches of a few to ~1,000
# steps, at ~2.1 ms? (bench/NOTES.md, "Twelfth session" and "Thirteenth session"). One device call
# (docs/GPU.md; MAX staged for the e2e part):
#   1. scripts/pdl_prewait_probe.py --soak: a MAX-free chain of stand-in kernels replayed back to
#      back with the GPU's clocks sampled; bimodal replay times there put the cause below MAX
#      (2026-11-30: none in 30,000 replays);
#   2. bench/e2e.py, 20b batch 1 with graphs, RUNS times while the call's time allows (the first
#      compiles, ~4 min; later ones reuse the cache), cycling Python's collector through GC_MODES
#      (`--gc`; "default freeze" alternates, as on 2026-11-30, when freezing made no difference),
#      each printing its collections, quarters' median step, CPU time and wait for the GPU per
#      step, and the GPU's clocks and throttle reasons before and after;
#   3. scripts/e2e_modes.py over them: the slow stretches, and whether the host's own work or
#      its wait for the GPU grew through them.
# Usage: scripts/gpu_e2e_modes.sh OUT_DIR [RUNS (4)] [OUTPUT_LEN (1024)] [BUDGET_S (560)] [GC_MODES ("default")]
#        MODEL=synthetic:20b,layers=6 (default synthetic:20b), SOAK=0 (skips the probe) and E2E_ARGS (more
#        bench/e2e.py flags for every run, e.g. "--replay-small-graphs on") and VARIANTS (flag sets cycled
#        run by run, "|" between them, e.g. "|--replay-small-graphs on" alternates off and on) in the environment.
# With 6 of 24 layers the GPU's part of a step shrinks to ~0.7 ms, so the step shows the host's own
# floor per step (MAX's overlap pipeline and ours): what no kernel change can go under.
set -u
out=${1:?usage: scripts/gpu_e2e_modes.sh OUT_DIR [RUNS] [OUTPUT_LEN] [BUDGET_S] [GC_MODES]}
runs=${2:-4}
output_len=${3:-1024}
budget=${4:-560}
read -r -a gc_modes <<< "${5:-default}"
read -r -a e2e_args <<< "${E2E_ARGS:-}"
IFS='|' read -r -a variants <<< "${VARIANTS:-}"
[ "${#variants[@]}" = 0 ] && variants=("")
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out"
t0=$(date +%s)
export PATH="$PATH:/usr/local/cuda/bin"
model=${MODEL:-synthetic:20b}
if [ "${SOAK:-1}" = 0 ]; then
  echo "soak probe skipped (SOAK=0)"
elif command -v nvcc > /dev/null; then
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
  gc_flag=${gc_modes[$(( (r - 1) % ${#gc_modes[@]} ))]}
  variant=${variants[$(( (r - 1) % ${#variants[@]} ))]}
  read -r -a variant_args <<< "$variant"
  timeout "$left" python3 bench/e2e.py --model "$model" --batch 1 --stock off --graph-capture on \
    --output-len "$output_len" --gc "$gc_flag" --keep-logs "${e2e_args[@]}" "${variant_args[@]}" --out "$out/e2e_$r" > "$out/e2e_$r.log" 2>&1
  echo "run $r (--gc $gc_flag ${variant}) rc=$? at $(( $(date +%s) - t0 )) s"
  python3 - "$out/e2e_$r" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/e2e_*.json"):
    d = json.load(open(f))
    for name, run in d["runs"].items():
        for w, res in run["workers"].items():
            for b in res.get("batches", []):
                print(f"  {w}: gc {b.get('gc_collections')}; tok/s {b['decode_tok_s']:.1f}; step p50 {b['tpot_p50_ms']:.3f} ms, quarters "
                      f"{b.get('tpot_quarters_ms')}; CPU quarters {b.get('cpu_quarters_ms')}, thread "
                      f"{b.get('thread_cpu_quarters_ms')}; waiting for the GPU {b.get('sync_wait_quarters_ms')}")
                print(f"  gpu {b.get('gpu_state')}\n  host {b.get('host_state')}")
                print(f"  threads {b.get('busiest_threads')}; isolated {b.get('isolated_main_thread')}; "
                      f"replayed {b.get('replayed')}")
PY
done
python3 scripts/e2e_modes.py "$out"
echo "all: $(( $(date +%s) - t0 )) s"
