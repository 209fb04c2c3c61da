#!/bin/bash
# Which replayed small graph breaks serving? With `serve --replay-small-graphs` the server's GPU suite
# crashed its worker on an H200 (bench/NOTES.md, "Fifteenth session": a device assert, "Gather index
# out of bounds", one token's row). This runs that suite once per case, while the time allows:
#   check:all                          every graph replayed, each replay compared with an eager call
#                                      (mismatches logged: which graph, its input shapes, both results);
#   on:sampler,sampler_bitmask         the samplers only (passes if the scatter is the cause);
#   on:realize_future_token            the scatter only.
# and keeps, per case, the suite's summary and the server log's notes (device asserts counted).
# Usage: scripts/gpu_replay_diag.sh OUT_DIR [BUDGET_S (560)]; CASES="MODE:GRAPHS ..." (GRAPHS: all or
# GPTOSS_MAX_REPLAY_GRAPHS's values) in the environment replaces the three above. After staging MAX
# (docs/GPU.md); a cold first case takes ~230 s, later ones ~90-120 s.
set -u
out=${1:?usage: scripts/gpu_replay_diag.sh OUT_DIR [BUDGET_S]}
budget=${2:-560}
read -r -a cases <<< "${CASES:-check:all on:sampler,sampler_bitmask on:realize_future_token}"
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
for c in "${cases[@]}"; do
  mode=${c%%:*}
  graphs=${c#*:}
  left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt 100 ]; then echo "$c: ${left} s left, stopping"; break; fi
  name="${mode}_${graphs//,/+}"
  tmp=$(mktemp -d)
  (cd tests && env GPTOSS_MAX_REPLAY_GRAPHS="$graphs" GPTOSS_MAX_TEST_SERVE_MODEL=synthetic:20b GPTOSS_MAX_TEST_SERVE_DEVICES=gpu \
    GPTOSS_MAX_TEST_SERVE_ARGS="--graph-capture --replay-small-graphs $mode" timeout "$left" \
    python3 -m pytest -q -p no:cacheprovider --basetemp "$tmp/bt" test_server_e2e.py > "$tmp/suite.log" 2>&1)
  echo "$c: rc=$? at $(( $(date +%s) - t0 )) s"
  sed -n '/short test summary info/,$p' "$tmp/suite.log" > "$out/suite_$name.log"
  [ -s "$out/suite_$name.log" ] || tail -n 60 "$tmp/suite.log" > "$out/suite_$name.log"
  tail -n 30 "$out/suite_$name.log"
  log="$tmp/bt/e2e0/server.log"  # pytest empties its basetemp, so the suite log sits beside it
  {
    echo "# $c: the server's log, device asserts counted, not repeated"
    asserts=$(grep -c 'index out of bounds' "$log" 2>/dev/null)
    echo "device asserts: ${asserts:-0}"
    grep -v "index out of bounds" "$log" 2>/dev/null | grep -E "replay|differs|ERROR|Error|Traceback" | head -n 60
    echo "# the last lines"
    grep -v "index out of bounds" "$log" 2>/dev/null | tail -n 40
  } > "$out/server_$name.txt"
  sed -n 2,20p "$out/server_$name.txt"
  rm -rf "$tmp"
done
echo "all: $(( $(date +%s) - t0 )) s"
