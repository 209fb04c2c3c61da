#!/usr/bin/env bash
# One command for a fresh GPU pod (Runpod or any Linux box with an NVIDIA GPU): checks the driver
# and the GPU, installs into .venv, turns on fast Hugging Face downloads, starts the server in the
# background (`make up`) and prints its endpoints. Safe to run again: nothing done is redone, and
# a running server is left as it is.
#
#   scripts/runpod_up.sh            check, install, start
#   scripts/runpod_up.sh --check    check and print the plan only: installs and starts nothing
#
# Environment: MODEL (auto), DEVICES (auto), PORT (8000), HOST (0.0.0.0), API_KEY, HF_TOKEN,
# HF_HOME, REQUIRE_GPU (1; 0 goes on without a GPU, with the tiny model on CPU: CI, dry runs),
# MIN_DRIVER (550: an older NVIDIA driver is warned about), FAST_DOWNLOADS (1).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-auto}
DEVICES=${DEVICES:-auto}
PORT=${PORT:-8000}
HOST=${HOST:-0.0.0.0}
API_KEY=${API_KEY:-${GPTOSS_MAX_API_KEY:-}}
REQUIRE_GPU=${REQUIRE_GPU:-1}
MIN_DRIVER=${MIN_DRIVER:-550}
FAST_DOWNLOADS=${FAST_DOWNLOADS:-1}
VENV=${VENV:-.venv}
CHECK_ONLY=0
FAILED=0
ON_GPU=0
GPU_MIB=0

case ${1:-} in
  --check) CHECK_ONLY=1 ;;
  "") ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac

say() { printf '%s\n' "$*"; }
ok() { printf '  ok    %s\n' "$*"; }
warn() { printf '  warn  %s\n' "$*"; }
fail() {
  printf '  FAIL  %s\n' "$*"
  FAILED=1
}

can_apt() { [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; }

APT_UPDATED=0
apt_install() {
  if ((CHECK_ONLY)) || ! can_apt; then return 1; fi
  if ((!APT_UPDATED)); then
    apt-get update -qq && APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

check_tools() {
  local tool pkg
  for tool in make curl ps; do
    pkg=$tool
    [[ $tool == ps ]] && pkg=procps
    if command -v "$tool" >/dev/null; then
      ok "$tool"
    elif apt_install "$pkg"; then
      ok "$tool (installed $pkg)"
    else
      fail "$tool is missing (apt-get install $pkg)"
    fi
  done
}

# The first Python >= 3.10 that can make a virtualenv (MAX 26.7 wheels need >= 3.10).
pick_python() {
  local c ver
  for c in ${PY:-} python3.12 python3.11 python3.10 python3; do
    command -v "$c" >/dev/null || continue
    "$c" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || continue
    ver=$("$c" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if ! "$c" -c 'import ensurepip, venv' 2>/dev/null; then
      if ! apt_install "python$ver-venv" && ! apt_install python3-venv; then
        [[ -x $VENV/bin/python ]] || {
          warn "$c ($ver) cannot make a virtualenv (apt-get install python$ver-venv)"
          continue
        }
      fi
    fi
    PY=$c
    ok "Python $ver ($(command -v "$c"))"
    return 0
  done
  fail "no Python >= 3.10 with venv found (apt-get install python3.12 python3.12-venv)"
}

no_gpu() {
  if [[ $REQUIRE_GPU == 1 ]]; then
    fail "$1 (REQUIRE_GPU=0 goes on without one, serving the tiny random model on CPU)"
  else
    warn "$1: going on without a GPU (REQUIRE_GPU=0): the tiny random model on CPU"
  fi
}

check_gpu() {
  local rows idx name mem driver major
  if ! command -v nvidia-smi >/dev/null; then
    no_gpu "nvidia-smi not found: no NVIDIA driver is visible here"
    return 0
  fi
  if ! rows=$(nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits 2>&1); then
    no_gpu "nvidia-smi failed: $(head -n 1 <<<"$rows")"
    return 0
  fi
  if [[ -z $rows ]]; then
    no_gpu "nvidia-smi lists no GPU"
    return 0
  fi
  while IFS=, read -r idx name mem driver; do
    idx=${idx// /} mem=${mem// /} driver=${driver// /}
    name=${name# }
    ok "GPU $idx: $name, $mem MiB, driver $driver"
    ON_GPU=1
    if ((GPU_MIB == 0 || mem < GPU_MIB)); then GPU_MIB=$mem; fi
    major=${driver%%.*}
  done <<<"$rows"
  if [[ $major =~ ^[0-9]+$ ]] && ((major < MIN_DRIVER)); then
    warn "NVIDIA driver $major is older than $MIN_DRIVER: MAX may not run; pick a pod image with a newer driver"
  fi
}

resolve_model() {
  if [[ $MODEL != auto ]]; then
    RESOLVED=$MODEL
  elif ((ON_GPU)); then
    RESOLVED="openai/gpt-oss-20b"
  else
    RESOLVED="a tiny random gpt-oss (built under the data dir; not a real model)"
  fi
  ok "MODEL=$MODEL -> $RESOLVED; DEVICES=$DEVICES"
  local need=0
  case $RESOLVED in
    *120b*) need=80000 ;;
    *20b*) need=16000 ;;
  esac
  if ((ON_GPU && need && GPU_MIB < need)); then
    warn "$RESOLVED wants a GPU with ~$((need / 1000)) GB or more (weights and KV cache); the smallest here has $GPU_MIB MiB"
  fi
  if ((!ON_GPU)) && [[ $MODEL != auto ]]; then
    warn "MODEL=$MODEL without a GPU: only tiny checkpoints are practical on CPU"
  fi
}

# Weights and compiled graphs on the pod's volume (/workspace on Runpod) survive a restart.
choose_caches() {
  if [[ -z ${XDG_CACHE_HOME:-} && -d /workspace && -w /workspace ]]; then
    export XDG_CACHE_HOME=/workspace/.cache
    export GPTOSS_MAX_DATA=${GPTOSS_MAX_DATA:-/workspace/.local/share/gptoss-max}
  fi
  local hf=${HF_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/huggingface} free_gb dir
  dir=$hf
  while [[ ! -d $dir ]]; do dir=$(dirname "$dir"); done
  free_gb=$(($(df -Pk "$dir" | awk 'NR == 2 {print $4}') / 1048576))
  ok "Hugging Face cache: $hf ($free_gb GB free)"
  if ((ON_GPU && free_gb < 40)); then
    warn "less than 40 GB free for the cache: the 20b needs ~14 GB of weights plus ~10 GB of packages"
  fi
  if [[ -n ${HF_TOKEN:-} ]]; then
    ok "HF_TOKEN is set: downloads are authenticated"
  elif [[ -n ${HUGGING_FACE_HUB_TOKEN:-} ]]; then
    export HF_TOKEN=$HUGGING_FACE_HUB_TOKEN
    ok "HF_TOKEN taken from HUGGING_FACE_HUB_TOKEN"
  else
    ok "HF_TOKEN not set: anonymous downloads (gpt-oss is public; a token raises rate limits)"
  fi
}

# huggingface_hub < 1.0 downloads through hf_transfer when asked; >= 1.0 no longer uses it and
# warns about HF_HUB_ENABLE_HF_TRANSFER, its fast path being hf_xet (HF_XET_HIGH_PERFORMANCE).
fast_downloads() {
  if [[ $FAST_DOWNLOADS != 1 ]]; then
    ok "fast downloads off (FAST_DOWNLOADS=0)"
    return 0
  fi
  if [[ ! -x $VENV/bin/python ]]; then
    ok "fast downloads: chosen once $VENV is installed"
    return 0
  fi
  local major
  major=$("$VENV/bin/python" -c 'import huggingface_hub as h; print(h.__version__.split(".")[0])')
  if ((major >= 1)); then
    export HF_XET_HIGH_PERFORMANCE=${HF_XET_HIGH_PERFORMANCE:-1}
    ok "fast downloads: hf_xet, HF_XET_HIGH_PERFORMANCE=$HF_XET_HIGH_PERFORMANCE (huggingface_hub $major.x ignores hf_transfer)"
  else
    if ! "$VENV/bin/python" -c 'import hf_transfer' 2>/dev/null && ((!CHECK_ONLY)); then
      "$VENV/bin/pip" install -q hf_transfer
    fi
    export HF_HUB_ENABLE_HF_TRANSFER=${HF_HUB_ENABLE_HF_TRANSFER:-1}
    ok "fast downloads: hf_transfer, HF_HUB_ENABLE_HF_TRANSFER=$HF_HUB_ENABLE_HF_TRANSFER"
  fi
}

check_access() {
  if [[ -z $API_KEY ]]; then
    case $HOST in
      127.* | localhost | "::1") ok "no API_KEY (the server listens on $HOST only)" ;;
      *) warn "no API_KEY: anyone who can reach port $PORT can use the server (set API_KEY=...)" ;;
    esac
  else
    ok "API_KEY is set: clients send 'Authorization: Bearer <key>'"
  fi
}

print_endpoints() {
  local proxy mapped_var mapped
  say ""
  say "Endpoints"
  say "  on the pod:   http://127.0.0.1:$PORT"
  if [[ -n ${RUNPOD_POD_ID:-} ]]; then
    proxy="https://$RUNPOD_POD_ID-$PORT.proxy.runpod.net"
    say "  Runpod proxy: $proxy   (needs $PORT under 'Expose HTTP Ports'; requests idle > 100 s are cut: stream long answers)"
    if ((!CHECK_ONLY)); then
      if curl -fsS -o /dev/null --max-time 10 "$proxy/health" 2>/dev/null; then
        say "                (answers /health from here)"
      else
        say "                (no answer from here yet: is port $PORT exposed as an HTTP port?)"
      fi
    fi
  fi
  mapped_var=RUNPOD_TCP_PORT_$PORT
  mapped=${!mapped_var:-}
  if [[ -n ${RUNPOD_PUBLIC_IP:-} && -n $mapped ]]; then
    say "  public TCP:   http://$RUNPOD_PUBLIC_IP:$mapped"
  fi
  if [[ -z ${RUNPOD_POD_ID:-} && -z ${RUNPOD_PUBLIC_IP:-} ]]; then
    say "  (not a Runpod pod: use this host's address and port $PORT)"
  fi
}

say "gptoss-max bring-up$( ((CHECK_ONLY)) && echo ' (--check: nothing is installed or started)')"
say "Checks"
check_tools
pick_python
check_gpu
resolve_model
choose_caches
fast_downloads
check_access
if ((FAILED)); then
  say "some checks failed: nothing installed or started"
  exit 1
fi
if ((CHECK_ONLY)); then
  say ""
  say "Plan: make install-serve PY=$PY; make up MODEL=$MODEL DEVICES=$DEVICES HOST=$HOST PORT=$PORT"
  print_endpoints
  exit 0
fi

say ""
say "Installing into $VENV (first time: several minutes)"
make install-serve PY="$PY" VENV="$VENV"
fast_downloads

say ""
say "Starting the server"
export MODEL DEVICES HOST PORT API_KEY
make up VENV="$VENV"
print_endpoints
