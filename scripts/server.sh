#!/usr/bin/env bash
# The server behind `make serve | up | down | status | logs | bench`.
#
#   scripts/server.sh serve|up|down|status|logs|bench|check-stopped
#
# Settings come from the environment (the Makefile passes its variables): MODEL, DEVICES, HOST,
# PORT, SERVE_ARGS, ENABLE_BENCH, GPTOSS_MAX_API_KEY, LOGS, PIDFILE, UP_TIMEOUT, DOWN_TIMEOUT,
# BENCH_N, BENCH_TOKENS, FOLLOW, BIN (the virtualenv's bin directory).
#
# `up` starts the server in its own session (setsid), so it outlives the terminal and leads a
# process group that holds its model worker; the pid file records that pid and the URL. `down`
# signals only a pid recorded there, and only while it still runs `gptoss-max serve`.
set -euo pipefail

BIN=${BIN:-.venv/bin}
MODEL=${MODEL:-auto}
DEVICES=${DEVICES:-auto}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
SERVE_ARGS=${SERVE_ARGS:-}
ENABLE_BENCH=${ENABLE_BENCH:-1}
API_KEY=${GPTOSS_MAX_API_KEY:-}
LOGS=${LOGS:-logs}
PIDFILE=${PIDFILE:-$LOGS/server.pid}
LOG=$LOGS/server.log
UP_TIMEOUT=${UP_TIMEOUT:-3600}
DOWN_TIMEOUT=${DOWN_TIMEOUT:-60}
BENCH_N=${BENCH_N:-8}
BENCH_TOKENS=${BENCH_TOKENS:-128}

say() { printf '%s\n' "$*"; }
die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

serve_cmd() {
  local extra=()
  read -r -a extra <<<"$SERVE_ARGS"
  CMD=("$BIN/gptoss-max" serve --model "$MODEL" --devices "$DEVICES" --host "$HOST" --port "$PORT")
  if [[ $ENABLE_BENCH == 1 ]]; then CMD+=(--enable-bench); fi
  CMD+=(${extra[@]+"${extra[@]}"})
}

local_url() {
  local host=$HOST
  case $host in "" | 0.0.0.0 | "::" | "[::]") host=127.0.0.1 ;; esac
  if [[ $host == *:* && $host != \[* ]]; then host="[$host]"; fi
  printf 'http://%s:%s\n' "$host" "$PORT"
}

# True while $1 is a live (not zombie) process running `gptoss-max serve`.
is_server() {
  local stat args
  stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ $stat != Z* ]] || return 1
  args=$(ps -o args= -p "$1" 2>/dev/null) || return 1
  [[ $args == *gptoss-max* && $args == *" serve "* ]]
}

recorded_pid() {
  local pid=""
  if [[ -f $PIDFILE ]]; then pid=$(sed -n 1p "$PIDFILE"); fi
  if [[ $pid =~ ^[0-9]+$ ]]; then printf '%s\n' "$pid"; fi
}

# The URL recorded by `up` while its server runs, else the one the settings give.
server_url() {
  local pid
  pid=$(recorded_pid)
  if [[ -n $pid ]] && is_server "$pid"; then sed -n 2p "$PIDFILE"; else local_url; fi
}

healthy() { curl -fsS -o /dev/null --max-time 5 "$1/health" 2>/dev/null; }

# True if something accepts connections at the host and port the server would bind.
port_taken() {
  local host=$HOST
  case $host in "" | 0.0.0.0 | "::" | "[::]") host=127.0.0.1 ;; esac
  (exec 3<>"/dev/tcp/$host/$PORT") 2>/dev/null
}

# curl with the API key, if any, passed on stdin rather than on the command line.
curl_auth() {
  if [[ -n $API_KEY ]]; then
    printf 'header = "Authorization: Bearer %s"\n' "$API_KEY" | curl -K - "$@"
  else
    curl "$@"
  fi
}

cmd_serve() {
  serve_cmd
  say "serving on $(local_url): ${CMD[*]}"
  exec "${CMD[@]}"
}

start_background() {
  serve_cmd
  mkdir -p "$LOGS"
  if [[ -f $LOG ]]; then mv -f "$LOG" "$LOG.1"; fi
  say "starting: ${CMD[*]}"
  say "log: $LOG"
  if command -v setsid >/dev/null; then
    setsid "${CMD[@]}" >"$LOG" 2>&1 </dev/null &
  else
    nohup "${CMD[@]}" >"$LOG" 2>&1 </dev/null &
  fi
  PID=$!
  printf '%s\n%s\n' "$PID" "$(local_url)" >"$PIDFILE"
}

wait_healthy() {
  local pid=$1 url=$2 t0=$SECONDS next=30
  if healthy "$url"; then return 0; fi
  say "waiting for $url/health (a first start downloads the model and compiles graphs: minutes) ..."
  until healthy "$url"; do
    if ! is_server "$pid"; then
      say "the server exited during start-up; the end of $LOG:"
      tail -n 40 "$LOG" || true
      rm -f "$PIDFILE"
      return 1
    fi
    if ((SECONDS - t0 >= UP_TIMEOUT)); then
      say "not healthy after ${UP_TIMEOUT} s; still running as pid $pid: 'make logs' to watch, 'make down' to stop"
      return 1
    fi
    if ((SECONDS - t0 >= next)); then
      say "  ... $((SECONDS - t0)) s: $(tail -n 1 "$LOG" 2>/dev/null | cut -c1-150)"
      next=$((next + 30))
    fi
    sleep 2
  done
  say "healthy after $((SECONDS - t0)) s"
}

print_usage() {
  local url=$1 model auth=""
  model=$(curl -fsS --max-time 5 "$url/health" | "$BIN/python" -c 'import json, sys; print(json.load(sys.stdin)["model"])')
  if [[ -n $API_KEY ]]; then auth=" -H \"Authorization: Bearer \$API_KEY\""; fi
  say ""
  say "gptoss-max is up: $url (model $model)"
  say "  curl -s $url/v1/responses -H 'content-type: application/json'$auth \\"
  say "    -d '{\"model\": \"$model\", \"input\": \"Say hi\", \"max_output_tokens\": 32}'"
  say "  make logs | make bench | make down"
}

cmd_up() {
  local pid url
  pid=$(recorded_pid)
  if [[ -n $pid ]] && is_server "$pid"; then
    url=$(sed -n 2p "$PIDFILE")
    say "gptoss-max is already running (pid $pid, $url); log: $LOG"
  else
    if [[ -f $PIDFILE ]]; then
      say "removing the stale pid file $PIDFILE"
      rm -f "$PIDFILE"
    fi
    url=$(local_url)
    if port_taken; then
      die "port $PORT is in use by another process; stop it or choose another: make up PORT=8001"
    fi
    start_background
    pid=$PID
  fi
  wait_healthy "$pid" "$url"
  print_usage "$url"
}

# Waits up to $2 seconds for process $1 (or process group -$1) to be gone.
wait_gone() {
  local target=$1 deadline=$((SECONDS + $2))
  while kill -0 -- "$target" 2>/dev/null; do
    ((SECONDS < deadline)) || return 1
    sleep 1
  done
}

cmd_down() {
  local pid group=""
  pid=$(recorded_pid)
  if [[ -z $pid ]]; then
    say "nothing to stop (no server recorded in $PIDFILE)"
    return 0
  fi
  if ! is_server "$pid"; then
    say "pid $pid in $PIDFILE no longer runs gptoss-max serve; nothing stopped"
    rm -f "$PIDFILE"
    return 0
  fi
  # The model worker shares the server's process group when setsid made the server its leader.
  if [[ $(ps -o pgid= -p "$pid" | tr -d ' ') == "$pid" ]]; then group=-$pid; fi
  say "stopping gptoss-max (pid $pid) ..."
  kill -TERM "$pid"
  if ! wait_gone "$pid" "$DOWN_TIMEOUT"; then
    say "still running after ${DOWN_TIMEOUT} s: sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    wait_gone "$pid" 10 || die "pid $pid survived SIGKILL"
  fi
  if [[ -n $group ]] && ! wait_gone "$group" 10; then
    say "its worker processes outlived it: stopping process group $pid"
    kill -TERM -- "$group" 2>/dev/null || true
    wait_gone "$group" 15 || kill -KILL -- "$group" 2>/dev/null || true
    wait_gone "$group" 10 || die "process group $pid survived SIGKILL"
  fi
  rm -f "$PIDFILE"
  say "stopped"
}

cmd_status() {
  local pid url
  pid=$(recorded_pid)
  if [[ -z $pid ]] || ! is_server "$pid"; then
    say "not running (no live server recorded in $PIDFILE)"
    return 3
  fi
  url=$(sed -n 2p "$PIDFILE")
  if healthy "$url"; then say "running: pid $pid, $url, healthy"; else say "running: pid $pid, $url, not answering /health yet"; fi
}

cmd_logs() {
  [[ -f $LOG ]] || die "no log at $LOG (start the server with 'make up')"
  if [[ ${FOLLOW:-1} == 1 ]]; then exec tail -n 200 -F "$LOG"; else tail -n 200 "$LOG"; fi
}

cmd_bench() {
  local url out code
  url=$(server_url)
  healthy "$url" || die "no server answers at $url/health: start one with 'make up'"
  say "GET $url/bench?n=$BENCH_N&max_new_tokens=$BENCH_TOKENS ($BENCH_N concurrent requests, each decoding exactly $BENCH_TOKENS tokens)"
  out=$(mktemp)
  code=$(curl_auth -sS --max-time 1800 -o "$out" -w '%{http_code}' "$url/bench?n=$BENCH_N&max_new_tokens=$BENCH_TOKENS")
  if [[ $code != 200 ]]; then
    cat "$out" >&2
    rm -f "$out"
    [[ $code == 404 ]] && die "the decode probe is off: restart with ENABLE_BENCH=1"
    die "GET /bench answered HTTP $code"
  fi
  "$BIN/python" -m json.tool "$out"
  rm -f "$out"
}

cmd_check_stopped() {
  local pid
  pid=$(recorded_pid)
  if [[ -n $pid ]] && is_server "$pid"; then die "a server is running (pid $pid): 'make down' first"; fi
}

case ${1:-} in
  serve) cmd_serve ;;
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  logs) cmd_logs ;;
  bench) cmd_bench ;;
  check-stopped) cmd_check_stopped ;;
  *) die "usage: $0 serve|up|down|status|logs|bench|check-stopped" ;;
esac
